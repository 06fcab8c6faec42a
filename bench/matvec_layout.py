"""The matrix-vector products of a cached decoding step, one token at batch 1, on this machine's
CPU: `nn.Linear`'s layout (weight stored (out, in), as F.linear reads it) against the same
weights stored (in, out), the products split over the threads as model/layers.py
`ThreadSplitLinear` does it, and a plain read of the weights (a sum) as the memory's speed:

    python bench/matvec_layout.py [--width 384] [--layers 6] [--repeats 15]

The weights are those of a GPT of that width and depth (4 matrices a layer: q/k/v, out, MLP in
and out), 42 MB for nanoGPT's 6 x 384, more than the caches hold, as in decoding. The sides
alternate round by round; each prints its median milliseconds for all the products (min-max) and
the GB/s that makes, then the median (min-max) of the per-round ratios of F.linear to each of
the other two layouts. A width whose matrices ThreadSplitLinear would not split (too small, or
rows the threads do not divide) is refused.
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from runs import alternating_seconds

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.layers import ThreadSplitLinear, split_one_rows  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    width = args.width
    shapes = [(3 * width, width), (width, width), (4 * width, width), (width, 4 * width)]
    weights = [torch.randn(shape) for shape in shapes * args.layers]  # (out, in)
    input_major = [weight.T.contiguous() for weight in weights]  # (in, out)
    rows = {weight.size(1): torch.randn(1, weight.size(1)) for weight in weights}
    split = []
    for weight in weights:
        layer = ThreadSplitLinear(weight.size(1), weight.size(0), bias=False)
        layer.weight = torch.nn.Parameter(weight, requires_grad=False)
        split.append(layer)
    threads = torch.get_num_threads()
    with torch.inference_mode(), split_one_rows(threads):
        if any(layer.blocks_for(rows[layer.in_features]) == 1 for layer in split):
            sys.exit(
                f"--width {width}: ThreadSplitLinear does not split these matrices on "
                f"{threads} threads; give a larger width"
            )
    sides = {
        "F.linear, (out, in)": lambda: [F.linear(rows[w.size(1)], w) for w in weights],
        "x @ w, (in, out)": lambda: [rows[w.size(0)] @ w for w in input_major],
        "ThreadSplitLinear": lambda: [layer(rows[layer.in_features]) for layer in split],
        "sum, the memory's speed": lambda: [w.sum() for w in weights],
    }
    with torch.inference_mode(), split_one_rows(threads):  # as in a decoding step
        times = alternating_seconds(sides, args.repeats)
    gigabytes = sum(w.numel() * w.element_size() for w in weights) / 1e9
    print(f"{len(weights)} matrices, {gigabytes * 1e3:.0f} MB, {torch.get_num_threads()} threads")
    for name, values in times.items():
        median = statistics.median(values)
        print(
            f"{name:>24}: {median * 1e3:6.2f} ms ({min(values) * 1e3:.2f}-{max(values) * 1e3:.2f})"
            f", {gigabytes / median:5.1f} GB/s"
        )
    for other in ("x @ w, (in, out)", "ThreadSplitLinear"):
        ratios = [a / b for a, b in zip(times["F.linear, (out, in)"], times[other], strict=True)]
        print(
            f"F.linear / {other}: {statistics.median(ratios):.2f} "
            f"({min(ratios):.2f}-{max(ratios):.2f})"
        )


if __name__ == "__main__":
    main()
