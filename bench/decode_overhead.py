"""How much of a cached decoding step is Python around the operations, on the CPU: the model's
own step (generate() with its KV cache) against the same operations on the same weights written
out as one flat loop, with no modules, no checks and the split weights viewed once.

    python bench/decode_overhead.py [--rounds 7] [--tokens 250]

The GPT is generate_speed.py's (nanoGPT's 6 x 384 shape, learned positions, random weights),
fp32 with oneDNN off as generate() runs it, one thread block per thread as ThreadSplitLinear
splits it. The two sides alternate, a round each; the table gives each side's median (min-max)
ms a token and the median (min-max) of the per-round ratios. Both must pick the same greedy
tokens, or the flat loop is not the model's step and the bench stops.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.attention import AttentionConfig  # noqa: E402
from model.generation import generate  # noqa: E402
from model.gpt import GPT, GPTConfig  # noqa: E402


def model_tokens(model: GPT, tokens: int) -> Tensor:
    prompt = torch.zeros((1, 1), dtype=torch.long)
    return torch.stack(list(generate(model, prompt, tokens, greedy=True)), dim=1)


def flat_tokens(model: GPT, tokens: int) -> Tensor:
    """Greedy decoding of `tokens` tokens from token 0 by the model's weights, one flat loop
    (tokens <= block_size: no cache restart)."""
    c, threads = model.config, torch.get_num_threads()
    n_head, width = c.attention.n_head, c.n_embd
    head_dim = width // n_head

    def split(weight: Tensor) -> Tensor:
        return weight.view(threads, -1, weight.size(1))

    def product(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        column = x.reshape(1, 1, -1).mT.expand(threads, -1, -1)
        return torch.bmm(weight, column).view(1, 1, -1) + bias

    layers = [
        (
            (b.ln_1.weight, b.ln_1.bias),
            (split(b.attn.qkv_proj.weight), b.attn.qkv_proj.bias),
            (split(b.attn.out_proj.weight), b.attn.out_proj.bias),
            (b.ln_2.weight, b.ln_2.bias),
            (split(b.mlp.fc.weight), b.mlp.fc.bias),
            (split(b.mlp.proj.weight), b.mlp.proj.bias),
        )
        for b in model.blocks
    ]
    keys = [torch.empty(1, n_head, c.block_size, head_dim) for _ in layers]
    values = [torch.empty(1, n_head, c.block_size, head_dim) for _ in layers]
    token, out = torch.zeros((1, 1), dtype=torch.long), []
    for position in range(tokens):
        x = model.tok_emb(token) + model.pos_emb.weight[position : position + 1]
        for i, (ln_1, qkv, attn_out, ln_2, fc, proj) in enumerate(layers):
            heads = product(F.layer_norm(x, (width,), *ln_1), *qkv).view(1, 1, -1, head_dim)
            q, k, v = heads.transpose(1, 2).split_with_sizes((n_head,) * 3, dim=1)
            keys[i][:, :, position : position + 1] = k
            values[i][:, :, position : position + 1] = v
            seen = position + 1
            o = F.scaled_dot_product_attention(q, keys[i][:, :, :seen], values[i][:, :, :seen])
            x = x + product(o.transpose(1, 2).reshape(1, 1, width), *attn_out)
            x = x + product(F.gelu(product(F.layer_norm(x, (width,), *ln_2), *fc)), *proj)
        token = model.lm_head(model.ln_f(x))[:, -1].argmax(-1, keepdim=True)
        out.append(token[:, 0])
    return torch.stack(out, dim=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=250, help="at most the block, 256")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=65, block_size=256, n_layer=6, n_embd=384, attention=AttentionConfig(n_head=6)
    )
    model = GPT(config).eval()
    if not 0 < args.tokens <= config.block_size:
        parser.error(f"--tokens={args.tokens}: give 1 to {config.block_size}")
    sides = {"model's step": model_tokens, "flat loop": flat_tokens}
    with torch.inference_mode(), torch.backends.mkldnn.flags(enabled=False):
        outputs = {name: run(model, args.tokens) for name, run in sides.items()}  # warm-up
        if not torch.equal(*outputs.values()):
            sys.exit("the flat loop picked other tokens than the model: it is not the same step")
        ms = {name: [] for name in sides}
        for _ in range(args.rounds):
            for name, run in sides.items():
                start = time.perf_counter()
                run(model, args.tokens)
                ms[name].append((time.perf_counter() - start) / args.tokens * 1e3)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.tokens} tokens\n")
    print("| | ms a token, median (min-max) |\n|---|---|")
    for name, values in ms.items():
        print(f"| {name} | {statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f}) |")
    ratios = [m / f for m, f in zip(ms["model's step"], ms["flat loop"], strict=True)]
    print(
        f"| model / flat, per round | {statistics.median(ratios):.2f} "
        f"({min(ratios):.2f}-{max(ratios):.2f}) |"
    )


if __name__ == "__main__":
    main()
