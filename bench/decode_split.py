"""Cached decoding at batch 1 on the CPU with the one-row products split over the threads
(model/layers.py `ThreadSplitLinear`) and without, for GPTs of growing size, to see where
splitting pays:

    python bench/decode_split.py [--tokens 120] [--repeats 8]

Three sides per model, alternating round by round (every other round in reverse order):
`plain` never splits, `always` splits every matrix, `rule` splits as the model does (matrices of
SPLIT_MIN_WEIGHTS weights and more). Each model samples --tokens new tokens greedily from random
weights; the table gives plain's median ms a token and the median (min-max) of the per-round
speed-ups plain / always and plain / rule.
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch
from runs import alternating_seconds, spread

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model import layers  # noqa: E402
from model.attention import AttentionConfig  # noqa: E402
from model.generation import generate  # noqa: E402
from model.gpt import GPT, GPTConfig  # noqa: E402

# (layers, width, heads): from one that sits in the caches to nanoGPT's 6 x 384 and beyond.
SHAPES = [(4, 128, 4), (6, 192, 6), (6, 256, 8), (6, 384, 6), (8, 512, 8)]
# The threshold each side sets: never, always, and the model's own rule.
SIDES = {"plain": 2**62, "always": 0, "rule": layers.SPLIT_MIN_WEIGHTS}


def decoding_seconds(model: GPT, tokens: int, repeats: int) -> dict[str, list[float]]:
    """Each side's seconds per decode of `tokens` tokens, round by round."""
    prompt = torch.zeros((1, 1), dtype=torch.long)

    def decode(threshold: int) -> None:
        layers.SPLIT_MIN_WEIGHTS = threshold
        list(generate(model, prompt, tokens, greedy=True))

    sides = {name: (lambda t=threshold: decode(t)) for name, threshold in SIDES.items()}
    try:
        return alternating_seconds(sides, repeats)
    finally:
        layers.SPLIT_MIN_WEIGHTS = SIDES["rule"]


def speedup(times: dict[str, list[float]], side: str) -> str:
    """Median (min-max) of the per-round ratios plain / side."""
    ratios = [p / s for p, s in zip(times["plain"], times[side], strict=True)]
    return spread(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=120)
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    print(f"{torch.get_num_threads()} threads, {args.tokens} tokens a run, {args.repeats} rounds\n")
    print("| model | weights | plain ms/token | plain / always | plain / rule |")
    print("|---|---|---|---|---|")
    for n_layer, width, n_head in SHAPES:
        torch.manual_seed(0)
        config = GPTConfig(
            vocab_size=65,
            block_size=256,
            n_layer=n_layer,
            n_embd=width,
            attention=AttentionConfig(n_head=n_head),
        )
        model = GPT(config).eval()
        times = decoding_seconds(model, args.tokens, args.repeats)
        megabytes = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
        plain_ms = statistics.median(times["plain"]) / args.tokens * 1e3
        print(
            f"| {n_layer}x{width} | {megabytes:.0f} MB | {plain_ms:.2f} | "
            f"{speedup(times, 'always')} | {speedup(times, 'rule')} |"
        )


if __name__ == "__main__":
    main()
