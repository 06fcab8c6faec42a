"""Faults that tests inject into real train.py runs through the command line, e.g.

    python train.py +callbacks.fault._target_=faults.SignalAt +callbacks.fault.step=20 \
        +callbacks.fault.signum=9

(train.py runs with tests/ on PYTHONPATH). Each fires only in a run started afresh, so the
resumed run that a test starts next, which carries the same overrides, trains on untouched.
"""

import os
import signal
import threading
import time

import lightning as L
import torch

import model.sampling
from data.lm_text import TokenWriter


def signal_once_saved(trainer: L.Trainer, signum: int, group: bool = False) -> None:
    """Send this process `signum` once the checkpoints written so far are on disk (they are
    written beside training), or with `group` its whole process group, as a scheduler signals
    every process of a job (tests run each command in a group of its own)."""
    trainer.strategy.checkpoint_io.wait()
    if group:
        os.killpg(0, signum)
    else:
        os.kill(os.getpid(), signum)


class SignalAt(L.Callback):
    """Send this process the signal `signum` before step `step + 1`, once `step` steps are
    done and any checkpoint of step `step` is on disk (they are written beside training). In a
    distributed run every process signals itself, or, given `rank`, the process of that rank
    only (0: the one the command started). With `group`, the signal goes to the process group
    (the run's DataLoader workers too)."""

    def __init__(
        self, step: int, signum: int, rank: int | None = None, group: bool = False
    ) -> None:
        self.step, self.signum, self.rank, self.group = step, signum, rank, group

    def on_train_batch_start(self, trainer: L.Trainer, *args) -> None:
        if self.rank not in (None, trainer.global_rank):
            return
        if trainer.ckpt_path is None and trainer.global_step == self.step:
            signal_once_saved(trainer, self.signum, self.group)


class SignalAtBatch(L.Callback):
    """Send this process the signal `signum` before training batch `batch + 1` (counted over
    all epochs), once `batch` batches are trained and any checkpoint written after them is on
    disk: where batches accumulate, a stop inside a step."""

    def __init__(self, batch: int, signum: int) -> None:
        self.batch, self.signum = batch, signum

    def on_train_batch_start(self, trainer: L.Trainer, *args) -> None:
        # the batch starting is counted already: the ones before it are its index
        if trainer.ckpt_path is None and trainer.fit_loop.total_batch_idx == self.batch:
            signal_once_saved(trainer, self.signum)


class SignalDuringValidation(L.Callback):
    """Send this process the signal `signum` in the validation after step `step`, once its
    first batch is done, and with `again`, once more after its second batch (a user pressing
    Ctrl-C twice), each time once the checkpoints written so far are on disk. In a distributed
    run every process signals itself, or, given `rank`, the process of that rank only."""

    def __init__(
        self, step: int, signum: int, again: bool = False, rank: int | None = None
    ) -> None:
        self.step, self.signum, self.rank = step, signum, rank
        self.batches = (0, 1) if again else (0,)

    def on_validation_batch_end(
        self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int, *args
    ) -> None:
        fresh = trainer.ckpt_path is None and not trainer.sanity_checking
        ours = self.rank in (None, trainer.global_rank)
        if fresh and ours and trainer.global_step == self.step and batch_idx in self.batches:
            signal_once_saved(trainer, self.signum)


class CtrlCWhileSavingTheStop(SignalAt):
    """SignalAt's signal before step `step + 1`, then, as the run stopping on it saves its
    checkpoint (as the checkpoint is gathered, before its file is written), Ctrl-C: a user
    impatient with the stop."""

    def __init__(self, step: int, signum: int) -> None:
        super().__init__(step, signum)
        self.stopping = False

    def on_exception(self, trainer: L.Trainer, pl_module, exception: BaseException) -> None:
        self.stopping = True  # before StopSignals' hook, which saves

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module, checkpoint: dict) -> None:
        if self.stopping:
            os.kill(os.getpid(), signal.SIGINT)


class SignalInSanityCheck(L.Callback):
    """Send this process the signal `signum` in Lightning's sanity check, before any step, once
    its first validation batch is done; in a distributed run every process signals itself, or,
    given `rank`, the process of that rank only."""

    def __init__(self, signum: int, rank: int | None = None) -> None:
        self.signum, self.rank = signum, rank

    def on_validation_batch_end(self, trainer: L.Trainer, *args) -> None:
        if trainer.sanity_checking and self.rank in (None, trainer.global_rank):
            os.kill(os.getpid(), self.signum)


class SignalWhileWritingTokens(L.Callback):
    """Send this process the signal `signum` as it writes the data cache's token files, once it
    has written `documents` documents: the data is being prepared, the entry half-written. Set
    up as the Trainer is built, before the data is prepared; a run that finds the entry built
    writes no tokens."""

    def __init__(self, signum: int, documents: int = 10) -> None:
        append = TokenWriter.append
        written = 0

        def append_then_signal(writer: TokenWriter, ids: list[int]) -> None:
            nonlocal written
            append(writer, ids)
            written += 1
            if written == documents:
                os.kill(os.getpid(), signum)

        TokenWriter.append = append_then_signal


class SignalDuringTheSample(L.Callback):
    """Send this process the signal `signum` in the end-of-run sample, once it has printed
    `tokens` tokens: training is over, and saved."""

    def __init__(self, signum: int, tokens: int = 5) -> None:
        generate = model.sampling.generate

        def generate_then_signal(*args, **kwargs):
            for count, token in enumerate(generate(*args, **kwargs), 1):
                yield token
                if count == tokens:
                    os.kill(os.getpid(), signum)

        model.sampling.generate = generate_then_signal


class NaNWeights(L.Callback):
    """Make one weight NaN before training starts: every loss, validation's included, is NaN."""

    def on_train_start(self, trainer: L.Trainer, pl_module) -> None:
        if trainer.ckpt_path is None:
            with torch.no_grad():
                next(pl_module.parameters()).view(-1)[0] = torch.nan


class NaNGradientAt(L.Callback):
    """Make one gradient NaN in step `step + 1` (and in the `count - 1` steps after it), after
    backward and before the update."""

    def __init__(self, step: int, count: int = 1) -> None:
        self.step, self.count = step, count

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module, optimizer) -> None:
        if trainer.ckpt_path is None and 0 <= trainer.global_step - self.step < self.count:
            parameter = next(p for p in pl_module.parameters() if p.grad is not None)
            parameter.grad.view(-1)[0] = torch.nan


class SignalAgainWhileStopping(L.Callback):
    """Once the run is stopping on a signal, send this process SIGTERM every 5 ms for `seconds`,
    as an impatient scheduler would, across the checkpoint, the summary and the exit."""

    def __init__(self, seconds: float = 3.0) -> None:
        self.seconds = seconds

    def on_exception(self, trainer: L.Trainer, pl_module, exception: BaseException) -> None:
        def repeat() -> None:
            deadline = time.monotonic() + self.seconds
            while time.monotonic() < deadline:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.005)

        threading.Thread(target=repeat, daemon=True).start()
