"""Cache entries: directories of prepared data, named by a hash of what they were built from and
written once, atomically, by one process while any others preparing the same entry (DDP ranks,
multirun jobs) wait and then reuse it; and the data-module base that builds, loads and batches
them. Every use checks an entry against the sizes and checksums recorded when it was written,
and a damaged one is rebuilt."""

import dataclasses
import errno
import fcntl
import hashlib
import json
import os
import shutil
import signal
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import DataLoader, Dataset

from data.files import disk_full_cause
from data.sampler import RankShard, ResumableLoader, ResumableShuffle, batches_per_epoch
from data.tokenizer import BPETokenizer, CharTokenizer, load_tokenizer
from errors import check_writable

# A complete entry holds this file; it is the last one a build writes (with write_marker).
MARKER = "meta.json"
# How long a process waits for another one's build before saying on stderr whom it waits for.
WAIT_NOTICE_SECONDS = 5.0


def entry_path(cache_dir: str | os.PathLike, kind: str, key: object) -> Path:
    """`cache_dir/kind/<hash>`, where `key` (JSON-serialisable) lists everything that changes
    the entry's contents, and nothing that doesn't, so runs that can share an entry do."""
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:12]
    return Path(cache_dir) / kind / digest


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def write_marker(out: Path, meta: dict) -> None:
    """Finish a build in `out`: write MARKER holding `meta` plus the size and SHA-256 of every
    other file there, which each later use of the entry checks."""
    files = sorted(p for p in out.iterdir() if p.is_file() and p.name != MARKER)
    record = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    (out / MARKER).write_text(json.dumps({**meta, "files": record}, indent=2))


def entry_problem(entry: Path) -> str | None:
    """What is wrong with `entry` (a sentence), or None when it is complete and every file has
    the size and checksum its MARKER recorded. Sizes catch truncated and missing files at the
    cost of a stat; the SHA-256 (6 ms for the embedded corpus's 8.6 MB on a 2-core CPU) catches
    the rest, such as blocks zeroed by a crash."""
    problem, meta = _size_problem(entry)
    if problem is not None:
        return problem
    for name, record in meta["files"].items():
        try:
            if _sha256(entry / name) != str(record["sha256"]):
                return f"{name} does not match the checksum written with it"
        except OSError as error:
            return f"{name} cannot be read ({error})"
    return None


def sized_meta(entry: Path) -> dict | None:
    """`entry`'s MARKER when every file it records has the size recorded, else None: what may be
    read of an entry before its checksums are, to refuse a use of it by its files' lengths,
    which no damage the checksums alone find can change. Never to accept it: only
    entry_problem's checksums do."""
    problem, meta = _size_problem(entry)
    return meta if problem is None else None


def _size_problem(entry: Path) -> tuple[str | None, dict]:
    """What is wrong with `entry` short of its checksums (a sentence), or None when its MARKER
    records the size and checksum of each file and every file has that size; and then the
    MARKER's contents (else {})."""
    if not entry.is_dir():
        return "it does not exist", {}
    try:
        meta = json.loads((entry / MARKER).read_text())
    except FileNotFoundError:
        return f"it has no {MARKER}: its build never finished", {}
    except (OSError, ValueError) as error:  # ValueError: not UTF-8, or not JSON
        return f"its {MARKER} cannot be read ({error})", {}
    try:
        recorded = {name: (int(f["bytes"]), str(f["sha256"])) for name, f in meta["files"].items()}
    except (KeyError, TypeError, ValueError, AttributeError):
        return f"its {MARKER} records no file sizes and checksums (an older version wrote it)", {}
    for name, (size, _) in recorded.items():
        try:
            actual = (entry / name).stat().st_size
        except FileNotFoundError:
            return f"{name} is missing", {}
        if actual != size:
            return f"{name} is {actual} bytes, not the {size} written", {}
    return None, meta


def _try_lock(fd: int) -> bool:
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except (BlockingIOError, PermissionError):  # EAGAIN or EACCES: another process holds it
        return False


@contextmanager
def _exclusive(lock_file: Path, entry: Path) -> Iterator[None]:
    """Hold an exclusive lock on `lock_file` while building `entry`; after waiting for it for
    WAIT_NOTICE_SECONDS, say once on stderr which process holds it.

    A POSIX record lock (lockf) belongs to this process: the OS drops it when the process dies,
    and processes forked meanwhile (`datasets.map`'s pool) do not inherit it. A flock would
    belong to the open file, which such children keep open when their parent is killed, so
    every later run would wait for them forever. Closing any descriptor of a file drops the
    process's lockf locks on it, so this function is the only place that opens the lock file.
    """
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        if not _try_lock(fd):
            deadline = time.monotonic() + WAIT_NOTICE_SECONDS
            while not _try_lock(fd):
                if time.monotonic() > deadline:
                    holder = os.pread(fd, 256, 0).decode(errors="replace") or "another process"
                    notice = f"waiting for {holder} to finish building the cache entry {entry}"
                    print(notice, file=sys.stderr)
                    fcntl.lockf(fd, fcntl.LOCK_EX)
                    break
                time.sleep(0.1)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"process {os.getpid()} on {socket.gethostname()}".encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # releases the lock


def _discard(path: Path) -> None:
    """Remove the directory `path`: first renamed out of the way, so no reader ever sees it half
    deleted, and a removal cut short leaves only a temporary directory."""
    trash = path.parent / f".tmp-{path.name}-{uuid.uuid4().hex}"
    os.rename(path, trash)
    shutil.rmtree(trash)


def _build_into_place(entry: Path, build: Callable[[Path], None]) -> None:
    # Build in a private directory and rename it into place: a crash leaves only an orphan
    # temp directory, and no reader ever sees half an entry. The rename also keeps entries
    # whole on file systems where the lock does not hold across machines.
    tmp = entry.parent / f".tmp-{entry.name}-{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        build(tmp)
        try:
            os.rename(tmp, entry)
        except OSError as error:
            if error.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            # Another process built it meanwhile, from beyond the lock's reach (another
            # machine): keep its entry if intact, else put this one in its place.
            if entry_problem(entry) is not None:
                _discard(entry)
                os.rename(tmp, entry)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build_once(entry: Path, build: Callable[[Path], None]) -> bool:
    """Make sure `entry` exists and is intact, calling `build(tmp_dir)` to fill it if needed;
    `build` must end with write_marker(). Returns True when the entry was already there (a
    cache hit), including when another process built it while this one waited for the lock.
    A damaged entry is rebuilt, saying so in one line on stderr; a full disk is a ValueError."""
    if entry_problem(entry) is None:
        return True
    move = "give a folder that can be written: TINYFORMER_CACHE=/other/dir (or paths.cache_dir=)"
    check_writable(entry, f"the data cache {entry.parent.parent}", move)
    entry.parent.mkdir(parents=True, exist_ok=True)
    try:
        with _exclusive(entry.parent / f".{entry.name}.lock", entry):
            problem = entry_problem(entry)
            if problem is None:
                return True
            # Holding the lock, this process is the only one building this entry: the
            # temporary directories of earlier builds belong to processes that died.
            for leftover in entry.parent.glob(f".tmp-{entry.name}-*"):
                shutil.rmtree(leftover, ignore_errors=True)
            if entry.exists():
                print(f"rebuilding the cache entry {entry}: {problem}", file=sys.stderr)
                _discard(entry)
            _build_into_place(entry, build)
    except Exception as error:
        disk_full = disk_full_cause(error)
        if disk_full is None:
            raise
        raise ValueError(
            f"the disk holding the data cache {entry.parent.parent} is full "
            f"({disk_full.strerror}); free some space there, or move the cache to another disk "
            "with TINYFORMER_CACHE=/other/dir (or paths.cache_dir=/other/dir)"
        ) from error
    return False


class CachedDataModule(L.LightningDataModule):
    """What both data modules share: prepare_data() builds a cache entry once, setup() loads
    the tokenizer and splits from it, and the loaders batch the splits' datasets.

    Subclasses set `config` (with batch_size and num_workers) and implement `cache_entry`,
    `_build(out_dir)` and `_load(entry)`, which returns the splits by name.
    """

    def __init__(self) -> None:
        super().__init__()
        self.cache_hit = False
        self._tokenizer: CharTokenizer | BPETokenizer | None = None
        self._splits: dict = {}
        self._resume_at: dict | None = None  # a checkpoint's position in the training data

    def keep_config(self, config) -> None:
        """Use the validated dataclass `config`, and save it as plain values (lists, not Hydra's
        ListConfig) so checkpoints load with torch.load(weights_only=True)."""
        self.config = config
        # In checkpoints only: the run's config, logged once by train.py, already holds them.
        self.save_hyperparameters(dataclasses.asdict(config), logger=False)

    @property
    def cache_entry(self) -> Path:
        raise NotImplementedError

    def _build(self, out: Path) -> None:
        raise NotImplementedError

    def _load(self, entry: Path) -> dict:
        raise NotImplementedError

    def train_dataset(self) -> Dataset:
        """The training examples, which train_dataloader batches."""
        raise NotImplementedError

    def check_batches(self, world_size: int) -> None:
        """The training examples fill a batch on each of `world_size` processes, by the training
        sampler's own test, once the data is set up: Lightning makes the training loader only
        after its sanity check has validated under a progress bar."""
        batches_per_epoch(len(self.train_dataset()), self.config.batch_size, world_size)

    def prepare_data(self) -> None:
        self.cache_hit = build_once(self.cache_entry, self._build)

    def setup(self, stage: str | None = None) -> None:
        if self._tokenizer is not None:
            return
        entry = self.cache_entry
        if not (entry / MARKER).exists():
            raise FileNotFoundError(f"no prepared data in {entry}; call prepare_data() first")
        self._splits = self._load(entry)
        self._tokenizer = load_tokenizer(entry / "tokenizer.json")

    def _split(self, name: str):
        if self._tokenizer is None:
            raise RuntimeError(
                f"{type(self).__name__} is not set up; call prepare_data() and setup() first"
            )
        return self._splits[name]

    @property
    def tokenizer(self) -> CharTokenizer | BPETokenizer:
        self._split("train")
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def state_dict(self) -> dict:
        """Where training stands in the data, saved in each checkpoint: the epoch, and how many
        of its batches were trained on. The step count alone misplaces a resumed run when
        batches accumulate (Lightning also steps on an epoch's last, partial group) or
        trainer.limit_train_batches shortens the epochs."""
        trainer = self.trainer
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return {}
        loop = trainer.fit_loop
        # The epoch those batches are of: the last one begun (none before training starts).
        # Not trainer.current_epoch, the epochs completed: after an epoch's loop ended (a stop
        # signal at its last step, a run's end) it counts that epoch too, while Lightning
        # resets the batch count only as the next epoch's batches begin.
        epoch = max(loop.epoch_progress.current.started - 1, 0)
        batch = loop.epoch_loop.batch_progress.current.processed
        if batch >= trainer.num_training_batches:  # saved as the epoch ended, or after
            epoch, batch = epoch + 1, 0
        return {"epoch": epoch, "batch": batch}

    def load_state_dict(self, state: dict) -> None:
        self._resume_at = state

    def _training_start(self) -> tuple[int, int]:
        """(epoch, batch of it) where the training loader starts: a fresh run at the beginning,
        a resumed one where its checkpoint says, and one from a checkpoint older than that
        record where its step says (exact without accumulation or shortened epochs)."""
        if self._resume_at is not None:  # once: a loader made again later starts afresh
            position, self._resume_at = self._resume_at, None
            return position["epoch"], position["batch"]
        trainer = self.trainer
        return 0, trainer.global_step * trainer.accumulate_grad_batches if trainer else 0

    def _loader(self, dataset: Dataset, train: bool, collate_fn=None) -> DataLoader:
        """Batches of `dataset`. Training batches follow ResumableShuffle, which a resumed run
        starts where its checkpoint left the data; evaluation batches follow RankShard's fixed
        order. In a distributed run each rank gets its own share (the trainer configs turn
        Lightning's own DistributedSampler off)."""
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer else (0, 1)
        workers, batch_size = self.config.num_workers, self.config.batch_size
        options = dict(
            collate_fn=collate_fn,
            num_workers=workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=workers > 0,
            worker_init_fn=leave_stop_signals_to_the_run,
            # Each loader draws its workers' seed as it starts iterating, from its generator
            # (by default torch's global one, which dropout draws from too). Persistent
            # workers start once a run, a resumed run's again: drawn from torch's generator,
            # that would shift the dropout of a resumed run off that of one never stopped.
            generator=torch.Generator().manual_seed(torch.initial_seed()),
        )
        if not train:
            sampler = RankShard(len(dataset), rank, world)
            return DataLoader(dataset, batch_size, sampler=sampler, **options)
        epoch, batch = self._training_start()
        # The run's seed (seed_everything sets torch's initial seed), so each seed has its order.
        sampler = ResumableShuffle(
            len(dataset), batch_size, torch.initial_seed(), batch, rank, world, start_epoch=epoch
        )
        # drop_last: a short last batch would be an oddly weighted training step
        return ResumableLoader(dataset, batch_size, sampler=sampler, drop_last=True, **options)


def leave_stop_signals_to_the_run(worker_id: int) -> None:
    """A DataLoader worker ignores SIGTERM and SIGINT: they reach it beside the run (SLURM's
    scancel signals every process of the job, a terminal's Ctrl-C its whole foreground group),
    and a worker they killed would fail the run before it stopped and saved. The run stops at
    its next step and ends its workers; torch's watchdog ends a worker whose run is gone."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
