"""Attention maps and per-head statistics of a fixed validation sample, logged while training
(the recording and statistics are model/inspect.py's, the figures model/figures.py's, drawn in
a process of their own by training/map_drawing.py)."""

import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import WandbLogger

from errors import check_int
from model.inspect import AttentionRecord, head_maps, head_statistics, record_attention
from training.map_drawing import DrawnMap, MapDrawer, MapJob


class AttentionMapLogger(L.Callback):
    """Every `every_n_steps` steps and at the end of training, log the attention of a sample.

    Per-head entropy and score std go to every logger as metrics at once. The figures (one per
    attention layer, every head a panel) are drawn in a process of their own
    (training/map_drawing.py) into `out_dir` as PNG files, and go to W&B when drawn, at the step
    they show. That process starts after the first step, which on a 2-core CPU its start would
    slow, early enough for its imports to be done by the first map. The last maps are waited
    for by finish(), which train.py calls after its end-of-run printout, so that they are
    drawn meanwhile; a Trainer used without train.py gets them at teardown.
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
        check_int("callbacks.attention_maps.max_labelled_tokens", max_labelled_tokens, minimum=0)
        self.every_n_steps = every_n_steps
        self.sample_length = sample_length
        self.max_labelled_tokens = max_labelled_tokens
        self.out_dir = Path(out_dir).resolve() if out_dir else None
        self._temporary_dir: Path | None = None  # the PNGs' folder when out_dir is not set
        self._last_logged_step = -1
        self._drawer: MapDrawer | None = None
        self._drawer_started = False  # once: a drawing process that died is not restarted
        self.skipped_figures = 0  # not drawn: the previous maps were still being drawn
        self.finish_later = False  # True: the owner of the run calls finish() itself
        self.last_metrics: dict[str, float] = {}  # the statistics of the latest maps
        self.seconds = 0.0  # spent on the training thread: the maps' cost to the run
        self.drawing_seconds = 0.0  # spent drawing, in the drawing process

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero and self.out_dir is None:
            self._temporary_dir = Path(tempfile.mkdtemp(prefix="attention_maps-"))

    def _start_drawing(self, trainer: L.Trainer) -> None:
        if trainer.is_global_zero and not self._drawer_started:
            self._drawer = MapDrawer()
            self._drawer_started = True

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        if trainer.global_step >= 1:  # the first optimizer step is done (batches may accumulate)
            self._start_drawing(trainer)
        if trainer.global_step % self.every_n_steps == 0:
            self.log_attention(trainer, pl_module, final=trainer.global_step >= trainer.max_steps)
        elif self._drawer is not None and self._drawer.pending:  # most steps: nothing to do
            self._log_drawn(trainer, wait=False)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.log_attention(trainer, pl_module, final=True)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not self.finish_later:
            self.finish(trainer)

    def finish(self, trainer: L.Trainer) -> None:
        """Wait for the maps still being drawn, log them, and end the drawing process."""
        if self._drawer is not None:
            self._log_drawn(trainer, wait=True)
        self._close(wait=True)

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._close(wait=False)  # a stopping run does not wait for pictures

    def _close(self, wait: bool) -> None:
        if self._drawer is not None:
            self._drawer.close(wait=wait)
            self._drawer = None
        if self._temporary_dir is not None:  # W&B has copied what it logged
            shutil.rmtree(self._temporary_dir, ignore_errors=True)
            self._temporary_dir = None

    def log_attention(
        self, trainer: L.Trainer, pl_module: L.LightningModule, final: bool = False
    ) -> None:
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
        self._log_statistics(trainer, records, step)
        self._start_drawing(trainer)  # if no step has started it (a run resumed at its end)
        if self._drawer is not None:
            self._submit(records, labels_for, step, final)
        self.seconds += time.perf_counter() - started

    def _log_statistics(
        self, trainer: L.Trainer, records: list[AttentionRecord], step: int
    ) -> None:
        metrics: dict[str, float] = {}
        entropies = []
        for record in records:
            stats = head_statistics(record)
            entropies.append(stats["entropy"])
            for stat, values in stats.items():
                for head, value in enumerate(values.tolist()):  # one host transfer per statistic
                    metrics[f"attention/{record.name}/head{head}/{stat}"] = value
        metrics["attention/entropy_mean"] = torch.cat(entropies).mean().item()
        self.last_metrics = metrics
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    def _submit(
        self,
        records: list[AttentionRecord],
        labels_for: Callable[[str], tuple[list[str], list[str]]],
        step: int,
        final: bool,
    ) -> None:
        """Send the figures to the drawing process; while earlier ones are still being drawn
        (a short cadence, a fast device), skip them rather than build a backlog. The final
        maps are always drawn."""
        if self._drawer.pending and not final:
            self.skipped_figures += len(records)
            return
        folder = self.out_dir or self._temporary_dir
        for record in records:
            query_labels, key_labels = labels_for(record.name)
            if max(len(query_labels), len(key_labels)) > self.max_labelled_tokens:
                query_labels = key_labels = None
            self._drawer.submit(
                MapJob(
                    step=step,
                    key=f"attention/{record.name}",
                    path=str(folder / f"{record.name.replace('/', '_')}_step{step:06d}.png"),
                    title=f"{record.name} — step {step}",
                    maps=[head_maps(record)],
                    query_labels=query_labels,
                    key_labels=key_labels,
                )
            )

    def _log_drawn(self, trainer: L.Trainer, wait: bool) -> None:
        started = time.perf_counter()
        drawn = self._drawer.drawn(wait=wait)
        for figure in drawn:
            self.drawing_seconds += figure.seconds
            if figure.path is None:
                print(f"warning: attention map {figure.key} not drawn: {figure.error}")
        if self._drawer.failure is not None:  # the statistics go on; the pictures stop
            print(f"warning: no more attention maps are drawn: {self._drawer.failure}")
            self._close(wait=False)
        wandb_loggers = [lg for lg in trainer.loggers if isinstance(lg, WandbLogger)]
        if wandb_loggers and any(figure.path for figure in drawn):
            self._log_images(wandb_loggers, drawn)
        if not wait:
            self.seconds += time.perf_counter() - started

    @staticmethod
    def _log_images(loggers: list[WandbLogger], drawn: list[DrawnMap]) -> None:
        import wandb  # loaded by the logger already; W&B-free runs never import it

        for step in sorted({figure.step for figure in drawn}):
            images = {
                figure.key: wandb.Image(figure.path)
                for figure in drawn
                if figure.step == step and figure.path
            }
            for logger in loggers:
                logger.log_metrics(images, step=step)


def finish_maps_later(callbacks: list[L.Callback]) -> None:
    """The attention-map loggers among `callbacks` leave their last maps to finish_maps()."""
    for callback in callbacks:
        if isinstance(callback, AttentionMapLogger):
            callback.finish_later = True


def finish_maps(trainer: L.Trainer) -> None:
    """Wait for, and log, the last maps of every attention-map logger of `trainer`."""
    for callback in trainer.callbacks:
        if isinstance(callback, AttentionMapLogger):
            callback.finish(trainer)
