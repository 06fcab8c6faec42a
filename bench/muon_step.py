"""One Muon step for a model's hidden weight matrices, alternating: ours with Newton-Schulz in
bf16 (as torch.optim.Muon always does); the same given the update guard's flag ("guarded", as
training steps on a GPU: training/guard.py); ours in fp32, stacking the matrices of one shape,
and in fp32 one matrix at a time (each in a param group of its own); and torch.optim.Muon
itself (torch >= 2.9), which orthogonalises one matrix at a time:

    python bench/muon_step.py [--layers 4] [--width 128] [--repeats 7] [--device cpu|cuda]

Prints the median milliseconds a step (min-max) for each, and the medians of the per-round
ratios to ours in bf16 (torch's is the same arithmetic: tests/test_optimizers.py holds them
equal up to the rounding of bf16 products), and of one matrix at a time to stacked, in fp32.
On a CPU without bf16 units (training/precision.py) bf16 is emulated.
"""

import argparse
import statistics
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from runs import alternating_seconds, spread

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.gpt import GPT, GPTConfig  # noqa: E402
from training.optimizers import Muon  # noqa: E402
from training.precision import cpu_capabilities, multiplies_bf16  # noqa: E402


def ratio(times: dict[str, list[float]], side: str, other: str) -> str:
    ratios = [a / b for a, b in zip(times[side], times[other], strict=True)]
    return f"{side} / {other}: {spread(ratios)}"


def synchronized(step: Callable) -> Callable:
    def step_and_wait() -> None:
        step()
        torch.cuda.synchronize()

    return step_and_wait


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5, help="steps timed per round")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    config = GPTConfig(n_layer=args.layers, n_embd=args.width, vocab_size=65)
    decayed, _ = GPT(config).to(args.device).optimizer_groups(0.1)
    for weight in decayed["params"]:
        weight.grad = torch.randn_like(weight)
    options = {"lr": 1e-3, "adjust_lr_fn": "match_rms_adamw"}
    unflagged = torch.zeros((), device=args.device)
    steps = {
        "ours bf16": Muon([decayed], **options, ns_dtype=torch.bfloat16).step,
        "guarded": partial(  # given the flag of a step to keep, as the guard gives it
            Muon([decayed], **options, ns_dtype=torch.bfloat16).step, found_inf=unflagged
        ),
        "ours fp32": Muon([decayed], **options, ns_dtype=torch.float32).step,
        "one by one": Muon(
            [{"params": [weight]} for weight in decayed["params"]],
            **options,
            ns_dtype=torch.float32,
        ).step,
    }
    if hasattr(torch.optim, "Muon"):
        steps["torch's"] = torch.optim.Muon([decayed], **options).step
    if args.device != "cpu":  # the steps' kernels, not only their launches
        steps = {side: synchronized(step) for side, step in steps.items()}
    seconds = alternating_seconds(steps, args.repeats, calls=args.steps)
    times = {side: [s * 1e3 for s in values] for side, values in seconds.items()}
    if args.device == "cpu":
        cpu = cpu_capabilities().get("cpu_name", "")
        print(f"{cpu}, {torch.get_num_threads()} threads, bf16 units: {multiplies_bf16('cpu')}")
    else:
        print(torch.cuda.get_device_name(args.device))
    shapes = sorted({tuple(w.shape) for w in decayed["params"]})
    print(f"{len(decayed['params'])} matrices of shapes {shapes}; {args.repeats} rounds")
    for side, values in times.items():
        median = statistics.median(values)
        print(f"{side:>10}: {median:8.2f} ms a step ({min(values):.2f}-{max(values):.2f})")
    for side in times:
        if side != "ours bf16":
            print(ratio(times, side, "ours fp32" if side == "one by one" else "ours bf16"))


if __name__ == "__main__":
    main()
