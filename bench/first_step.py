"""Seconds from launching `python train.py` to the end of its first optimizer step, to the end
of the whole process, and spent on the training thread in checkpoints, with a warm data cache,
for this checkout and another one (say an older commit: `git worktree add /tmp/old <commit>`),
run alternately so that both see the same machine.

    python bench/first_step.py --other /tmp/old [--repeats 5] [-- overrides...]

`--python` and `--other-python` run each checkout with its own interpreter (a venv of its own
dependencies: `python -m venv /tmp/ov && /tmp/ov/bin/pip install -e /tmp/old`); both default
to this one.

Each run is the default config (W&B offline, the default model and data) stopped after a few
steps: its own `seconds_to_first_step` (summary.json, counted from process start), and the wall
time of the whole process, which adds the few steps, the attention maps of the last one, the
end-of-run printout and the exit; and its `checkpoint_seconds` and `attention_maps_seconds` (on
the training thread). Overrides such as `trainer.max_steps=200 trainer.val_check_interval=50`
make a run whose checkpoints weigh. Both
checkouts share one data cache, warmed by a run of each first.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from runs import compare_checkouts


def start_and_end_seconds(
    python: str, root: Path, overrides: list[str], cache: str
) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="first_step-") as run_dir:
        started = time.perf_counter()
        subprocess.run(
            [python, str(root / "train.py"), *overrides, f"hydra.run.dir={run_dir}"],
            cwd=root,
            env={**os.environ, "TINYFORMER_CACHE": cache},
            capture_output=True,
            check=True,
        )
        whole = time.perf_counter() - started
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
    return {
        "first step": summary["seconds_to_first_step"],
        "whole process": whole,
        "checkpoints (training thread)": summary["checkpoint_seconds"],
        "attention maps (training thread)": summary["attention_maps_seconds"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--other", type=Path, required=True, help="another checkout's root")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--python", default=sys.executable, help="this checkout's interpreter")
    parser.add_argument("--other-python", default=sys.executable, help="the other's interpreter")
    parser.add_argument("overrides", nargs="*", help="train.py overrides for both")
    args = parser.parse_args()
    overrides = ["trainer.max_steps=3", "trainer.val_check_interval=3", *args.overrides]
    this = Path(__file__).resolve().parents[1]
    pythons = {args.other.resolve(): args.other_python, this: args.python}
    with tempfile.TemporaryDirectory(prefix="first_step-cache-") as cache:
        for root, python in pythons.items():  # warm the data cache and each side's compile caches
            start_and_end_seconds(python, root, overrides, cache)
        compare_checkouts(
            lambda root: start_and_end_seconds(pythons[root.resolve()], root, overrides, cache),
            args.other,
            args.repeats,
        )


if __name__ == "__main__":
    main()
