"""Time and peak memory of one causal self-attention layer, forward + backward, against the
sequence length T: full causal attention against a sliding window, and the O(T²) of the math path.

Paths, all on the same input x (B, T, C) and the same projection weights:
- `fused`:  MultiHeadAttention as used in training, full causal (PyTorch's fused kernel);
- `window`: MultiHeadAttention with a sliding window of --window keys (local_attention, the
            banded path, from 4 windows on; the dense mask through the fused kernel below);
- `window_dense`: the same window through the dense (T, T) mask at every T, as the module did
            before local_attention;
- `math`:   MultiHeadAttention with need_weights=True (explicit softmax(QKᵀ/√d)V; the T×T
            weights are materialised and returned);
- `sdpa`:   the bare baseline, the same qkv/out projections around
            torch.nn.functional.scaled_dot_product_attention(is_causal=True).

    python bench/attention_scaling.py [--paths fused window] [--lengths 256 512 ...]
        [--pairs 3 --repeats 5] [--threads N] [--device cuda] [--batch 1 --width 256 --heads 4]
        [--out docs/attention_scaling_cpu]

(B=1, C=256 suits a CPU; on a GPU, such a layer is bound by kernel launches, and a layer of
GPT-2 small's size, --batch 8 --width 768 --heads 12, measures the kernels.)

Each path is measured --pairs times per T, the paths in turn and the order reversed every other
time, so that the machine's drift falls on all of them alike; each measurement is the median of
--repeats passes after a warm-up. The table gives the median of all passes with their range, and
the ratios to `fused` as the median (and range) of the paired measurements. On CPU each
measurement runs in its own process so that its peak resident memory is its own (minus an idle
torch process's); on CUDA the allocator's peak above the inputs is used. Writes <out>.md (the
table) and <out>.png (time and memory against T, log-log).
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from runs import spread

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import model.attention as attention  # noqa: E402
from model.attention import AttentionConfig, MultiHeadAttention  # noqa: E402

LENGTHS = [256, 512, 1024, 2048, 4096, 8192]
PATHS = ["math", "fused", "window", "window_dense", "sdpa"]
RATIOS = [("window", "fused"), ("window_dense", "fused"), ("fused", "sdpa")]


@dataclass
class Shape:
    batch: int = 1
    width: int = 256
    heads: int = 4
    window: int = 128
    threads: int | None = None  # torch's intra-op threads; None: torch's default

    def arguments(self) -> list[str]:
        threads = [] if self.threads is None else ["--threads", str(self.threads)]
        return [
            *("--batch", str(self.batch), "--width", str(self.width)),
            *("--heads", str(self.heads), "--window", str(self.window), *threads),
        ]


@contextmanager
def without_local_path():
    """The module's windowed attention through the dense mask, whatever T."""
    saved, attention.LOCAL_MIN_WINDOWS = attention.LOCAL_MIN_WINDOWS, sys.maxsize
    try:
        yield
    finally:
        attention.LOCAL_MIN_WINDOWS = saved


def attention_step(path: str, device: torch.device, shape: Shape):
    """A function running forward + backward of `path` on an input."""
    window = shape.window if path.startswith("window") else None
    config = AttentionConfig(n_head=shape.heads, window=window)
    mha = MultiHeadAttention(shape.width, config, causal=True).to(device)
    batch, width, heads = shape.batch, shape.width, shape.heads

    def bare_sdpa(x: torch.Tensor) -> torch.Tensor:
        # The module's own projections, so only the attention in between differs.
        q, k, v = mha.qkv_proj(x).chunk(3, dim=-1)
        split = [t.view(batch, -1, heads, width // heads).transpose(1, 2) for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*split, is_causal=True)
        return mha.out_proj(out.transpose(1, 2).reshape(batch, -1, width))

    def step(x: torch.Tensor) -> None:
        if path == "sdpa":
            out = bare_sdpa(x)
        elif path == "window_dense":
            with without_local_path():
                out = mha(x)[0]
        else:
            out = mha(x, need_weights=path == "math")[0]
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
    times = []
    for _ in range(repeats):
        x.grad = None
        start = time.perf_counter()
        step(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - start))
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:  # the high-water mark includes the warm-up's, which did the same work
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"path": path, "T": length, "ms": times, "peak_mb": peak / 2**20}


def measure_in_child(path: str, length: int, repeats: int, shape: Shape) -> dict:
    """CPU: a fresh process per measurement, so that its resident-memory peak is its own."""
    command = [sys.executable, __file__, "--one", path, str(length), "--repeats", str(repeats)]
    command += shape.arguments()
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.splitlines()[-1])


def idle_rss_mb() -> float:
    command = [sys.executable, __file__, "--idle"]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return float(result.stdout.splitlines()[-1])


def table(runs: dict, paths: list[str], lengths: list[int]) -> str:
    """runs[(path, T)]: the measurements of that path at T, in pair order."""
    ratios = [(a, b) for a, b in RATIOS if a in paths and b in paths]
    header = ["T"] + [f"{p} {unit}" for p in paths for unit in ("ms", "MiB")]
    header += [f"{a} / {b} {what}" for a, b in ratios for what in ("time", "memory")]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for length in lengths:
        cells = [str(length)]
        for path in paths:
            measured = runs[path, length]
            cells.append(spread([t for m in measured for t in m["ms"]], 1))
            cells.append(spread([m["peak_mb"] for m in measured], 0))
        for a, b in ratios:
            pairs = list(zip(runs[a, length], runs[b, length], strict=True))
            times = [statistics.median(x["ms"]) / statistics.median(y["ms"]) for x, y in pairs]
            memory = [x["peak_mb"] / y["peak_mb"] for x, y in pairs]
            cells += [spread(times, 2), spread(memory, 2)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_plot(runs: dict, paths: list[str], lengths: list[int], out: Path, device) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (time_ax, memory_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for path in paths:
        times = [[t for m in runs[path, n] for t in m["ms"]] for n in lengths]
        middle = [statistics.median(t) for t in times]
        below = [m - min(t) for m, t in zip(middle, times, strict=True)]
        above = [max(t) - m for m, t in zip(middle, times, strict=True)]
        time_ax.errorbar(lengths, middle, yerr=[below, above], fmt="o-", capsize=3, label=path)
        memory = [statistics.median(m["peak_mb"] for m in runs[path, n]) for n in lengths]
        memory_ax.plot(lengths, [max(m, 0.1) for m in memory], "o-", label=path)
    for power, path in ((2, "fused"), (1, "window")):  # through each one's longest T
        if path in paths:
            anchor = statistics.median(t for m in runs[path, lengths[-1]] for t in m["ms"])
            guide = [anchor * (n / lengths[-1]) ** power for n in lengths]
            label = f"∝ T{'²' if power == 2 else ''}"
            time_ax.plot(lengths, guide, "k:" if power == 2 else "k--", lw=1, label=label)
    time_ax.set(xlabel="T (tokens)", ylabel="forward + backward, ms", title=f"time ({device})")
    memory_ax.set(xlabel="T (tokens)", ylabel="peak memory, MiB", title="extra peak memory")
    for ax in (time_ax, memory_ax):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out.with_suffix(".png"), dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=["fused", "window"])
    parser.add_argument("--lengths", nargs="+", type=int, default=LENGTHS)
    parser.add_argument("--pairs", type=int, default=3, help="measurements of each path per T")
    parser.add_argument("--repeats", type=int, default=5, help="passes per measurement")
    parser.add_argument("--out", type=Path, default=Path("attention_scaling"))
    parser.add_argument("--one", nargs=2, metavar=("PATH", "T"), help=argparse.SUPPRESS)
    parser.add_argument("--idle", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=Shape.batch)
    parser.add_argument("--width", type=int, default=Shape.width)
    parser.add_argument("--heads", type=int, default=Shape.heads)
    parser.add_argument("--window", type=int, default=Shape.window)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    device = torch.device(args.device)
    shape = Shape(args.batch, args.width, args.heads, args.window, args.threads)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.idle:
        torch.ones(1)
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        return
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]), device, args.repeats, shape)))
        return

    idle = idle_rss_mb() if device.type == "cpu" else 0.0
    runs = {(path, length): [] for path in args.paths for length in args.lengths}
    for length in args.lengths:
        for pair in range(args.pairs):
            for path in args.paths if pair % 2 == 0 else args.paths[::-1]:
                if device.type == "cpu":
                    run = measure_in_child(path, length, args.repeats, shape)
                    run["peak_mb"] -= idle
                else:
                    run = measure(path, length, device, args.repeats, shape)
                runs[path, length].append(run)
                print(
                    f"T={length:5d} {path:7s} {statistics.median(run['ms']):9.2f} ms "
                    f"{run['peak_mb']:9.1f} MiB",
                    file=sys.stderr,
                )
    memory_note = (
        "peak resident memory above an idle torch process"
        if device.type == "cpu"
        else "peak CUDA memory allocated above the inputs and weights"
    )
    text = (
        f"Device: {device}; B={shape.batch}, C={shape.width}, {shape.heads} heads "
        f"(d_k={shape.width // shape.heads}), window {shape.window}, "
        f"torch threads: {torch.get_num_threads()}; forward+backward, "
        f"{args.pairs} measurements per path of {args.repeats} passes each, taken in turn: "
        f"ms is the median of all passes (min-max), MiB the {memory_note} (median, min-max "
        "of the measurements), and each ratio the median (min-max) of the paired "
        "measurements' ratios.\n\n" + table(runs, args.paths, args.lengths)
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text)
    write_plot(runs, args.paths, args.lengths, args.out, device)
    print(text)


if __name__ == "__main__":
    main()
