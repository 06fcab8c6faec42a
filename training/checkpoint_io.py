"""Checkpoint files that survive a crash at any moment, written while training goes on, and
loaded without running code (model/checkpoint.py's load_safely); and the checkpoint callback
of a run directory."""

import fcntl
import os
import shutil
import sys
import time
import uuid
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from pathlib import Path
from typing import IO, Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning_utilities.core.apply_func import apply_to_collection

from data.files import disk_full_cause
from model.checkpoint import load_safely


def partial_files(path: Path) -> list[Path]:
    """The temporary files of writes of `path` that never finished (a killed process)."""
    return sorted(path.parent.glob(f".{path.name}.*.partial"))


def save_durably(checkpoint: dict[str, Any], path: Path) -> None:
    """torch.save to a temporary file beside `path`, fsync it, rename it over `path` (atomic on
    POSIX), and fsync the folder so the rename itself survives a power cut. A process killed at
    any point leaves either the old file or the new one at `path`, never a mix.

    The temporary name is hidden, no *.ckpt (nothing looking for checkpoints picks it) and
    unique to this write, so two writers of one path never rename each other's half-written
    file. A full disk is a ValueError naming the folder, and its temporary file is removed."""

    def write(temporary: Path) -> None:
        with open(temporary, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())

    publish(write, path)


def link_durably(source: Path, path: Path) -> None:
    """Give the finished file `source` the second name `path`, as save_durably would write it:
    a hard link (no second copy of the bytes), or a copy where the file system has none."""

    def link(temporary: Path) -> None:
        try:
            os.link(source, temporary)
        except OSError:
            shutil.copyfile(source, temporary)
            with open(temporary, "rb") as f:
                os.fsync(f.fileno())

    publish(link, path)


def publish(write: Callable[[Path], None], path: Path) -> None:
    """write() a temporary file beside `path`, then rename it over `path` and fsync the folder:
    `path` is the old file or the whole new one, never a mix. On any failure the temporary
    file is removed, and a full disk is one line naming the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_name(path)
    try:
        write(temporary)
        os.replace(temporary, path)
    except BaseException as error:
        temporary.unlink(missing_ok=True)
        if disk_full_cause(error) is not None:  # torch.save wraps it in a RuntimeError
            then = (
                f"(the previous checkpoint is intact): free some space and resume with "
                f"ckpt_path={path.parent.parent}"
                if any(path.parent.glob("*.ckpt"))
                else "(no checkpoint was saved before it): free some space and start again"
            )
            raise ValueError(
                f"no space left on the disk of {path.parent} to write {path.name} {then}"
            ) from None
        raise
    fsync_folder(path.parent)


def temporary_name(path: Path) -> Path:
    """Hidden, no *.ckpt, and unique to this write: see save_durably."""
    return path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.partial")


def fsync_folder(folder: Path) -> None:
    """Make a rename in `folder` survive a power cut."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def claim_run_dir(run_dir: Path) -> IO:
    """Make this process the one writer of `run_dir`, or raise a ValueError naming the process
    that is. The lock is a POSIX record lock on run_dir/.lock: it is released when this process
    ends, however it ends (kill -9 included), and forked children do not inherit it. Keep the
    returned file open for as long as the run writes. Temporary files of checkpoint writes
    that a killed process left are removed: with the lock held, no write is under way."""
    run_dir.mkdir(parents=True, exist_ok=True)
    handle = open(run_dir / ".lock", "a+")
    try:
        fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise ValueError(
            f"{run_dir} is in use by {holder}: wait for that run to end (or stop it), or choose "
            "another hydra.run.dir"
        ) from None
    handle.truncate(0)
    handle.write(f"process {os.getpid()}\n")
    handle.flush()
    for leftover in (run_dir / "checkpoints").glob(".*.partial"):
        leftover.unlink()
    return handle


def host_copy(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """`checkpoint` with every tensor copied to host memory, where later updates of the
    originals leave it alone. Tensors that shared storage share it in the copy too (tied
    embedding and output weights are saved once, as torch.save saves the originals). A CUDA
    GPU's tensors are copied into pinned memory, all queued at once and waited for once, where
    a copy into pageable memory would wait for the device at every tensor."""
    copies: dict[tuple, torch.UntypedStorage] = {}

    def copy(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.layout != torch.strided:  # sparse: no storage to share
            return tensor.detach().to("cpu", copy=True)
        storage = tensor.untyped_storage()
        key = (storage.device, storage.data_ptr(), storage.nbytes())
        if key not in copies:
            copies[key] = host_storage(storage)
        view = torch.empty(0, dtype=tensor.dtype)
        return view.set_(copies[key], tensor.storage_offset(), tensor.size(), tensor.stride())

    copied = apply_to_collection(checkpoint, torch.Tensor, copy)
    for device in {key[0] for key in copies if key[0].type == "cuda"}:
        torch.cuda.current_stream(device).synchronize()
    return copied


def host_storage(storage: torch.UntypedStorage) -> torch.UntypedStorage:
    """A copy of `storage` in host memory. A CUDA GPU's goes to pinned memory, queued on the
    current stream, for the caller to wait for. torch keeps freed pinned blocks for reuse
    (their sizes rounded up to powers of two), so a run holds about one to two checkpoints'
    worth of page-locked memory after its first save, and later saves allocate none."""
    if storage.is_cuda:
        host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=True).untyped_storage()
        host.copy_(storage, non_blocking=True)
        return host
    if storage.device.type == "cpu":
        return storage.clone()
    return storage.cpu()


class DurableCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint IO with save_durably for local files (Lightning's own atomic save
    renames without an fsync) and load_safely for every load, resuming included.

    With `background` (the default), local files are written on a thread of their own while
    training goes on: the training thread copies the state to host memory (milliseconds, where
    serialising and fsyncing 130 MB takes a quarter of a second) and goes back to its steps.
    The writer runs the file operations in the order they were asked for (a save, last.ckpt
    linked to it, an older checkpoint removed), so each finds the files it expects; once one
    fails, those after it are dropped, so a failed save never lets the checkpoint it was to
    replace be removed. At most one copy waits in memory: a save first waits for the writes
    before it. wait() returns once every write is done, and raises the first that failed (a full
    disk: one line, the previous checkpoint intact); loads and the end of fitting (teardown)
    wait. Without `background` (a logger that uploads each checkpoint as soon as it is saved)
    every operation runs at once.

    `seconds`: the training thread's time in checkpoints (copying, waiting), their cost to the
    run; `write_seconds`: the writer's, spent beside it."""

    def __init__(self, background: bool = True) -> None:
        super().__init__()
        self.background = background
        self.seconds = 0.0
        self.write_seconds = 0.0
        self._writer: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []
        self._failed = False

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None
    ) -> None:
        started = time.perf_counter()
        self.wait()
        if storage_options is not None or "://" in str(path):
            super().save_checkpoint(checkpoint, path, storage_options)  # remote storage
        else:  # written later, so from a copy, unless written at once
            state = host_copy(checkpoint) if self.background else checkpoint
            self._later(save_durably, state, Path(path))
        self.seconds += time.perf_counter() - started

    def link(self, source: Path, path: Path) -> None:
        """link_durably(source, path), after the writes before it (source's own among them)."""
        self._later(link_durably, source, path)

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        self._later(super().remove_checkpoint, path)

    def load_checkpoint(
        self, path: str | os.PathLike, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        self.wait()
        if "://" in str(path):
            return super().load_checkpoint(path, weights_only=True)
        return load_safely(path, map_location or "cpu")

    def wait(self) -> None:
        """Return once every write asked for is done; raise the first that failed."""
        wait_all(self._pending)
        pending, self._pending, self._failed = self._pending, [], False
        for write in pending:
            write.result()

    def teardown(self) -> None:
        """Wait for the writes; a failed one is raised, or, while another exception is being
        handled (a run already failing or stopped by a signal), reported on stderr so as not
        to replace it."""
        failing = sys.exc_info()[1] is not None
        try:
            self.wait()
        except Exception as error:
            if not failing:
                raise
            print(f"warning: a checkpoint write failed: {error}", file=sys.stderr)
        finally:
            if self._writer is not None:
                self._writer.shutdown()
                self._writer = None

    def _later(self, operation: Callable, *args: Any) -> None:
        if not self.background:
            self._timed(operation, *args)
            return
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer")
        self._pending.append(self._writer.submit(self._unless_failed, operation, *args))

    def _unless_failed(self, operation: Callable, *args: Any) -> None:
        if self._failed:  # an earlier operation failed: this one might undo what it kept
            return
        try:
            self._timed(operation, *args)
        except BaseException:
            self._failed = True
            raise

    def _timed(self, operation: Callable, *args: Any) -> None:
        started = time.perf_counter()
        try:
            operation(*args)
        finally:
            self.write_seconds += time.perf_counter() - started


class RunCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint as a run directory needs it:

    - last.ckpt at every validation and at the end of training (Lightning rewrites it only at
      steps where it also saved a best checkpoint), so a killed run loses at most the steps
      since its last validation (or the one before, if killed while that one's checkpoint was
      being written) and a finished run's last.ckpt is its final state;
    - the best-checkpoint record survives a run directory that was moved or copied (Lightning
      drops it when the folder's path changed): the record's files are found by name in the
      folder the run has now;
    - a non-finite validation loss is never a best (Lightning keeps it, as inf, while fewer
      than save_top_k checkpoints exist: then sampling "the best" fails);
    - a validation that writes a best checkpoint makes last.ckpt a second name (a hard link) of
      that file instead of writing the same state twice.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._last_written_step = -1

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Lightning warns of a checkpoints/ folder that is not empty, which here is a resumed
        # run's own: train.py refuses a new run into a folder holding a run, and a sweep job
        # clears its earlier job's.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Checkpoint directory .* is not empty")
            super().setup(trainer, pl_module, stage)

    def check_monitor_top_k(self, trainer: L.Trainer, current: torch.Tensor | None = None) -> bool:
        if current is not None and not torch.isfinite(current):
            return False
        return super().check_monitor_top_k(trainer, current)

    def _save_last_checkpoint(self, trainer: L.Trainer, monitor_candidates: dict) -> None:
        if self.save_last and self._link_last_to_best(trainer, monitor_candidates):
            self._last_written_step = trainer.global_step
            return
        super()._save_last_checkpoint(trainer, monitor_candidates)
        self._last_written_step = trainer.global_step

    def _link_last_to_best(self, trainer: L.Trainer, monitor_candidates: dict) -> bool:
        """last.ckpt as a hard link to the best checkpoint written at this very step."""
        best = self._last_checkpoint_saved
        if self._last_global_step_saved != trainer.global_step or best == self.last_model_path:
            return False
        if not best or "://" in best:  # the same on every rank: only rank zero has the file
            return False
        last = self.format_checkpoint_name(monitor_candidates, self.CHECKPOINT_NAME_LAST)
        if trainer.is_global_zero:
            checkpoint_io = trainer.strategy.checkpoint_io
            if isinstance(checkpoint_io, DurableCheckpointIO):
                checkpoint_io.link(Path(best), Path(last))  # once best is written
            else:
                link_durably(Path(best), Path(last))
        self.last_model_path = last
        return True

    def _save_last_if_behind(self, trainer: L.Trainer) -> None:
        if trainer.sanity_checking or not self.save_last or trainer.global_step == 0:
            return
        if self._last_written_step != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        self._save_last_if_behind(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._save_last_if_behind(trainer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved_dir = state_dict.get("dirpath")
        if saved_dir is None or self.dirpath is None or saved_dir == self.dirpath:
            super().load_state_dict(state_dict)
            return

        def here(path: str) -> str:
            return str(Path(self.dirpath) / Path(path).name) if path else path

        moved = dict(state_dict, dirpath=self.dirpath)
        for key in ("best_model_path", "kth_best_model_path", "last_model_path"):
            moved[key] = here(state_dict.get(key, ""))
        moved["best_k_models"] = {
            here(path): score for path, score in state_dict.get("best_k_models", {}).items()
        }
        super().load_state_dict(moved)
