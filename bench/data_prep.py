"""Time to prepare the embedded corpus (normalise, split, train the tokenizer, encode, write the
cache entry) cold, in an empty cache, and warm, when the entry is reused; for each tokenizer
and for one and two tokenizing processes.

    python bench/data_prep.py
"""

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import datasets  # noqa: E402

from data.lm import LMDataModule  # noqa: E402


def prepare(cache_dir: str, **options) -> tuple[float, bool]:
    start = time.perf_counter()
    module = LMDataModule(cache_dir=cache_dir, **options)
    module.prepare_data()
    module.setup()
    return time.perf_counter() - start, module.cache_hit


def main() -> None:
    datasets.disable_progress_bars()
    print("| tokenizer | num_proc | cold s | warm s | tokens (train) |")
    print("|---|---|---|---|---|")
    for tokenizer in ("char", "bpe"):
        for num_proc in (1, 2):
            options = {"tokenizer": tokenizer, "num_proc": num_proc}
            with tempfile.TemporaryDirectory(prefix="bench_prep_") as cache:
                cold, hit = prepare(cache, **options)
                assert not hit
                warm, hit = prepare(cache, **options)
                assert hit
                module = LMDataModule(cache_dir=cache, **options)
                module.setup()
                tokens = len(module._split("train"))
            print(f"| {tokenizer} | {num_proc} | {cold:.2f} | {warm:.3f} | {tokens:,} |")


if __name__ == "__main__":
    main()
