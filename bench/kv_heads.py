"""What fewer key/value heads buy at decoding time: the KV cache's size and the speed of cached
decoding, for each n_kv_head of one shape, measured side by side in one run (the variants take
turns, `--pairs` rounds; medians with min-max).

    python bench/kv_heads.py                                     # ablation_kv_heads' shape
    python bench/kv_heads.py --n-layer 6 --n-embd 384 --n-head 6 --kv 6,3,2,1 --block 256

Weights are random: neither the speed nor the cache's size depends on them. Each decode is 1
prompt token and block - 1 new ones, greedy, batch 1, so the cache ends full.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.attention import AttentionConfig  # noqa: E402
from model.gpt import GPT, GPTConfig  # noqa: E402


def cache_bytes(model: GPT) -> int:
    """Bytes of a full KV cache: keys and values of every layer, batch 1, float32."""
    cache = model.new_cache()
    with torch.no_grad():
        model(torch.zeros((1, model.config.block_size), dtype=torch.long), cache=cache)
    return sum(c.keys.nbytes + c.values.nbytes for c in cache)


@torch.no_grad()
def decode_seconds(model: GPT) -> float:
    """Seconds to decode block - 1 tokens greedily with the KV cache."""
    idx = torch.zeros((1, 1), dtype=torch.long)
    cache = model.new_cache()
    start = time.perf_counter()
    logits, _ = model(idx, cache=cache)
    for _ in range(model.config.block_size - 1):
        idx = logits[:, -1].argmax(-1, keepdim=True)
        logits, _ = model(idx, cache=cache)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--kv", default="8,4,1", help="n_kv_head values, comma-separated")
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--pairs", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    models = {}
    for n_kv_head in map(int, args.kv.split(",")):
        attention = AttentionConfig(n_head=args.n_head, n_kv_head=n_kv_head)
        config = GPTConfig(
            vocab_size=65,
            block_size=args.block,
            n_layer=args.n_layer,
            n_embd=args.n_embd,
            attention=attention,
        )
        models[n_kv_head] = GPT(config).eval()
    seconds = {n: [] for n in models}
    for model in models.values():
        decode_seconds(model)  # warm-up
    for _ in range(args.pairs):
        for n, model in models.items():
            seconds[n].append(decode_seconds(model))
    full = models[max(models)]
    print(
        f"{args.n_layer} layers x {args.n_embd} wide, {args.n_head} query heads, block "
        f"{args.block}; {args.pairs} rounds, torch threads {torch.get_num_threads()}"
    )
    print("| n_kv_head | KV cache (KiB) | vs MHA | tokens/s median (min-max) | vs MHA |")
    print("|---|---|---|---|---|")
    base_bytes = cache_bytes(full)
    base_speed = (args.block - 1) / statistics.median(seconds[max(models)])
    for n, model in models.items():
        size = cache_bytes(model)
        speeds = [(args.block - 1) / s for s in seconds[n]]
        speed = statistics.median(speeds)
        print(
            f"| {n} | {size / 1024:.0f} | {size / base_bytes:.2f} | {speed:.0f} "
            f"({min(speeds):.0f}-{max(speeds):.0f}) | {speed / base_speed:.2f} |"
        )


if __name__ == "__main__":
    main()
