"""One Muon step for a model's hidden weight matrices, Newton-Schulz in bf16 (as torch.optim.Muon
always does) against fp32, alternating, on this machine's CPU:

    python bench/muon_step.py [--layers 4] [--width 128] [--repeats 7]

Prints the median milliseconds a step (min-max) for each and the median of the per-round
ratios bf16 / fp32; on a CPU without bf16 units (training/precision.py) bf16 is emulated.
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch
from runs import alternating_seconds

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.gpt import GPT, GPTConfig  # noqa: E402
from training.optimizers import Muon  # noqa: E402
from training.precision import cpu_capabilities, multiplies_bf16  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5, help="steps timed per round")
    args = parser.parse_args()
    config = GPTConfig(n_layer=args.layers, n_embd=args.width, vocab_size=65)
    decayed, _ = GPT(config).optimizer_groups(0.1)
    for weight in decayed["params"]:
        weight.grad = torch.randn_like(weight)
    optimizers = {
        dtype: Muon([decayed], lr=1e-3, adjust_lr_fn="match_rms_adamw", ns_dtype=dtype)
        for dtype in (torch.bfloat16, torch.float32)
    }
    steps = {dtype: optimizer.step for dtype, optimizer in optimizers.items()}
    seconds = alternating_seconds(steps, args.repeats, calls=args.steps)
    times = {dtype: [s * 1e3 for s in values] for dtype, values in seconds.items()}
    cpu = cpu_capabilities().get("cpu_name", "")
    shapes = sorted({tuple(w.shape) for w in decayed["params"]})
    print(f"{cpu}, {torch.get_num_threads()} threads, bf16 units: {multiplies_bf16('cpu')}")
    print(f"{len(decayed['params'])} matrices of shapes {shapes}; {args.repeats} rounds")
    for dtype, values in times.items():
        median = statistics.median(values)
        print(f"{str(dtype):>15}: {median:8.2f} ms a step ({min(values):.2f}-{max(values):.2f})")
    ratios = [b / f for b, f in zip(times[torch.bfloat16], times[torch.float32], strict=True)]
    print(f"bf16 / fp32: {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
