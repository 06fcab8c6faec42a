"""generate.py's start-up: seconds from launching it to its first streamed byte, for this
checkout and another one (say an older commit: `git worktree add /tmp/old <commit>`), run
alternately so that both see the same machine.

    python bench/generate_startup.py --ckpt <run dir> --other /tmp/old [--repeats 5]

The time covers interpreter start, imports, the checkpoint load and the first token.
"""

import argparse
import subprocess
import sys
import time
from pathlib import Path

from runs import compare_checkouts


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
    compare_checkouts(lambda root: first_byte_seconds(root, args.ckpt), args.other, args.repeats)


if __name__ == "__main__":
    main()
