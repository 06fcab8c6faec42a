"""Attention maps and per-head statistics of a fixed validation sample, logged while training
(the recording, statistics and figures are model/inspect.py's)."""

import time
from collections.abc import Callable
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import WandbLogger
from matplotlib.image import imsave

from errors import check_int
from model.inspect import (
    AttentionRecord,
    figure_to_array,
    head_statistics,
    plot_heads,
    record_attention,
)


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
        check_int("callbacks.attention_maps.every_n_steps", every_n_steps)
        check_int("callbacks.attention_maps.sample_length", sample_length, minimum=2)
        check_int("callbacks.attention_maps.max_labelled_tokens", max_labelled_tokens)
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
                import wandb  # loaded by the logger already; W&B-free runs never import it

                pictures = {key: wandb.Image(image) for key, image in images.items()}
                logger.log_metrics({**metrics, **pictures}, step=step)
            else:
                logger.log_metrics(metrics, step=step)
