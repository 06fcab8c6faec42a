"""Cached decoding speed of this checkout against another one (say an older commit: `git worktree
add /tmp/old <commit>`), run alternately in fresh processes so that both see the same machine:
the GPT of generate_speed.py (6 x 384, block 256, random weights) sampling 500 new tokens
greedily at batch 1 with its KV cache, on the CPU.

    python bench/decode_checkouts.py --other /tmp/old [--repeats 5]

Each process times 3 runs after a warm-up and reports their median tokens/s; the table gives
each checkout's median (min, max) over the processes, and the ratio this / other.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

from runs import compare_checkouts, measured_in_a_process

NEW_TOKENS = 500


def cached_tokens_per_second(root: Path) -> float:
    """Median tokens/s of 3 cached decodes with the model code of the checkout at `root`."""
    sys.path.insert(0, str(root))
    import torch

    from model.attention import AttentionConfig
    from model.generation import generate
    from model.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=65, block_size=256, n_layer=6, n_embd=384, attention=AttentionConfig(n_head=6)
    )
    model = GPT(config).eval()
    prompt = torch.zeros((1, 1), dtype=torch.long)

    def decode() -> float:
        start = time.perf_counter()
        for _ in generate(model, prompt, NEW_TOKENS, use_cache=True, greedy=True):
            pass
        return time.perf_counter() - start

    decode()  # warm-up
    return NEW_TOKENS / statistics.median(decode() for _ in range(3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--other", type=Path, help="another checkout's root")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)  # one process's side
    args = parser.parse_args()
    if args.measure is not None:
        print(cached_tokens_per_second(args.measure))
        return
    if args.other is None:
        parser.error("--other is required")
    measure = measured_in_a_process(__file__)
    compare_checkouts(measure, args.other, args.repeats, unit="tokens/s")


if __name__ == "__main__":
    main()
