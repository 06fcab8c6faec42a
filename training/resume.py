"""What a checkpoint needs beyond Lightning's own state for a run to continue exactly, and a
last checkpoint when the run is told to stop.

Lightning saves weights, optimizer, scheduler, step counters and callbacks' states. ResumeState
adds the random streams (dropout draws from them) and the W&B run a resumed run continues;
the data order needs nothing, since ResumableShuffle starts at the restored step.
StopSignals turns SIGINT, like SIGTERM, into a stop at the next step boundary with a checkpoint.
"""

import random
import signal
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities.exceptions import SIGTERMException


def random_streams() -> dict:
    streams = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        streams["cuda"] = torch.cuda.get_rng_state_all()
    return streams


def restore_random_streams(streams: dict) -> None:
    torch.set_rng_state(streams["torch"])
    random.setstate(streams["python"])
    if "cuda" in streams and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(streams["cuda"])


class ResumeState(L.Callback):
    """Saves, in every checkpoint, the random streams and the W&B run (id and group); restores
    the streams when training resumes, after whatever start-up drew from them."""

    def __init__(self) -> None:
        self._streams: dict | None = None  # loaded from a checkpoint, not restored yet
        self._wandb: dict | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        loggers = [lg for lg in trainer.loggers if isinstance(lg, WandbLogger)]
        if loggers and trainer.is_global_zero:
            run = loggers[0].experiment
            self._wandb = {"id": run.id, "group": run.group or run.id}

    def state_dict(self) -> dict:
        state: dict = {"random": random_streams()}
        if self._wandb is not None:
            state["wandb"] = self._wandb
        return state

    def load_state_dict(self, state: dict) -> None:
        self._streams = state["random"]

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._streams is not None:
            restore_random_streams(self._streams)
            self._streams = None


def last_checkpoint_path(trainer: L.Trainer) -> Path | None:
    callback = trainer.checkpoint_callback
    if not isinstance(callback, ModelCheckpoint) or callback.dirpath is None:
        return None
    return Path(callback.dirpath) / f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}"


class StopSignals(L.Callback):
    """SIGTERM (a cluster pre-empting the job) and SIGINT (Ctrl-C) stop training at the next step
    boundary, where the state is whole, and write last.ckpt there. A second Ctrl-C quits at once.

    Lightning already turns SIGTERM into a SIGTERMException at a step boundary, on every rank of a
    distributed run; SIGINT is routed through the same path. After fit() raises, `signum` and
    `saved` say what stopped the run and where its checkpoint is.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self.saved: Path | None = None
        self._previous_sigint = None
        self._sigterm_handler = None
        self._training = False

    def guard_shutdown(self) -> None:
        """Called before Trainer.fit: SIGTERM gets a handler of ours, which Lightning calls
        beside its own while it trains and puts back when it is done. Once a stop is under way,
        another SIGTERM (a scheduler repeating itself) is ignored, so that the checkpoint and
        the summary are finished rather than cut short; outside training, SIGTERM ends the
        process as it always would (status 143)."""
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame) -> None:
        if self.signum is not None:
            print(
                f"{signal.Signals(signum).name} again: still saving, then stopping", file=sys.stderr
            )
        elif not self._training:
            raise SystemExit(128 + signum)
        # while training, Lightning's handler (called beside this one) stops at the next step

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._training = True
        self._previous_sigint = signal.signal(signal.SIGINT, self._on_sigint)
        self._sigterm_handler = signal.getsignal(signal.SIGTERM)

    def _on_sigint(self, signum: int, frame) -> None:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C: quit now
        print(
            "\nCtrl-C: stopping after this step and saving a checkpoint (Ctrl-C again to quit now)",
            file=sys.stderr,
        )
        if callable(self._sigterm_handler):  # Lightning's: it stops the loop at a step boundary
            self._sigterm_handler(signal.SIGTERM, frame)
        self.signum = signal.SIGINT

    def _restore_sigint(self) -> None:
        if self._previous_sigint is not None:
            signal.signal(signal.SIGINT, self._previous_sigint)
            self._previous_sigint = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._training = False
        self._restore_sigint()

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._training = False
        self._restore_sigint()
        if not isinstance(exception, SIGTERMException):
            return  # a failure (say a non-finite loss) must not overwrite the last good state
        self.signum = self.signum or signal.SIGTERM
        path = last_checkpoint_path(trainer)
        if path is not None:
            trainer.save_checkpoint(path, weights_only=False)  # the full state, to resume
            self.saved = path
