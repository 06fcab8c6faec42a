"""Where one training step's time goes, by kind of operation, and how near its matrix products
run to this device's matmul peak: what is left to win in a step, and where. The step is
train.py's (the model, the fused AdamW, gradient clipping) on random tokens, by default at
nanoGPT's CPU recipe's shape (4 layers, 4 heads, 128 wide, block 64, batch 12, no bias, fp32):

    python bench/step_profile.py [--layers 4] [--width 128] [--heads 4] [--block 64]
        [--batch 12] [--steps 30] [--repeats 3] [--compile]

Each of `--repeats` rounds profiles `--steps` steps (torch.profiler, after 10 untimed ones) and
measures the peak beside them (runs.matmul_peak: the best of a few 2048² matmuls); the table
gives each kind's milliseconds a step, median (min-max) over the rounds.
"""

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runs import matmul_peak, spread  # noqa: E402

from model.attention import AttentionConfig  # noqa: E402
from model.gpt import GPT, GPTConfig  # noqa: E402

# Kinds of operation, by the first of these fragments its aten name holds.
KINDS = {
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm"),
    "attention kernel": ("scaled_dot_product",),
    "GELU": ("gelu",),
    "layer norm": ("layer_norm",),
    "optimizer": ("adam",),
    "embedding, loss": ("embedding", "cross_entropy", "nll_loss", "log_softmax"),
}
VOCAB = 65  # tiny-shakespeare's characters


REST = "the rest (small ops, views, copies, the dispatcher)"


def kind_of(name: str) -> str:
    return next(
        (kind for kind, parts in KINDS.items() if any(part in name for part in parts)), REST
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--batch", type=int, default=12)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=VOCAB,
        block_size=args.block,
        n_layer=args.layers,
        n_embd=args.width,
        bias=False,
        attention=AttentionConfig(n_head=args.heads),
    )
    model = GPT(config)
    if args.compile:
        model.compile()
    optimizer = torch.optim.AdamW(model.optimizer_groups(0.1), lr=1e-3, fused=True)
    parameters = list(model.parameters())

    def step() -> None:
        tokens = torch.randint(VOCAB, (args.batch, args.block + 1))
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(10):
        step()
    per_kind: dict[str, list[float]] = defaultdict(list)
    step_ms, matmul_rate, peaks = [], [], []
    for _ in range(args.repeats):
        peaks.append(matmul_peak())
        with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            step_ms.append((time.perf_counter() - start) / args.steps * 1e3)
        seconds: dict[str, float] = defaultdict(float)
        matmul_flops = 0
        for event in prof.key_averages():
            kind = kind_of(event.key)
            seconds[kind] += event.self_cpu_time_total / 1e6
            if kind == "matmul":
                matmul_flops += event.flops
        for kind in [*KINDS, REST]:
            per_kind[kind].append(seconds[kind] / args.steps * 1e3)
        matmul_rate.append(matmul_flops / seconds["matmul"])

    shape = f"{args.layers} x {args.width}, {args.heads} heads, block {args.block}, batch "
    shape += f"{args.batch}, fp32" + (", compiled" if args.compile else "")
    rounds = f"{args.repeats} rounds of {args.steps} steps"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {shape}; {rounds}\n")
    step_median = statistics.median(step_ms)
    print("| kind | ms a step | share |")
    print("|---|---|---|")
    for kind, values in per_kind.items():
        print(f"| {kind} | {spread(values)} | {statistics.median(values) / step_median:.0%} |")
    print(f"| whole step (wall, profiled) | {spread(step_ms)} | |")
    rates = [rate / 1e9 for rate in matmul_rate]
    shares = [rate / peak for rate, peak in zip(matmul_rate, peaks, strict=True)]
    print(
        f"\nmatmuls: {spread(rates, 0)} GFLOP/s, {spread(shares)} of the peak "
        f"({spread([peak / 1e9 for peak in peaks], 0)} GFLOP/s, 2048² fp32)"
    )


if __name__ == "__main__":
    main()
