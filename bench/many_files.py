"""Seconds to build the cache entry (prepare_data and setup, in an empty cache) of data=text_files
over a folder of many small .txt files, one document each, streamed and read whole, for this
checkout and another one (say an older commit: `git worktree add /tmp/old <commit>`), run
alternately in fresh processes so that both see the same machine.

    python bench/many_files.py --other /tmp/old [--files 200] [--repeats 5]

Each process builds, after its imports: the folder streamed (data.streaming=true), the folder
read whole, and the same text in one file streamed, which tells what the files cost beyond
their text. The figures are each checkout's median (min, max) over the processes, and the ratio
this / other.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from runs import compare_checkouts, measured_in_a_process

# A few KB of text a file, in paragraphs: the shape of a corpus of one document per file.
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "and", "runs"]


def document(index: int) -> str:
    """Document `index`: 8 paragraphs of 60 words, about 3 KB."""
    paragraphs = [
        f"Document {index}, paragraph {p}: "
        + " ".join(WORDS[(index * 7 + p * 3 + w) % len(WORDS)] for w in range(60))
        for p in range(8)
    ]
    return "\n\n".join(paragraphs) + "\n"


def build_seconds(root: Path, files: int) -> dict[str, float]:
    """Seconds of each build of the corpus of `files` documents, with the data code of the
    checkout at `root`."""
    sys.path.insert(0, str(root))
    import datasets

    from data.lm import LMDataModule

    datasets.disable_progress_bars()
    seconds = {}
    with tempfile.TemporaryDirectory(prefix="bench_many_files_") as work:
        folder, single = Path(work) / "corpus", Path(work) / "one.txt"
        folder.mkdir()
        texts = [document(i) for i in range(files)]
        for i, text in enumerate(texts):
            (folder / f"{i:05d}.txt").write_text(text)
        single.write_text("\n".join(texts))  # "\n\n" between documents, as in the folder
        builds = {
            f"{files} files streamed": (folder, True),
            f"{files} files read whole": (folder, False),
            "the same text in one file, streamed": (single, True),
        }
        for name, (path, streaming) in builds.items():
            start = time.perf_counter()
            module = LMDataModule(
                source="text_files",
                paths=[str(path)],
                streaming=streaming,
                cache_dir=str(Path(work) / f"cache-{len(seconds)}"),
                block_size=64,
            )
            module.prepare_data()
            module.setup()
            seconds[name] = time.perf_counter() - start
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--other", type=Path, help="another checkout's root")
    parser.add_argument("--files", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)  # one process's side
    args = parser.parse_args()
    if args.measure is not None:
        print(json.dumps(build_seconds(args.measure, args.files)))
        return
    if args.other is None:
        parser.error("--other is required")
    measure = measured_in_a_process(__file__, "--files", str(args.files))
    compare_checkouts(measure, args.other, args.repeats)


if __name__ == "__main__":
    main()
