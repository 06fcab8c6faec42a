"""Training throughput of a config on this device, steady state, two ways in one run:

(a) the real `python train.py ...` (Lightning, loggers, callbacks), reading the tokens/s it logs;
(b) a minimal hand-written PyTorch loop over the same model, data, optimizer, gradient clipping
    and precision;

and the ratio a/b (the framework's overhead), plus model-FLOPs utilisation against this
device's measured matmul peak. Arguments are train.py overrides, and `--repeats=N` (default 3):
the two paths run N times each, in alternating order (ab, ba, ab, ...) so that a shared
machine's drift falls on both alike, and the median of the N paired ratios is reported.

    python bench/train_throughput.py model.block_size=64 data.batch_size=12 trainer.max_steps=300

(nanoGPT's CPU recipe: 4 layers, 4 heads, 128 wide, block 64, batch 12.)
"""

import os
import statistics
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runs import matmul_peak, median_after, train  # noqa: E402

import train as train_script  # noqa: E402, F401 (registers the resolvers the configs use)
from data.lm import LMDataModule  # noqa: E402
from model.gpt import GPT  # noqa: E402
from training.module import OptimConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WARMUP_STEPS = 20


def flops_per_token(model: GPT) -> float:
    """Training FLOPs per token: 6 per weight (forward + backward) plus attention's
    QKᵀ and AV, 12 · layers · block · width (as in the PaLM paper's appendix)."""
    c = model.config
    # Position embeddings are a lookup; the token embedding counts, as the tied output head.
    weights = model.num_parameters(exclude_embeddings=True)
    return 6 * weights + 12 * c.n_layer * c.block_size * c.n_embd


def hand_loop(overrides: list[str], steps: int) -> tuple[float, GPT, torch.dtype | None]:
    """Median tokens/s of a plain loop: next batch, forward, backward, clip, AdamW, schedule."""
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    cache_dir = os.environ.get("TINYFORMER_CACHE", str(ROOT / ".cache" / "tinyformer"))
    data: LMDataModule = instantiate(cfg.data, cache_dir=cache_dir)
    data.prepare_data()
    data.setup()
    model_config = instantiate(cfg.model)
    model_config.vocab_size = model_config.vocab_size or data.vocab_size  # padded or not
    torch.manual_seed(cfg.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = GPT(model_config).to(device)
    if cfg.compile:
        model.compile(mode=cfg.compile_mode)
    optim = OptimConfig(**cfg.optim)
    optimizer = torch.optim.AdamW(
        model.optimizer_groups(optim.weight_decay),
        lr=optim.lr,
        betas=(optim.beta1, optim.beta2),
        fused=True,  # as train.py's
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: optim.lr_factor(s, steps))
    precision = str(cfg.trainer.precision)
    autocast_dtype = torch.bfloat16 if precision.startswith("bf16") else None
    batches = iter(data.train_dataloader())
    # The same statistic train.py logs: tokens over windows of log_every_n_steps steps, from
    # one step's end to another's, and the median window.
    window = cfg.trainer.log_every_n_steps
    rates, window_start = [], None
    for step in range(steps):
        x, y = (t.to(device, non_blocking=True) for t in next(batches))
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.gradient_clip_val)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        if step < WARMUP_STEPS or (step - WARMUP_STEPS) % window:
            continue
        loss.item()  # waits for the device, at window ends only, as train.py's logging does
        now = time.perf_counter()
        if window_start is not None:
            rates.append(window * x.numel() / (now - window_start))
        window_start = now
    return statistics.median(rates), model, autocast_dtype


def lightning_rate(overrides: list[str]) -> float:
    """Median windowed tokens/s that `python train.py overrides...` logged, warm-up excluded."""
    _, rows = train(*overrides)
    return median_after(rows, "train/tokens_per_sec", WARMUP_STEPS // 10)


def main(arguments: list[str]) -> None:
    repeats = [int(a.split("=")[1]) for a in arguments if a.startswith("--repeats=")]
    repeats = repeats[-1] if repeats else 3
    overrides = [a for a in arguments if not a.startswith("--repeats=")]
    given = [int(o.split("=")[1]) for o in overrides if o.startswith("trainer.max_steps=")]
    steps = given[-1] if given else 300
    overrides = [*overrides, f"trainer.max_steps={steps}"]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"device: {device}; torch {torch.__version__}; {torch.get_num_threads()} threads")
    print(f"overrides: {' '.join(overrides)}; {repeats} repeats\n")

    pairs = []
    for repeat in range(repeats):
        if repeat % 2 == 0:
            lightning = lightning_rate(overrides)
            hand, model, dtype = hand_loop(overrides, steps)
        else:
            hand, model, dtype = hand_loop(overrides, steps)
            lightning = lightning_rate(overrides)
        pairs.append((lightning, hand))
        ratio = lightning / hand
        print(f"repeat {repeat + 1}: (a) {lightning:,.0f}  (b) {hand:,.0f}  (a)/(b) {ratio:.3f}")

    lightning = statistics.median(a for a, _ in pairs)
    hand = statistics.median(b for _, b in pairs)
    per_token = flops_per_token(model)
    peak = matmul_peak(device.type, "bfloat16" if dtype else "float32")
    print("\n| path | tokens/s (median) | model TFLOP/s | MFU (vs measured matmul peak) |")
    print("|---|---|---|---|")
    for name, rate in (("(a) train.py (Lightning)", lightning), ("(b) hand loop", hand)):
        achieved = rate * per_token
        print(f"| {name} | {rate:,.0f} | {achieved / 1e12:.3f} | {achieved / peak:.1%} |")
    precision = "bf16" if dtype else "fp32"
    ratios = sorted(a / b for a, b in pairs)
    print(
        f"\n(a)/(b) = {statistics.median(ratios):.3f} (median of {repeats} paired runs; "
        f"range {ratios[0]:.3f}-{ratios[-1]:.3f}); {model.num_parameters() / 1e6:.2f}M "
        f"parameters, {per_token / 1e6:.2f} MFLOP/token; {precision} matmul peak "
        f"{peak / 1e12:.3f} TFLOP/s"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
