"""A callback that keeps the values a run logs, whatever its loggers, so the run can write its own
summary (train.py's summary.json) for sweep reports to read without any logging service."""

import os
import statistics
import time

import lightning as L


def seconds_since_process_start() -> float | None:
    """Wall seconds since this process started, interpreter start-up and imports included
    (Linux's /proc; None elsewhere)."""
    try:
        with open("/proc/self/stat") as f:
            # Fields after the parenthesised command name; starttime is field 22 overall.
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, IndexError, ValueError):
        return None
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


# Hydra runs all the jobs of a sweep in one process: only the first run's start-up includes the
# interpreter's and the imports.
_runs_started = 0


class RunHistory(L.Callback):
    """Rows of {"step", "time", "train/...": value} every `trainer.log_every_n_steps` steps and
    of {"step", "time", "val/...": value} after every validation (sanity checks excluded);
    "time" is wall seconds of fitting. Also the seconds from the process's start (for a later
    sweep job in the same process, from this callback's creation, when its trainer is built) to
    the end of the first optimizer step: the start-up cost a user waits through.

    The rows travel in checkpoints, so a resumed run's history is the interrupted run's up to
    the checkpoint, then its own: no gap, no repeated step, and time carries on.
    """

    def __init__(self) -> None:
        global _runs_started
        self.rows: list[dict[str, float]] = []
        self.first_step_seconds: float | None = None
        since_start = seconds_since_process_start() if _runs_started == 0 else None
        self._run_start = time.perf_counter() - (since_start or 0.0)
        _runs_started += 1
        self._fit_start = time.perf_counter()
        self._earlier_seconds = 0.0  # fitting time of the runs this one resumes

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._fit_start = time.perf_counter()

    @property
    def fit_start_seconds(self) -> float | None:
        """Seconds from the process's start (as for first_step_seconds) to the start of fitting,
        so that a row's "time" plus this is its time since launch; None in a resumed run, whose
        rows' times began in another process."""
        if self._earlier_seconds:
            return None
        return self._fit_start - self._run_start

    def elapsed(self) -> float:
        return self._earlier_seconds + time.perf_counter() - self._fit_start

    def state_dict(self) -> dict:
        return {"rows": self.rows, "seconds": self.elapsed()}

    def load_state_dict(self, state: dict) -> None:
        self.rows, self._earlier_seconds = list(state["rows"]), state["seconds"]

    def _record(self, trainer: L.Trainer, prefix: str) -> None:
        values = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(prefix)}
        if values:
            self.rows.append({"step": trainer.global_step, "time": self.elapsed(), **values})

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        if self.first_step_seconds is None:
            self.first_step_seconds = time.perf_counter() - self._run_start
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
