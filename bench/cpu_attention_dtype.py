"""torch's fused attention kernel on the CPU, fp32 against bf16, forward + backward, by head
width: the measurement behind model/attention.py's fused_attention, which runs heads narrower
than 64 in fp32 under bf16 autocast.

    python bench/cpu_attention_dtype.py [--repeats 7]

Each shape runs the two dtypes alternately (runs.alternating_seconds: the order reversed every
other round), `--repeats` rounds of 20 calls each after a warm-up call, and reports the median
milliseconds per call (min-max) and the median of the per-round ratios bf16 / fp32.
"""

import argparse
import statistics

import torch
import torch.nn.functional as F
from runs import alternating_seconds

# (batch, heads, length, head dim): the nanoGPT CPU recipe's, experiment=cpu_fast's, nanoGPT's
# shakespeare_char GPU shape's and a long-context one.
SHAPES = [(12, 4, 64, 32), (32, 4, 128, 32), (8, 6, 256, 64), (4, 12, 1024, 64)]
CALLS = 20


def causal_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """One causal forward + backward."""
    F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| batch, heads, length, head dim | fp32 ms | bf16 ms | bf16 / fp32 |")
    print("|---|---|---|---|")
    for shape in SHAPES:
        inputs = {
            dtype: [torch.randn(shape, dtype=dtype, requires_grad=True) for _ in range(3)]
            for dtype in (torch.float32, torch.bfloat16)
        }
        steps = {dtype: lambda t=tensors: causal_step(*t) for dtype, tensors in inputs.items()}
        seconds = alternating_seconds(steps, args.repeats, calls=CALLS)
        fp32, bf16 = ([s * 1000 for s in seconds[d]] for d in (torch.float32, torch.bfloat16))
        ratio = statistics.median(b / f for b, f in zip(bf16, fp32, strict=True))
        cells = [f"{statistics.median(t):.2f} ({min(t):.2f}-{max(t):.2f})" for t in (fp32, bf16)]
        print(f"| {', '.join(map(str, shape))} | {cells[0]} | {cells[1]} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
