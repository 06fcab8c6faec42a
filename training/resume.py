"""All of continuing a run: where it continues (its directory and checkpoint), the config it
continues with, what it may not change, what its checkpoints carry, and how it stops.

- `prepare_resume`: given ckpt_path, the run's config is composed again from the checkpoint's
  run's overrides under this command's, and must keep the settings the checkpoint's state
  depends on; without it, a fresh run may not overwrite another's checkpoints.
- Lightning saves weights, optimizer, scheduler, step counters and callbacks' states.
  ResumeState adds the random streams (dropout draws from them) and the W&B run a resumed run
  continues; the data module saves its position in the training data (data/cache.py), and
  the LightningModule, in a checkpoint written inside a step whose batches accumulate, the
  gradients summed so far (training/module.py).
  ExactRestart corrects Lightning's saved loop counts where its restart would misread them
  (checkpoints written at or after an epoch's end, or in the last step's validation).
- StopSignals turns SIGINT, like SIGTERM, into a stop at the next step boundary with a
  checkpoint, at the same batch on every rank of a distributed run; before the first step
  (preparing the data, the sanity check), into the end of the command.
"""

import os
import random
import shutil
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, NoReturn

import lightning as L
import torch
from hydra import compose
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf

from data.local_files import DATA_PATH_KEYS, from_launch_dir, from_launch_dir_or_here
from data.tokenizer import BPETokenizer, CharTokenizer
from errors import end_as_interrupted, end_at_once, override_key
from kinds import KINDS, kind_of
from model.checkpoint import find_checkpoint, load_safely
from training.failures import TRAIN_ERRORS
from training.summary import print_once

# Settings a resumed run may not change: they decide what the restored state means.
FIXED_ON_RESUME = (
    "model.",
    "data.",
    "seed",
    "optim.name",
    "optim.beta1",
    "optim.beta2",
    "optim.weight_decay",
)
FREE_ON_RESUME = ("model.vocab_size", "data.num_workers", "data.num_proc", "data.cache_dir")
# Fixed keys added after some checkpoints were written, with the value those checkpoints ran
# with, so that they still resume.
EARLIER_VALUES = {"optim.name": "adamw"}


def resume_run_dir(ckpt_path: str | None, new_run_dir: str) -> str:
    """hydra.run.dir (a config resolver): a run resumed from a run directory, its checkpoints/
    folder or a file in it continues in that directory; any other run gets a new one."""
    if ckpt_path is None or ckpt_path == "last":
        return new_run_dir
    path = Path(ckpt_path).expanduser()
    if (path / "checkpoints").is_dir():
        return str(path)
    if path.is_dir() and path.name == "checkpoints":
        return str(path.parent)
    if path.is_file() and path.parent.name == "checkpoints":
        return str(path.parent.parent)
    return new_run_dir


def hydra_record_dir(output_dir: str) -> str:
    """hydra.output_subdir (a config resolver): .hydra, or .hydra/resume-N for a run resumed in
    its own directory, so the record of how the run was first started is never overwritten."""
    record = Path(output_dir) / ".hydra"
    if not (record / "config.yaml").exists():
        return ".hydra"
    number = 1
    while (record / f"resume-{number}").exists():
        number += 1
    return f".hydra/resume-{number}"


@contextmanager
def refused_leaves_no_record() -> Iterator[None]:
    """A command refused (a user's error) before it trains leaves nothing in a run directory:
    the record Hydra wrote of it there, .hydra/resume-N, goes (see discard_command_record)."""
    try:
        yield
    except TRAIN_ERRORS:
        discard_command_record()
        raise


def discard_command_record() -> None:
    """Remove this command's .hydra/resume-N (Hydra writes it before any check runs): a run
    directory keeps the records of the starts that trained, and the first start's .hydra."""
    hydra = HydraConfig.get()
    if hydra.output_subdir and hydra.output_subdir.startswith(".hydra/resume-"):
        shutil.rmtree(Path(hydra.runtime.output_dir) / hydra.output_subdir, ignore_errors=True)


def resumed_overrides(original: list[str], given: list[str]) -> list[str]:
    """The overrides a resumed run composes: the checkpoint's run's, then this command's, which
    win where both set a key. The checkpoint's run's `+a.b=value` becomes `++a.b=value`: a key
    the config files have gained since (a `sample.*` option, say) is then set rather than
    refused as already there. A key without a dot may name a config group, which `++` cannot
    take; a group with a package (`@`) or a path (`/`) neither."""
    keys = {override_key(o) for o in given}
    kept = [o for o in original if override_key(o) not in keys]
    return [_add_or_set(o) for o in kept] + list(given)


def _add_or_set(override: str) -> str:
    """`+a.b=value` as `++a.b=value`; any other override as it is."""
    key = override.split("=", 1)[0]
    adds_a_value = key.startswith("+") and not key.startswith("++") and "." in key
    if adds_a_value and not set(key) & set("@/"):
        return f"+{override}"
    return override


def flatten(config: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def resume_conflicts(saved: dict, current: dict) -> list[str]:
    """'key: saved -> current' for every fixed setting this run changes."""
    saved, current = EARLIER_VALUES | flatten(saved), flatten(current)
    keys = sorted(set(saved) | set(current))
    return [
        f"{key}: {saved.get(key)!r} in the checkpoint, {current.get(key)!r} now"
        for key in keys
        if key.startswith(FIXED_ON_RESUME)
        and not key.startswith(FREE_ON_RESUME)
        and saved.get(key) != current.get(key)
    ]


@dataclass
class Resume:
    """How a run starts: `cfg` composed from `overrides` (recorded in its checkpoints, for a
    later resume; a resume's data paths are the run's, so the ones its command gave are not
    recorded), and, for a run that continues, the checkpoint at `path`."""

    cfg: DictConfig
    overrides: list[str]
    path: Path | None = None
    checkpoint: dict | None = field(default=None, repr=False)
    # where the run was first launched: its relative data paths are relative to it
    launch_dir: Path = field(default_factory=Path.cwd)

    @property
    def complete(self) -> bool:
        """A resumed run already at trainer.max_steps: nothing to train."""
        return self.checkpoint is not None and (
            self.checkpoint["global_step"] == self.cfg.trainer.get("max_steps")
        )

    def says_nothing_to_train(self) -> bool:
        """Whether the run is complete: if so, say so, and leave no record of this command (a
        finished pre-emptible job's command, repeated, changes nothing)."""
        if not self.complete:
            return False
        discard_command_record()
        print_once(
            f"ckpt_path={self.path} is at trainer.max_steps={self.cfg.trainer.max_steps} "
            "already: nothing to train (give a larger trainer.max_steps to train on)"
        )
        return True

    @property
    def saved_tokenizer(self) -> dict | None:
        return self.checkpoint["hyper_parameters"]["tokenizer"] if self.checkpoint else None

    def check_data(self, tokenizer: CharTokenizer | BPETokenizer, vocab_size: int) -> None:
        """The data of a resumed run must give the checkpoint's tokenizer and vocabulary rows
        (model.vocab_size is free on resume only because it is derived; a padding must match)."""
        if self.checkpoint is None:
            return
        if tokenizer.to_dict() != self.saved_tokenizer:
            raise ValueError(
                f"ckpt_path={self.path} was trained with another tokenizer than this data "
                "gives; resume with the data options of that run"
            )
        saved = self.checkpoint["hyper_parameters"]["model"]["vocab_size"]
        if saved not in (None, vocab_size):
            raise ValueError(
                f"ckpt_path={self.path} has a {saved}-row vocabulary and this run asks for "
                f"{vocab_size}: drop model.vocab_size=... to resume it"
            )

    def record(self) -> dict:
        """What the run config records: its overrides, the directory it was launched in (which
        its relative paths are relative to), and where it resumed from."""
        record: dict = {"overrides": self.overrides, "launch_dir": str(self.launch_dir)}
        if self.checkpoint is not None:
            record["resumed_from"] = {
                "checkpoint": str(self.path),
                "step": self.checkpoint["global_step"],
            }
        return record

    def wandb_options(self, node: DictConfig) -> dict:
        """For a W&B logger of a resumed run: online, continue the checkpoint's W&B run (same
        id); offline (where W&B cannot continue a run), a new run in the same group."""
        if self.checkpoint is None or not node.get("_target_", "").endswith("WandbLogger"):
            return {}
        state = self.checkpoint.get("callbacks", {}).get("ResumeState", {}).get("wandb")
        if state is None:
            return {}
        if node.get("offline"):
            return {"group": node.get("group") or state["group"]}
        return {"id": state["id"], "resume": "must"}


def prepare_resume(cfg: DictConfig, given: list[str], in_sweep: bool) -> Resume:
    """The run `cfg` starts, under this command's overrides `given`. Without ckpt_path, a new run
    that would overwrite another's checkpoints is refused (a sweep job's directory is new)."""
    given = [o for o in given if override_key(o) != "ckpt_path"]
    path = None
    if cfg.get("ckpt_path"):
        path = find_ckpt_path(cfg.ckpt_path, cfg.paths.output_dir)
    if path is None:
        last = Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"
        if last.is_file() and not in_sweep:
            raise ValueError(
                f"hydra.run.dir={cfg.paths.output_dir} already holds a run ({last}): continue "
                f"it with ckpt_path={cfg.paths.output_dir}, or choose another hydra.run.dir"
            )
        if last.is_file():
            clear_earlier_job(Path(cfg.paths.output_dir))
        return Resume(cfg, given)
    check_run_dir_holds(path, Path(cfg.paths.output_dir))
    # Mapped, not read: Lightning reads the file itself, and this copy is kept through the run.
    checkpoint = load_safely(path, mmap=True)
    hparams = checkpoint.get("hyper_parameters") if isinstance(checkpoint, dict) else None
    saved = hparams.get("run_config") if isinstance(hparams, dict) else None
    if saved is None:
        raise ValueError(f"ckpt_path={path} was not written by train.py: it has no run config")
    saved_kind, asked = hparams.get("kind"), kind_of(cfg.model)
    if "model" in {override_key(o) for o in given} and asked.name != saved_kind:
        saved_label = KINDS[saved_kind].label if saved_kind in KINDS else f"a {saved_kind} model"
        raise ValueError(
            f"ckpt_path={path} holds {saved_label} and this command asks for {asked.label}: "
            "drop model=... to resume it, or start a new run without ckpt_path"
        )
    overrides = resumed_overrides(saved.get("overrides", []), given)
    if overrides != given:
        try:
            cfg = compose("train", overrides=[*overrides, f"ckpt_path={path}"])
        except ConfigCompositionException as error:
            raise ValueError(
                f"ckpt_path={path}: this command's overrides do not fit the checkpoint's run "
                f"({' '.join(str(error).split())}); drop the ones that change its model or data"
            ) from None
    else:
        cfg.ckpt_path = str(path)
    launch_dir = Path(saved.get("launch_dir") or os.getcwd())  # older checkpoints: here
    read_as_the_run_did(cfg.data, saved.get("data", {}), launch_dir, given)
    current = OmegaConf.to_container(cfg, resolve=True)
    # Each side's data files as they are read: the run's from where it was launched, this
    # command's from here
    here = Path.cwd()
    current["data"] = from_launch_dir(current["data"], here)
    saved_data = from_launch_dir(saved.get("data", {}), launch_dir, moved_to=here)
    saved_as_read = saved | {"data": saved_data}
    conflicts = resume_conflicts(saved_as_read, current)
    if conflicts:
        raise ValueError(
            f"ckpt_path={path} cannot resume with changed settings ({'; '.join(conflicts[:4])}"
            f"{'; ...' if len(conflicts) > 4 else ''}): drop those overrides, or set those keys "
            "to the checkpoint's values (a recipe such as experiment=... may have changed since "
            "it was written), or start a new run without ckpt_path"
        )
    step, max_steps = checkpoint["global_step"], cfg.trainer.get("max_steps")
    if isinstance(max_steps, int) and 0 <= max_steps < step:
        raise ValueError(
            f"ckpt_path={path} is at step {step}, past trainer.max_steps={max_steps}: give a "
            f"larger trainer.max_steps to train on"
        )
    # A later resume reads the run's data paths from its launch directory too; those this
    # command gave name the same files (checked above), relative to another directory.
    data_paths = {f"data.{key}" for key in DATA_PATH_KEYS}
    recorded = resumed_overrides(
        saved.get("overrides", []), [o for o in given if override_key(o) not in data_paths]
    )
    resume = Resume(cfg, recorded, path, checkpoint, launch_dir)
    if not resume.complete:  # train.py says there is nothing to train once every check passed
        print_once(
            f"resuming from {path} at step {step}"
            + (f" with that run's overrides: {' '.join(overrides)}" if overrides else "")
        )
    return resume


def read_as_the_run_did(data: DictConfig, saved: dict, launch_dir: Path, given: list[str]) -> None:
    """Set the data paths of `data`, composed for a resume, to the files the run read (its run
    config's `saved` data, relative to `launch_dir`), and those this command gives to the files
    they name from here, absolute wherever a path relative to here would read other files or
    record them relative to another directory than launch_dir. Launched elsewhere, a resume
    would otherwise read same-named files there (with the same characters, a corpus the
    tokenizer check cannot tell apart). What names nothing where the run was launched any more,
    but does here (the project has moved), is read from here, as the command says."""
    here = Path.cwd()
    launched_here = launch_dir.resolve() == here.resolve()
    given_keys = {override_key(o) for o in given}
    for key in (key for key in DATA_PATH_KEYS if key in data):
        composed = {key: data[key]}
        if f"data.{key}" in given_keys:
            read = from_launch_dir(composed, here)
        else:
            read, notes = from_launch_dir_or_here(
                {key: saved.get(key, data[key])}, launch_dir, here
            )
            for note in notes:
                print_once(note)
        if not (launched_here and from_launch_dir(composed, here) == read):
            data[key] = read[key]


def clear_earlier_job(job_dir: Path) -> None:
    """A sweep run again into its hydra.sweep.dir writes each job's directory anew: the earlier
    job's best-step<N>.ckpt would stay beside the new job's, and the newest by step, which
    generate.py takes for the best, could be the earlier job's; its attention maps would show
    steps this job may never reach."""
    print_once(f"{job_dir}: removing the checkpoints and attention maps of the earlier job there")
    for folder in ("checkpoints", "attention_maps"):
        shutil.rmtree(job_dir / folder, ignore_errors=True)


def check_run_dir_holds(checkpoint: Path, run_dir: Path) -> None:
    """A run directory that holds a run continues that run only: resuming another's checkpoint
    there (hydra.run.dir=... beside ckpt_path=...) would write over its checkpoints, tokenizer and
    summary."""
    last = run_dir / "checkpoints" / "last.ckpt"
    if last.is_file() and checkpoint.resolve().parent != last.parent.resolve():
        raise ValueError(
            f"hydra.run.dir={run_dir} holds another run ({last}) than ckpt_path={checkpoint}: "
            "drop hydra.run.dir (a run's checkpoint continues in its own directory), or choose "
            "a new one"
        )


def find_ckpt_path(ckpt_path: str, output_dir: str) -> Path | None:
    """The checkpoint ckpt_path names (model/checkpoint.py's rule, "last"); `last` is this run
    directory's last.ckpt, or None when there is none yet and the run starts afresh."""
    if ckpt_path != "last":
        return find_checkpoint(ckpt_path, "last", "ckpt_path")
    last = Path(output_dir) / "checkpoints" / "last.ckpt"
    if last.is_file():
        return last
    print_once(
        f"ckpt_path=last: no checkpoint in {output_dir}/checkpoints yet, so this run starts "
        "from scratch (to continue another run, give its directory: "
        "ckpt_path=outputs/<date>/<time>)"
    )
    return None


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
        self._wandb_logger: WandbLogger | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        loggers = [lg for lg in trainer.loggers if isinstance(lg, WandbLogger)]
        if loggers and trainer.is_global_zero:
            self._wandb_logger = loggers[0]  # its run's record is read when saved

    def state_dict(self) -> dict:
        state: dict = {"random": random_streams()}
        record = self._wandb_logger.run_record() if self._wandb_logger is not None else None
        if record is not None:
            state["wandb"] = record
        return state

    def load_state_dict(self, state: dict) -> None:
        self._streams = state["random"]

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._streams is not None:
            restore_random_streams(self._streams)
            self._streams = None


def align_epoch_counts(fit_loop: dict) -> None:
    """Make the epoch counts of Lightning's saved fit loop state (checkpoint["loops"]["fit_loop"])
    agree, in place, with its batch counts. They disagree in a checkpoint written in an epoch's
    last validation, before Lightning counted the epoch complete, or after the epoch's loop
    ended: Lightning then counts the epoch complete, max_steps reached or not, and resets the
    batch counts only as the next epoch's batches begin.

    - The epoch's batches all trained: every epoch begun is complete, no batch of the next one.
    - Fewer (the run reached max_steps), though the epoch was counted complete: it is under way.
    """
    batches = fit_loop["epoch_loop.batch_progress"]
    counts = batches["current"]
    epochs = fit_loop["epoch_progress"]
    epoch_done = batches["is_last_batch"] and counts["completed"] == counts["processed"]
    loop_ended = epochs["current"]["processed"] == epochs["current"]["started"]
    if epoch_done:
        batches["current"], batches["is_last_batch"] = dict.fromkeys(counts, 0), False
    elif not (loop_ended and counts["completed"] > 0):
        return  # mid-epoch, or before its first batch: Lightning restarts those right
    for progress in epochs.values():  # its total and current counts
        begun = progress["started"]
        complete = begun if epoch_done else begun - 1
        progress.update(ready=begun, started=begun, processed=complete, completed=complete)


class ExactRestart(L.Callback):
    """Makes a resumed run's loops go on where the checkpoint's run was.

    Lightning reads where in its loops a checkpoint was written from their progress counts, and
    expects one of three places: in on_train_batch_end, in a validation it scheduled itself, or
    after a step. Our runs also write checkpoints in a validation it did not schedule (the last
    step's: the module asks for it with should_stop), and after the loop over an epoch ended (a
    stop signal at an epoch's last step; the end of a run whose last step was not validated).
    Restored as they are:

    - after an epoch's last batch (and not in a validation Lightning runs there), Lightning
      trains one more batch in that epoch, the next epoch's first, then starts the next epoch's
      order afresh: the rest of that epoch is never trained;
    - after a run ended mid-epoch, Lightning counts the rest of that epoch as the next epoch,
      and the checkpoints that follow put the data one epoch on;
    - Lightning's count of the batches that stepped, the step loggers get, comes back one short
      after a validation it did not schedule (written before the count), or one over after a
      stop signal at a step it validated (written after the count, which is counted again).

    align_epoch_counts corrects the first two as the checkpoint loads; the count is set at the
    first batch. An ended epoch's on_train_epoch_end hooks are not called again: the run that
    wrote the checkpoint called them, unless it was killed first (nothing of ours has one).
    """

    def __init__(self) -> None:
        self._logging_step_to_set = False

    def on_load_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict
    ) -> None:
        # Called before Lightning restores its loops from this same dict.
        if "loops" in checkpoint:
            align_epoch_counts(checkpoint["loops"]["fit_loop"])
            self._logging_step_to_set = True

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int
    ) -> None:
        if self._logging_step_to_set:
            # Before a batch, the batches that stepped are the optimizer's steps (one optimizer,
            # stepped by Lightning, on each group of accumulated batches).
            trainer.fit_loop.epoch_loop._batches_that_stepped = trainer.global_step
            self._logging_step_to_set = False


def _ignore_signal(signum: int, frame) -> None:
    pass


def _no_broadcast() -> None:
    pass


# Where a run is, for what a signal does: "starting" until its first step (the checks, preparing
# the data, Lightning's sanity check), "training", then "stopping" (on a signal or a failure:
# fit() raised) or "finished" (fit() returned).
Phase = Literal["starting", "training", "stopping", "finished"]


class SampleCutShort(BaseException):
    """A signal in the end-of-run sample, raised there to end it. Not an Exception: print_end
    takes those for a failed sample."""


def _end_workers() -> None:
    """Kill the processes this one started to help it (datasets.map's pool and the manager of
    its queues, a DataLoader's workers): a process that exits at once does not end them, and a
    pool's workers would wait for its tasks forever."""
    for name in ("multiprocess", "multiprocessing"):  # datasets' pools, and torch's
        module = sys.modules.get(name)
        for child in module.active_children() if module else []:
            child.kill()


def last_checkpoint_path(trainer: L.Trainer) -> Path | None:
    callback = trainer.checkpoint_callback
    if not isinstance(callback, ModelCheckpoint) or callback.dirpath is None:
        return None
    return Path(callback.dirpath) / f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}"


class StopSignals(L.Callback):
    """SIGTERM (a cluster pre-empting the job) and SIGINT (Ctrl-C) stop training at the next step
    boundary, where the state is whole, and write last.ckpt there (where batches accumulate,
    Lightning stops after the current batch: the checkpoint keeps the step's gradients so far).
    A Ctrl-C during a validation lets it finish first (its loss, and a best checkpoint, would
    otherwise be lost: the resumed run does not repeat it). A second Ctrl-C, or a Ctrl-C while
    a stop (on SIGTERM, say) saves, quits at once, by SIGINT as the first would end the run:
    checkpoints are written aside and renamed into place, so the ones saved before stay whole.
    Before training (the checks, preparing the data, the sanity check) there is nothing to save:
    either signal ends the process at once (Ctrl-C with one line). A run stopped by SIGTERM ends
    with status 143, one stopped by Ctrl-C by SIGINT itself (the shell's $? reads 130), as a
    shell loop over runs needs to stop too. Once training is complete (fit() returned), either
    ends the end-of-run sample (run_sample), and the run ends completed, as summary.json says.

    On one process, Lightning's SIGTERM handler sets a flag that its loops turn into a
    SIGTERMException at the end of the batch; SIGINT sets that flag too. In a run of several
    processes that handler would broadcast from inside itself, wherever the signal finds each
    rank, and each rank would stop by its own flag: the ranks' collectives fall out of step, and
    the run fails or hangs. There, our handlers only record the signal, and after each batch and
    each validation the ranks agree whether any of them was asked to stop (_agree_on_stop): all
    stop together, at the end of the same batch; a SIGTERM during a validation, like a Ctrl-C,
    lets it finish first.

    After fit() raises a SIGTERMException, `signum` and `saved` say what stopped the run and where
    its checkpoint is (`signum` is set as soon as a signal comes, so a run whose fit() returned
    may have one that came too late to stop it).
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self.saved: Path | None = None
        self._phase: Phase = "starting"
        self._trainer: L.Trainer | None = None
        self._stop_after_validation = False
        self._distributed = False
        self._pid = os.getpid()  # a process forked from this one inherits our handlers
        self._sampling = False
        self._sample_cut_short = False
        self._launcher = None

    @contextmanager
    def handling_signals(self, put_back: bool) -> Iterator[None]:
        """SIGTERM and SIGINT are ours from the block's start (a run's first check). With
        `put_back`, the handlers before it are put back when it ends, so that a sweep's next job
        starts as this one did; without, ours stay to the process's end, so that a signal as it
        finishes the run (W&B's last writes, the interpreter's exit) does not kill a run that
        summary.json says completed. Lightning calls our SIGTERM handler beside its own while it
        trains, and puts ours back when it is done. Once a stop is under way, another SIGTERM (a
        scheduler repeating itself) is ignored, so that the checkpoint and the summary are
        finished rather than cut short."""
        previous = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
        signal.signal(signal.SIGTERM, self._on_sigterm)
        # Ctrl-C too: before training Lightning would take it for its own in the sanity check
        # and end the process with status 1, in silence, and elsewhere Python with a traceback.
        signal.signal(signal.SIGINT, self._on_sigint)
        ending = False
        try:
            yield
        except (SystemExit, KeyboardInterrupt):
            # The process is ending (with a stop's status, say): ours stay to its end, so that
            # a SIGTERM a scheduler repeats meanwhile is ignored rather than fatal.
            ending = True
            raise
        finally:
            if put_back and not ending:
                for signum, handler in previous.items():
                    signal.signal(signum, handler)

    def end_launched_processes_too(self, trainer: L.Trainer) -> None:
        """A signal before training ends the processes that `trainer`'s launcher starts (a
        distributed run's other ranks) with this one, as it ends this one: left alone, each
        would fail with a traceback in its next collective, its peer gone."""
        self._launcher = trainer.strategy.launcher

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """In a run of several processes, Lightning's own SIGTERM handler is made to do nothing
        (called in fit before Lightning installs it): ours records the signal, and the ranks
        agree on the stop (see the class's docstring)."""
        self._distributed = trainer.world_size > 1
        if self._distributed:
            # The method Lightning installs as its SIGTERM handler as the fit starts, with ours
            # beside it. Besides the broadcast, it sends the signal on to the processes that
            # Lightning started: they need none, the agreement stops them.
            trainer._signal_connector._sigterm_notifier_fn = _ignore_signal
            # And its check before each batch, a broadcast of rank zero's flag, which the
            # agreement after each batch makes redundant: one collective a batch, not two.
            trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = _no_broadcast

    def _on_sigterm(self, signum: int, frame) -> None:
        if self._phase == "starting":
            self._end_before_training(signum)
        elif self._phase == "finished":
            self._cut_sample_short(signum)
        elif self.signum is not None:
            print(
                f"{signal.Signals(signum).name}: a stop is already under way (saving, then "
                "stopping)",
                file=sys.stderr,
            )
        elif self._phase == "stopping":  # a run failing
            raise SystemExit(128 + signum)
        elif self._distributed:
            self.signum = signal.SIGTERM  # the ranks agree on the stop after this batch
        # on one process, Lightning's handler (called beside this one) stops at the next step

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._phase, self._trainer = "training", trainer

    def _on_sigint(self, signum: int, frame) -> None:
        if self._phase == "starting":
            self._end_before_training(signum)
        if self._phase == "finished":
            self._cut_sample_short(signum)
            return
        signal.signal(signal.SIGINT, self._quit_now)  # a second Ctrl-C (on_exception sets it too)
        self.signum = signal.SIGINT
        trainer = self._trainer
        validating = trainer is not None and trainer.validating
        if trainer is None or trainer.is_global_zero:  # a terminal's Ctrl-C reaches every rank
            print(
                f"\nCtrl-C: stopping after this {'validation' if validating else 'step'} and "
                "saving a checkpoint (Ctrl-C again to quit now)",
                file=sys.stderr,
            )
        if validating:
            self._stop_after_validation = True
        else:
            self._stop_at_step_boundary()

    def _end_before_training(self, signum: int) -> NoReturn:
        """Before any step (the checks, preparing the data, the sanity check) there is nothing
        to save: end the process at once (errors.end_at_once: Ctrl-C by SIGINT itself, with one
        line; SIGTERM with status 143). At once, not by an exception through the code it
        interrupts: datasets.map, ending its pool of workers that the signal reached too, waits
        forever on a lock that a dead worker held. Nothing is left half-done that a later run
        would use: the data cache builds an entry aside and moves it into place whole, and the
        next build of that entry removes what this one had written (data/cache.py). A resumed
        run's record of this start (.hydra/resume-N) goes, as for a start that was refused."""
        if os.getpid() == self._pid:  # a worker of datasets.map's pool ends quietly
            if signum == signal.SIGINT:
                print("\nCtrl-C before training began: stopping, nothing saved", file=sys.stderr)
            if HydraConfig.initialized():
                discard_command_record()
            self._end_now(signum, signum)  # the signal ends the other ranks as it ends this one
        os._exit(128 + signum)

    def _quit_now(self, signum: int, frame) -> NoReturn:
        """Ctrl-C once the run is stopping (a Ctrl-C before it, a SIGTERM, a failure): end at once,
        whatever the stop had still to do, by SIGINT as a Ctrl-C ends the run. The checkpoint
        being saved, if any, is given up: checkpoints are written aside and renamed into place
        (checkpoint_io.save_durably), so last.ckpt stays the last one saved whole, and the
        run resumes from it. Another rank is killed (SIGKILL): it might be waiting for this
        one in a collective, and only rank zero writes checkpoints."""
        if os.getpid() != self._pid:  # a forked worker: its parent ends it
            os._exit(128 + signum)
        if self._trainer is None or self._trainer.is_global_zero:
            print(
                "\nCtrl-C while stopping: quitting now; the checkpoints saved before stay as "
                "they were",
                file=sys.stderr,
            )
        self._end_now(signum, signal.SIGKILL)

    def _end_now(self, signum: int, signum_for_ranks: int) -> NoReturn:
        """End this process at once for `signum` (errors.end_at_once), and the processes it
        started: the other ranks by `signum_for_ranks`, DataLoader and datasets workers."""
        # torch's SIGCHLD handler would raise, told of the DataLoader workers killed here
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        _end_workers()
        if self._launcher is not None:
            self._launcher.kill(signum_for_ranks)
        end_at_once(signum)

    def run_sample(self, sample: Callable[[], None]) -> None:
        """Run `sample` (the end-of-run sample, once training is complete), which SIGTERM or
        Ctrl-C ends where it is; skip it where one came already."""
        if self._sample_cut_short:
            return
        self._sampling = True
        try:
            sample()
            self._sampling = False  # in the try: a signal until here is caught below
        except SampleCutShort:
            self._sampling = False

    def _cut_sample_short(self, signum: int) -> None:
        """Training is complete, its checkpoints and summary.json written: a signal now ends
        the end-of-run sample, once, and the run ends as the completed run it is, with status 0
        as summary.json says. Exiting with the signal's status instead would tell a scheduler
        to run again a job that has nothing left to train."""
        if self._sample_cut_short:
            return
        self._sample_cut_short = True
        if self._trainer is None or self._trainer.is_global_zero:
            name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
            what = "the end-of-run sample stops here" if self._sampling else "finishing"
            print(f"\n{name}: training is complete and saved; {what}", file=sys.stderr)
        if self._sampling:
            raise SampleCutShort

    def _stop_at_step_boundary(self) -> None:
        # Distributed, `signum` is all it takes: the ranks agree on the stop after the batch.
        # On one process, the flag Lightning's SIGTERM handler sets, which stops its loop: set,
        # not by calling that handler, which calls ours beside it, and ours would say "a stop
        # is already under way" after the Ctrl-C line.
        if not self._distributed and self._trainer is not None:
            self._trainer._signal_connector.received_sigterm = True

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int
    ) -> None:
        if self._distributed:
            self._agree_on_stop(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._stop_after_validation:
            self._stop_after_validation = False
            self._stop_at_step_boundary()
        if self._distributed and self._phase == "training":  # not in the sanity check
            self._agree_on_stop(trainer)

    def _agree_on_stop(self, trainer: L.Trainer) -> None:
        """Whether any rank was asked to stop, and by which signal (SIGTERM over SIGINT): one
        all-reduce, the same answer on every rank. If so, every rank sets Lightning's flag here,
        so that all raise SIGTERMException together at the end of this batch (after its
        validation, if it has one) and save last.ckpt together: saving is a collective too.

        Called on every rank after each batch and each validation, in runs of several processes
        only: it costs one all-reduce of one number per batch, read on the host, in place of
        Lightning's own check before every batch (a broadcast, turned off by setup)."""
        asked = torch.tensor([self.signum or 0], device=trainer.strategy.root_device)
        torch.distributed.all_reduce(asked, op=torch.distributed.ReduceOp.MAX)
        signum = int(asked.item())  # the one wait for the device of the agreement
        if signum:
            self.signum = signum
            trainer._signal_connector.received_sigterm = True  # what Lightning's handler sets

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._phase = "finished"

    def exit(self, trainer: L.Trainer, run_dir: str) -> NoReturn:
        """After fit() stopped on a signal: how to continue, then the end, for SIGTERM with the
        status a shell gives a process that SIGTERM ended (143), so job schedulers see it, and
        for Ctrl-C by SIGINT itself once the process has cleaned up (errors.end_as_interrupted),
        so that a shell loop running train.py stops too."""
        if trainer.is_global_zero:
            saved = f"saved {self.saved}" if self.saved else "nothing saved at this step"
            print(
                f"stopped by {signal.Signals(self.signum).name} after step {trainer.global_step}; "
                f"{saved}; continue with: python train.py ckpt_path={run_dir}",
                file=sys.stderr,
            )
        # Every rank ends with this status, none before rank zero has written all: the launcher
        # that started the other ranks (Lightning's) kills every process as soon as one of them
        # ends with a status other than 0, its checkpoint's background write included.
        trainer.strategy.barrier("StopSignals.exit")
        if self.signum == signal.SIGINT:
            end_as_interrupted(newline=False)
        sys.exit(128 + self.signum)

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._phase = "stopping"
        signal.signal(signal.SIGINT, self._quit_now)
        if not isinstance(exception, SIGTERMException):
            return  # a failure (say a non-finite loss) must not overwrite the last good state
        self.signum = self.signum or signal.SIGTERM
        path = last_checkpoint_path(trainer)
        if path is None:
            return
        try:
            trainer.save_checkpoint(path, weights_only=False)  # the full state, to resume
            trainer.strategy.checkpoint_io.wait()  # on disk before the run says it is saved
        except Exception as error:  # a full disk: the run still stops as the signal asked
            print(f"warning: the checkpoint at the stop was not saved: {error}", file=sys.stderr)
            return
        self.saved = path
