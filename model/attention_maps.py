"""Attention maps and per-head statistics of a fixed validation sample, logged while training.

Every MultiHeadAttention in the model is observed through a forward hook, so the models need
no extra plumbing: one ordinary forward pass of the sample yields every layer's scores. Per
head we log the mean entropy of the attention rows (low: focused, high: spread out) and the
standard deviation of the pre-softmax scores, the saturation diagnostic: with scores spread
much wider than ~1, softmax is close to one-hot and its gradients vanish.
"""

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import numpy as np
import torch
import wandb
from lightning.pytorch.loggers import WandbLogger
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.image import imsave
from torch import Tensor, nn

from model.attention import MultiHeadAttention, masked_softmax


@dataclass
class AttentionRecord:
    """One attention call of the first sample: weights and scores (H, Tq, Tk)."""

    name: str
    weights: Tensor
    scores: Tensor


def readable_name(module_path: str) -> str:
    """'blocks.0.attn' -> 'layer0/attn'; 'decoder.1.cross_attn' -> 'decoder/layer1/cross_attn'."""
    return re.sub(r"(blocks\.)?(\d+)\.", r"layer\2.", module_path).replace(".", "/")


@torch.no_grad()
def record_attention(model: nn.Module, run: Callable[[], object]) -> list[AttentionRecord]:
    """Call run() (a forward pass of model) and return every attention map it computed."""
    records: list[AttentionRecord] = []
    names = {
        m: readable_name(n) for n, m in model.named_modules() if isinstance(m, MultiHeadAttention)
    }

    def hook(module: MultiHeadAttention, args: tuple, kwargs: dict, output: object) -> None:
        mask_kwargs = {
            k: kwargs[k]
            for k in ("context", "key_padding_mask", "attn_mask", "query_offset")
            if k in kwargs
        }
        scores = module.scores(*args, **mask_kwargs)[0].float()
        records.append(AttentionRecord(names[module], masked_softmax(scores), scores))

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in names]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return records


def head_statistics(record: AttentionRecord) -> dict[str, Tensor]:
    """Per-head entropy (nats, mean over query rows) and std of the allowed scores; shape (H,)."""
    row_entropy = -torch.special.xlogy(record.weights, record.weights).sum(dim=-1)  # (H, Tq)
    has_keys = record.weights.sum(dim=-1) > 0
    entropy = (row_entropy * has_keys).sum(-1) / has_keys.sum(-1).clamp(min=1)
    allowed = torch.isfinite(record.scores)
    count = allowed.sum(dim=(-2, -1)).clamp(min=1)
    finite = record.scores.masked_fill(~allowed, 0.0)
    mean = finite.sum(dim=(-2, -1)) / count
    variance = ((finite - mean[:, None, None]) ** 2 * allowed).sum(dim=(-2, -1)) / count
    return {"entropy": entropy, "score_std": variance.sqrt()}


def token_label(text: str) -> str:
    return {"\n": "\\n", " ": "␣", "\t": "\\t"}.get(text, text)


def plot_heads(
    records: list[AttentionRecord],
    query_labels: list[str] | None,
    key_labels: list[str] | None,
    title: str,
) -> Figure:
    """One heatmap per head, a row per record; queries on the y axis, keys on the x axis."""
    rows, cols = len(records), max(r.weights.size(0) for r in records)
    height = 2.8 * rows + 0.4
    figure = Figure(figsize=(2.8 * cols, height))
    FigureCanvasAgg(figure)
    # Fixed margins: constrained layout doubles the drawing time, which a training run pays
    # at every map.
    margin = 0.35 if key_labels is not None else 0.15  # inches under the key labels
    figure.subplots_adjust(
        left=0.25 / (2.8 * cols) + 0.02,
        right=0.99,
        bottom=margin / height + 0.02,
        top=1 - 0.55 / height,
        wspace=0.15,
        hspace=0.35,
    )
    for row, record in enumerate(records):
        entropy = head_statistics(record)["entropy"]
        for head in range(record.weights.size(0)):
            axes = figure.add_subplot(rows, cols, row * cols + head + 1)
            weights = record.weights[head].cpu().numpy()
            axes.imshow(weights, cmap="viridis", vmin=0.0, aspect="auto")
            name = f"{record.name} " if rows > 1 else ""
            axes.set_title(f"{name}head {head}  H={entropy[head]:.2f}", fontsize=8)
            for labels, set_ticks, set_labels in (
                (key_labels, axes.set_xticks, axes.set_xticklabels),
                (query_labels, axes.set_yticks, axes.set_yticklabels),
            ):
                if labels is None:
                    set_ticks([])
                    continue
                set_ticks(range(len(labels)))
                set_labels([token_label(t) for t in labels], fontsize=5, fontfamily="monospace")
    figure.suptitle(title, fontsize=10)
    return figure


def figure_to_array(figure: Figure) -> np.ndarray:
    figure.canvas.draw()
    return np.asarray(figure.canvas.buffer_rgba())[..., :3].copy()


class AttentionMapLogger(L.Callback):
    """Every `every_n_steps` steps and at the end of training, log the attention of a sample.

    Images go to W&B (one per attention layer, every head a panel) and always to
    `out_dir` as PNG files; per-head entropy and score std go to every logger as metrics.
    """

    def __init__(
        self,
        every_n_steps: int = 500,
        sample_length: int = 48,
        max_labelled_tokens: int = 64,
        out_dir: str | None = None,
    ):
        if every_n_steps < 1 or sample_length < 2:
            raise ValueError(
                f"callbacks.attention_maps: every_n_steps ({every_n_steps}) must be >= 1 and "
                f"sample_length ({sample_length}) >= 2"
            )
        self.every_n_steps = every_n_steps
        self.sample_length = sample_length
        self.max_labelled_tokens = max_labelled_tokens
        self.out_dir = Path(out_dir) if out_dir else None
        self._last_logged_step = -1
        self.last_metrics: dict[str, float] = {}  # the statistics of the latest maps
        self.seconds = 0.0  # spent drawing and logging maps: their cost to the run

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        if trainer.global_step % self.every_n_steps == 0:
            self.log_attention(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.log_attention(trainer, pl_module)

    def log_attention(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        step = trainer.global_step
        if step == self._last_logged_step or not trainer.is_global_zero:
            return
        self._last_logged_step = step
        started = time.perf_counter()
        run, labels_for = pl_module.attention_sample(trainer.datamodule, self.sample_length)
        was_training = pl_module.training
        pl_module.eval()
        try:
            records = record_attention(pl_module.model, run)
        finally:
            pl_module.train(was_training)
        self._publish(trainer, records, labels_for, step)
        self.seconds += time.perf_counter() - started

    def _publish(
        self,
        trainer: L.Trainer,
        records: list[AttentionRecord],
        labels_for: Callable[[str], tuple[list[str], list[str]]],
        step: int,
    ) -> None:
        metrics: dict[str, float] = {}
        entropies = []
        for record in records:
            stats = head_statistics(record)
            entropies.append(stats["entropy"])
            for head in range(record.weights.size(0)):
                for stat, values in stats.items():
                    metrics[f"attention/{record.name}/head{head}/{stat}"] = values[head].item()
        metrics["attention/entropy_mean"] = torch.cat(entropies).mean().item()
        self.last_metrics = metrics
        images = {}
        for record in records:
            query_labels, key_labels = labels_for(record.name)
            if max(len(query_labels), len(key_labels)) > self.max_labelled_tokens:
                query_labels = key_labels = None
            title = f"{record.name} — step {step}"
            figure = plot_heads([record], query_labels, key_labels, title)
            image = figure_to_array(figure)  # drawn once, for both the file and W&B
            if self.out_dir is not None:
                path = self.out_dir / f"{record.name.replace('/', '_')}_step{step:06d}.png"
                path.parent.mkdir(parents=True, exist_ok=True)
                imsave(path, image)
            images[f"attention/{record.name}"] = image
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                # One W&B row per logging step: maps and statistics share the same _step.
                pictures = {key: wandb.Image(image) for key, image in images.items()}
                logger.log_metrics({**metrics, **pictures}, step=step)
            else:
                logger.log_metrics(metrics, step=step)
