"""A callback that keeps the values a run logs, whatever its loggers, so the run can write its own
summary (train.py's summary.json) for sweep reports to read without any logging service."""

import statistics

import lightning as L


class RunHistory(L.Callback):
    """Rows of {"step", "train/...": value} every `trainer.log_every_n_steps` steps and of
    {"step", "val/...": value} after every validation (sanity checks excluded)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def _record(self, trainer: L.Trainer, prefix: str) -> None:
        values = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(prefix)}
        if values:
            self.rows.append({"step": trainer.global_step, **values})

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        if trainer.global_step % trainer.log_every_n_steps == 0:
            self._record(trainer, "train/")

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._record(trainer, "val/")

    def curve(self, key: str) -> list[tuple[int, float]]:
        """(step, value) of every row holding `key`."""
        return [(int(row["step"]), row[key]) for row in self.rows if key in row]

    def last(self, key: str) -> float | None:
        values = self.curve(key)
        return values[-1][1] if values else None

    def median(self, key: str, skip: int = 1) -> float | None:
        """Median of `key` past its first `skip` values (the warm-up steps)."""
        values = [v for _, v in self.curve(key)][skip:]
        return statistics.median(values) if values else None
