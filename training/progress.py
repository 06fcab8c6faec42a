"""How a run shows its progress on stdout: Lightning's bar on a terminal; in a log file or a
pipe, where a bar redrawn in place piles up as one unreadable line, a plain line every so often
and at every validation (as nanoGPT prints), which `tail -f` and `grep` read."""

import sys
import time

import lightning as L
from lightning.pytorch.callbacks import ProgressBar, TQDMProgressBar

from errors import check, check_int, is_number

# The metrics a line shows, in this order, where the run logged them, under these names
SHOWN = {"train/loss": "train/loss", "val/loss": "val/loss", "train/tokens_per_sec": "tokens/s"}


def progress_bar(refresh_rate: int, every_seconds: float) -> ProgressBar:
    """The bar, redrawn every `refresh_rate` steps, where stdout is a terminal; else a line every
    `every_seconds` (configs/callbacks/default.yaml's progress_bar)."""
    # both checked wherever stdout goes: the next run's may go elsewhere
    key = "callbacks.progress_bar.every_seconds"
    ok = is_number(every_seconds) and every_seconds > 0
    check(ok, key, "a positive number of seconds", every_seconds)
    check_int("callbacks.progress_bar.refresh_rate", refresh_rate, minimum=0)  # 0: no bar
    if sys.stdout.isatty():
        return TQDMProgressBar(refresh_rate=refresh_rate)
    return LineProgress(every_seconds)


def clock(seconds: float) -> str:
    """`seconds` as h:mm:ss, or m:ss under an hour."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class LineProgress(ProgressBar):
    """One line on stdout every `every_seconds` of training and after every validation (with
    its val/loss), on rank zero:

        step 250/2000 (12%)  train/loss 2.0312  tokens/s 21,450  0:41 in, ~4:52 left
    """

    def __init__(self, every_seconds: float = 30.0) -> None:
        super().__init__()
        self.every_seconds = every_seconds
        self.enabled = True
        self._started = self._last_line = 0.0
        self._first_step = 0

    @property
    def is_enabled(self) -> bool:
        return self.enabled

    def disable(self) -> None:
        self.enabled = False

    def enable(self) -> None:
        self.enabled = True

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._started = self._last_line = time.monotonic()
        self._first_step = trainer.global_step  # a resumed run counts its time from here

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *_) -> None:
        if time.monotonic() - self._last_line >= self.every_seconds:
            self.line(trainer, validated=False)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.line(trainer, validated=True)

    def line(self, trainer: L.Trainer, validated: bool) -> None:
        """Print where the run stands, and when it should end at this pace; val/loss only just
        after a validation, so that no line shows an old one as the step's."""
        if not self.enabled:
            return
        now = time.monotonic()
        self._last_line = now
        step, total = trainer.global_step, trainer.max_steps
        parts = [f"step {step}/{total} ({step / total:.0%})" if total > 0 else f"step {step}"]
        metrics = trainer.callback_metrics
        for name, label in SHOWN.items():
            if name in metrics and (validated or not name.startswith("val/")):
                value = float(metrics[name])
                parts.append(
                    f"{label} {value:,.0f}" if label == "tokens/s" else f"{label} {value:.4f}"
                )
        elapsed, done = now - self._started, step - self._first_step
        timing = f"{clock(elapsed)} in"
        if total > 0 and done > 0 and step < total:
            timing += f", ~{clock(elapsed / done * (total - step))} left"
        parts.append(timing)
        print("  ".join(parts), flush=True)
