"""The LightningModule: loss, optimizer groups, warm-up + cosine schedule, metric logging."""

import math
import time
from dataclasses import dataclass

import lightning as L
import torch
from torchmetrics import MeanMetric

from model.gpt import GPT, GPTConfig


@dataclass
class OptimConfig:
    """AdamW and its schedule, `optim.*` on the command line."""

    lr: float = 1e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"optim.lr must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"optim.{name} must be in [0, 1), got {getattr(self, name)}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be an integer >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")

    def lr_factor(self, step: int, total_steps: int) -> float:
        """Linear warm-up to 1, then cosine decay to min_lr_ratio at total_steps."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / max(1, total_steps - self.warmup_steps))
        cosine = 0.5 * (1 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * cosine


class LanguageModelModule(L.LightningModule):
    """Trains a GPT on next-token prediction.

    Constructor arguments are plain dicts so that the checkpoint's hyper_parameters hold the
    model config, the optimizer config, the tokenizer and the resolved run config, and a
    checkpoint loads with torch.load(weights_only=True) and nothing else.
    """

    def __init__(self, model: dict, optim: dict, tokenizer: dict, run_config: dict | None = None):
        super().__init__()
        self.save_hyperparameters(logger=False)
        self.model = GPT(GPTConfig.from_dict(model))
        self.optim = OptimConfig(**optim)
        self.val_loss = MeanMetric()
        self._last_batch_end: float | None = None

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        return self.model(idx, targets)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        x, y = batch
        _, loss = self.model(x, y)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/lr", self.lr_schedulers().get_last_lr()[0])
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        # Wall time between consecutive steps: data loading, forward, backward, optimizer.
        now = time.perf_counter()
        if self._last_batch_end is not None:
            tokens = batch[0].numel() * self.trainer.world_size
            self.log("train/tokens_per_sec", tokens / (now - self._last_batch_end))
        self._last_batch_end = now

    def on_validation_start(self) -> None:
        self._last_batch_end = None  # validation time is not training throughput

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        _, loss = self.model(x, y)
        self.val_loss.update(loss, weight=y.numel())

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()
        self.val_loss.reset()
        self.log("val/loss", loss, prog_bar=True)
        self.log("val/perplexity", torch.exp(loss))

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(
            self.model.optimizer_groups(self.optim.weight_decay),
            lr=self.optim.lr,
            betas=(self.optim.beta1, self.optim.beta2),
        )
        total_steps = int(self.trainer.estimated_stepping_batches)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: self.optim.lr_factor(step, total_steps)
        )
        schedule = {"scheduler": scheduler, "interval": "step"}
        return {"optimizer": optimizer, "lr_scheduler": schedule}
