"""Our recipes against each other on nanoGPT's tiny-shakespeare split: how long from launch each
takes to reach a validation loss. For tuning a recipe such as experiment=gpu_fast before
bench/vs_nanogpt.py --own measures it against nanoGPT.

    python bench/time_to_loss.py --text ../shared/anchors/tinyshakespeare --target 1.4713 \\
        --recipes "experiment=gpu_fast" "experiment=gpu_fast optim.name=adamw" [--rounds 1]

Each recipe first runs 20 untimed steps (its compile cache is then warm, as for a user's second
run); then each round runs every recipe once, in turn (A B A B ...), seed 1337 + round. Per run:
whole-process wall, steady tokens/s, seconds from launch to the first optimizer step and to the
first validation at or below the target, the best validation loss, and every validation as
step: seconds from launch, loss.
"""

import argparse
import json
import tempfile
from pathlib import Path

from vs_nanogpt import own_command, run_ours, show, show_validations

COLUMNS = ["wall", "tokens_per_sec", "first_step", "to_target", "best_val"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text", type=Path, required=True, help="train.txt and val.txt's folder")
    parser.add_argument("--target", type=float, required=True, help="the validation loss to reach")
    parser.add_argument("--recipes", nargs="+", required=True, help="train.py overrides, each")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    text = args.text.resolve()
    scratch = Path(tempfile.mkdtemp(prefix="time_to_loss-"))
    for index, overrides in enumerate(args.recipes):
        print(f"recipe {index}: {overrides}", flush=True)
        warm_dir = scratch / f"warm-{index}"
        run_ours(own_command(text, warm_dir, overrides.split(), 20), text, warm_dir, score=False)
    print(f"\n{'run':<16}" + "".join(f"{key:>16}" for key in COLUMNS))
    results: dict[str, list[dict]] = {overrides: [] for overrides in args.recipes}
    for round_ in range(args.rounds):
        for index, overrides in enumerate(args.recipes):
            run_dir = scratch / f"run-{index}-{round_}"
            command = own_command(text, run_dir, [*overrides.split(), f"seed={1337 + round_}"])
            row = run_ours(command, text, run_dir, score=False, target=args.target)
            results[overrides].append(row)
            show(f"recipe {index} #{round_}", row, COLUMNS)
            show_validations(row)
    (scratch / "results.json").write_text(json.dumps(results, indent=2))
    print(f"\nall figures: {scratch / 'results.json'}")


if __name__ == "__main__":
    main()
