"""Time and peak memory of one causal self-attention layer, forward + backward, against the
sequence length T: the O(T²) of attention, measured.

Rows, all on the same input x (B, T, C) and the same projection weights:
- `math`:   MultiHeadAttention with need_weights=True (explicit softmax(QKᵀ/√d)V; the T×T
            weights are materialised and returned);
- `fused`:  MultiHeadAttention as used in training (PyTorch's fused kernel, is_causal);
- `window`: MultiHeadAttention with a 128-key sliding window (fused kernel with a mask);
- `sdpa`:   the bare baseline, the same qkv/out projections around
            torch.nn.functional.scaled_dot_product_attention(is_causal=True).

    python bench/attention_scaling.py [--device cuda] [--out docs/attention_scaling_cpu]
        [--batch 1 --width 256 --heads 4]

(B=1, C=256 suits a CPU; on a GPU, such a layer is bound by kernel launches, and a layer of
GPT-2 small's size, --batch 8 --width 768 --heads 12, measures the kernels.)

Writes <out>.md (the table) and <out>.png (log-log plot). On CPU each measurement runs in its
own process so that its peak resident memory is its own; on CUDA the allocator's peak is used.
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.attention import AttentionConfig, MultiHeadAttention  # noqa: E402

LENGTHS = [128, 256, 512, 1024, 2048, 4096]
PATHS = ["math", "fused", "window", "sdpa"]
WINDOW = 128


@dataclass
class Shape:
    batch: int = 1
    width: int = 256
    heads: int = 4

    def arguments(self) -> list[str]:
        return ["--batch", str(self.batch), "--width", str(self.width), "--heads", str(self.heads)]


def attention_step(path: str, device: torch.device, shape: Shape):
    """A function running forward + backward of `path` on an input."""
    config = AttentionConfig(n_head=shape.heads, window=WINDOW if path == "window" else None)
    mha = MultiHeadAttention(shape.width, config, causal=True).to(device)
    batch, width, heads = shape.batch, shape.width, shape.heads

    def bare_sdpa(x: torch.Tensor) -> torch.Tensor:
        # The module's own projections, so only the attention in between differs.
        q, k, v = mha.q_proj(x), mha.k_proj(x), mha.v_proj(x)
        split = [t.view(batch, -1, heads, width // heads).transpose(1, 2) for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*split, is_causal=True)
        return mha.out_proj(out.transpose(1, 2).reshape(batch, -1, width))

    def step(x: torch.Tensor) -> None:
        if path == "sdpa":
            out = bare_sdpa(x)
        else:
            out = mha(x, need_weights=path == "math")
            out = out[0] if isinstance(out, tuple) else out
        out.float().square().mean().backward()

    return step


def measure(path: str, length: int, device: torch.device, repeats: int, shape: Shape) -> dict:
    torch.manual_seed(0)
    step = attention_step(path, device, shape)
    x = torch.randn(shape.batch, length, shape.width, device=device, requires_grad=True)
    step(x)  # warm-up: kernels chosen, buffers allocated
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = []
    for _ in range(repeats):
        x.grad = None
        start = time.perf_counter()
        step(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:  # the high-water mark includes the warm-up's, which did the same work
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "path": path,
        "T": length,
        "ms": 1000 * statistics.median(times),
        "peak_mb": peak / 2**20,
        "peak_is_total": device.type != "cuda",
    }


def measure_in_child(path: str, length: int, repeats: int, shape: Shape) -> dict:
    """CPU: a fresh process per measurement, its resident-memory peak minus a bare process's."""
    command = [sys.executable, __file__, "--one", path, str(length), "--repeats", str(repeats)]
    command += shape.arguments()
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.splitlines()[-1])


def idle_rss_mb() -> float:
    command = [sys.executable, __file__, "--idle"]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return float(result.stdout.splitlines()[-1])


def write_plot(rows: list[dict], out: Path, device: torch.device) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (time_ax, memory_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for path in PATHS:
        points = [r for r in rows if r["path"] == path]
        lengths = [r["T"] for r in points]
        time_ax.loglog(lengths, [r["ms"] for r in points], "o-", label=path, base=2)
        memory_ax.loglog(
            lengths, [max(r["peak_mb"], 0.1) for r in points], "o-", label=path, base=2
        )
    reference = [r for r in rows if r["path"] == "math"]
    scale = reference[-1]["ms"] / LENGTHS[-1] ** 2
    time_ax.loglog(LENGTHS, [scale * t**2 for t in LENGTHS], "k:", label="∝ T²", base=2)
    time_ax.set(xlabel="T (tokens)", ylabel="forward + backward, ms", title=f"time ({device})")
    memory_ax.set(xlabel="T (tokens)", ylabel="peak memory, MiB", title="extra peak memory")
    for ax in (time_ax, memory_ax):
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out.with_suffix(".png"), dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("attention_scaling"))
    parser.add_argument("--one", nargs=2, metavar=("PATH", "T"), help=argparse.SUPPRESS)
    parser.add_argument("--idle", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=Shape.batch)
    parser.add_argument("--width", type=int, default=Shape.width)
    parser.add_argument("--heads", type=int, default=Shape.heads)
    args = parser.parse_args()
    device = torch.device(args.device)
    shape = Shape(args.batch, args.width, args.heads)
    if args.idle:
        torch.ones(1)
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        return
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]), device, args.repeats, shape)))
        return

    idle = idle_rss_mb() if device.type == "cpu" else 0.0
    rows = []
    for length in LENGTHS:
        for path in PATHS:
            if device.type == "cpu":
                row = measure_in_child(path, length, args.repeats, shape)
                row["peak_mb"] -= idle
            else:
                row = measure(path, length, device, args.repeats, shape)
            rows.append(row)
            print(
                f"T={length:5d} {path:7s} {row['ms']:9.2f} ms {row['peak_mb']:9.1f} MiB",
                file=sys.stderr,
            )
    header = "| T | " + " | ".join(f"{p} ms | {p} MiB" for p in PATHS)
    header += " | fused / sdpa |\n|---|" + "---|---|" * len(PATHS) + "---|\n"
    lines = []
    for length in LENGTHS:
        by_path = {r["path"]: r for r in rows if r["T"] == length}
        cells = " | ".join(f"{by_path[p]['ms']:.2f} | {by_path[p]['peak_mb']:.0f}" for p in PATHS)
        ratio = by_path["fused"]["ms"] / by_path["sdpa"]["ms"]
        lines.append(f"| {length} | {cells} | {ratio:.2f} |")
    memory_note = (
        "peak resident memory above an idle torch process"
        if device.type == "cpu"
        else "peak CUDA memory allocated above the inputs and weights"
    )
    table = (
        f"Device: {device}; B={shape.batch}, C={shape.width}, {shape.heads} heads "
        f"(d_k={shape.width // shape.heads}), "
        f"window {WINDOW}; median of {args.repeats} forward+backward passes; MiB: "
        f"{memory_note}.\n\n" + header + "\n".join(lines) + "\n"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(table)
    write_plot(rows, args.out, device)
    print(table)


if __name__ == "__main__":
    main()
