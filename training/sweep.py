"""What differs when train.py runs as one job of a Hydra sweep (`-m`, or an Optuna search):
where the Optuna study lives, the trial a job reports its validation curve to, and the settings
a sweep cannot run."""

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException
from hydra.types import RunMode
from omegaconf import DictConfig

from training.failures import TRAIN_ERRORS
from training.guard import TrainingDiverged
from training.summary import run_summary, write_summary


class JobFailed(CompactHydraException):
    """A sweep job that the user's config broke. Compact: Hydra ends the sweep with its message
    alone, not a traceback."""


def run_sweep_job(train: Callable[[DictConfig], float | None], cfg: DictConfig) -> float | None:
    """One job of a sweep. A job the user's config breaks (say n_head=3 with n_embd=128) fails
    with a one-line message and a failed summary.json, and its error goes back to the sweeper,
    which records it (Optuna marks the trial failed) while the other jobs run on."""
    started = time.perf_counter()
    try:
        return train(cfg)
    except TRAIN_ERRORS as error:
        job = HydraConfig.get().job
        message = f"job {job.num} ({job.override_dirname}): {error}"
        print(f"error: {message}", file=sys.stderr)
        if not isinstance(error, TrainingDiverged):  # a diverged run has written its summary
            write_summary(cfg.paths.output_dir, run_summary(None, started, "failed", str(error)))
        raise JobFailed(message) from None


# The Optuna trial whose job this process runs: the sweeper (hydra_plugins/tinyformer_optuna.py)
# runs its jobs one at a time in its own process (Hydra's basic launcher) and sets it around each.
_trial: Any = None


@contextmanager
def running_trial(trial: Any) -> Iterator[None]:
    global _trial
    _trial = trial
    try:
        yield
    finally:
        _trial = None


class TrialPruning(L.Callback):
    """Reports every validation loss to the running Optuna trial, and stops the run at once when
    the study's pruner judges the curve hopeless next to the other trials' at the same step."""

    def __init__(self, trial: Any) -> None:
        self.trial = trial
        self.pruned: str | None = None  # why, once pruned

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        loss = trainer.callback_metrics.get("val/loss")
        if trainer.sanity_checking or loss is None:
            return
        self.trial.report(float(loss), trainer.global_step)
        if self.trial.should_prune():
            self.pruned = f"at step {trainer.global_step}, val loss {float(loss):.4f}"
            trainer.should_stop = True


def trial_pruning() -> list[TrialPruning]:
    """The pruning callback when this job is an Optuna trial."""
    return [] if _trial is None else [TrialPruning(_trial)]


def pruned_reason(trainer: L.Trainer) -> str | None:
    pruning = next((c for c in trainer.callbacks if isinstance(c, TrialPruning)), None)
    return None if pruning is None else pruning.pruned


def raise_if_pruned(trainer: L.Trainer) -> None:
    """End a pruned trial's job the way Optuna expects, once the run is summarised and saved."""
    reason = pruned_reason(trainer)
    if reason:
        import optuna

        raise optuna.TrialPruned(reason)


def in_sweep() -> bool:
    return HydraConfig.get().mode == RunMode.MULTIRUN


def sqlite_url(path: str) -> str:
    """A SQLAlchemy URL for the sqlite file at `path`, its folder made first: an Optuna study is
    created before Hydra makes the sweep directory it lives in."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{Path(path).resolve()}"


def check_not_ddp_in_sweep(world_size: int) -> None:
    # Lightning starts the other ranks by re-running the command line, which in a sweep would
    # re-run the whole sweep in every rank.
    if world_size > 1 and in_sweep():
        raise ValueError(
            f"a multi-process trainer (world size {world_size}) cannot run inside a "
            "--multirun sweep; sweep with one process per job (trainer=default), or launch "
            "each distributed run on its own"
        )
