"""Host time to fetch one training batch: TokenBlocks' whole-batch gather (__getitems__, as the
data modules load it) against the DataLoader fetching each example and stacking them (its
default), on the same tokens, sampler and shapes, alternating the two in rounds.

    python bench/batch_fetch.py [--rounds 7] [--batches 300]

Shapes: nanoGPT's CPU recipe (12 x 64), the default config (32 x 128) and nanoGPT's GPU recipe
(64 x 256). Prints each side's median ms per batch (min-max over the rounds) and the median of
the per-round ratios.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.lm_text import TokenBlocks, whole_batch  # noqa: E402
from data.sampler import ResumableShuffle  # noqa: E402

SHAPES = ((12, 64), (32, 128), (64, 256))


class OneByOne(Dataset):
    """The same examples, without __getitems__: the DataLoader fetches and stacks each one."""

    def __init__(self, blocks: TokenBlocks) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.blocks[i]


def milliseconds_per_batch(loader: DataLoader, batches: int) -> float:
    batches_left = iter(loader)
    next(batches_left)  # the iterator's own start
    started = time.perf_counter()
    for _ in range(batches):
        next(batches_left)
    return (time.perf_counter() - started) / batches * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batches", type=int, default=300)
    args = parser.parse_args()
    tokens = np.random.default_rng(0).integers(0, 65, 1_000_000).astype(np.uint16)
    print(f"torch {torch.__version__}; {args.rounds} rounds of {args.batches} batches")
    print("| batch x block | one by one, ms | whole batch, ms | one by one / whole batch |")
    print("|---|---|---|---|")
    for batch_size, block in SHAPES:
        blocks = TokenBlocks(tokens, block, stride=1)

        # a sampler each, of one seed: the same batches on both sides
        orders = [ResumableShuffle(len(blocks), batch_size, seed=0) for _ in range(2)]
        loaders = {
            "one by one": DataLoader(OneByOne(blocks), batch_size, sampler=orders[0]),
            "whole batch": DataLoader(
                blocks, batch_size, sampler=orders[1], collate_fn=whole_batch
            ),
        }
        one, whole = next(iter(loaders["one by one"])), next(iter(loaders["whole batch"]))
        assert all(torch.equal(a, b) for a, b in zip(one, whole, strict=True))
        times: dict[str, list[float]] = {name: [] for name in loaders}
        for _ in range(args.rounds):
            for name, loader in loaders.items():
                times[name].append(milliseconds_per_batch(loader, args.batches))
        ratios = [o / w for o, w in zip(times["one by one"], times["whole batch"], strict=True)]
        cells = [f"{statistics.median(t):.3f} ({min(t):.3f}-{max(t):.3f})" for t in times.values()]
        spread = f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
        print(f"| {batch_size} x {block} | {cells[0]} | {cells[1]} | {spread} |")


if __name__ == "__main__":
    main()
