"""generate.py's start-up: seconds from launching it to its first streamed byte, for this
checkout and another one (say an older commit: `git worktree add /tmp/old <commit>`), run
alternately so that both see the same machine.

    python bench/generate_startup.py --ckpt <run dir> --other /tmp/old [--repeats 5]

The time covers interpreter start, imports, the checkpoint load and the first token.
"""

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def first_byte_seconds(root: Path, ckpt: str) -> float:
    start = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, str(root / "generate.py"), f"ckpt={ckpt}", "max_new_tokens=50"],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    process.stdout.read(1)
    seconds = time.perf_counter() - start
    process.communicate()
    if process.returncode != 0:
        raise SystemExit(f"generate.py in {root} failed (status {process.returncode})")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", required=True, help="a run directory or .ckpt both can load")
    parser.add_argument("--other", type=Path, required=True, help="another checkout's root")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    roots = {"other": args.other.resolve(), "this": HERE}
    times: dict[str, list[float]] = {name: [] for name in roots}
    for _ in range(args.repeats):
        for name, root in roots.items():
            times[name].append(first_byte_seconds(root, args.ckpt))
    for name, values in times.items():
        print(
            f"{name:5s} ({roots[name]}): median {statistics.median(values):.2f} s "
            f"(min {min(values):.2f}, max {max(values):.2f}, {args.repeats} runs)"
        )
    ratio = statistics.median(times["this"]) / statistics.median(times["other"])
    print(f"this / other: {ratio:.2f}")


if __name__ == "__main__":
    main()
