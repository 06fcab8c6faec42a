"""Throughput of trainer=ddp_cpu (2 processes, gloo) against one process at the same global
batch (2 x 16 vs 1 x 32 blocks), run back to back. Extra arguments are train.py overrides.

    python bench/ddp_cpu.py trainer.max_steps=150
"""

import sys

from runs import last, median_after, train

COMMON = ["trainer.val_check_interval=50", "trainer.limit_val_batches=8"]


def main(overrides: list[str]) -> None:
    setups = {
        "single": ["trainer=cpu", "data.batch_size=32"],
        "ddp_cpu": ["trainer=ddp_cpu", "data.batch_size=16"],
    }
    results = {}
    print("| setup (global batch 32) | tokens/s (median) | wall s | final val loss |")
    print("|---|---|---|---|")
    for name, setup in setups.items():
        seconds, rows = train(*setup, *COMMON, *overrides)
        results[name] = median_after(rows, "train/tokens_per_sec", 3)
        print(f"| {name} | {results[name]:,.0f} | {seconds:.0f} | {last(rows, 'val/loss'):.3f} |")
    single, ddp = results.values()
    print(f"\nddp_cpu / single process tokens/s: {ddp / single:.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
