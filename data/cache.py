"""Cache entries: directories of prepared data, named by a hash of what they were built from and
written once, atomically, by one process while any others preparing the same entry (DDP ranks,
multirun jobs) wait and then reuse it; and the data-module base that builds, loads and batches
them."""

import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from data.sampler import RankShard, ResumableLoader, ResumableShuffle
from data.tokenizer import CharTokenizer, load_tokenizer

# A complete entry holds this file; it is the last one a build writes.
MARKER = "meta.json"


def entry_path(cache_dir: str | os.PathLike, kind: str, key: object) -> Path:
    """`cache_dir/kind/<hash>`, where `key` (JSON-serialisable) lists everything that changes
    the entry's contents, and nothing that doesn't, so runs that can share an entry do."""
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:12]
    return Path(cache_dir) / kind / digest


@contextmanager
def _exclusive(lock_file: Path) -> Iterator[None]:
    """Hold an exclusive lock on `lock_file` (the OS drops it if this process dies)."""
    with open(lock_file, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_once(entry: Path, build: Callable[[Path], None]) -> bool:
    """Make sure `entry` exists, calling `build(tmp_dir)` to fill it if needed; `build` must
    write MARKER. Returns True when the entry was already there (a cache hit), including when
    another process built it while this one waited for the lock."""
    if (entry / MARKER).exists():
        return True
    entry.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(entry.parent / f".{entry.name}.lock"):
        if (entry / MARKER).exists():
            return True
        # Build in a private directory and rename it into place: a crash leaves only an orphan
        # temp directory, and no reader ever sees half an entry. The rename also keeps entries
        # whole on file systems where the lock does not hold across machines.
        tmp = entry.parent / f".tmp-{entry.name}-{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            build(tmp)
            try:
                os.rename(tmp, entry)
            except OSError:
                if not (entry / MARKER).exists():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
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
        self._tokenizer: CharTokenizer | None = None
        self._splits: dict = {}

    def keep_config(self, config) -> None:
        """Use the validated dataclass `config`, and save it as plain values (lists, not Hydra's
        ListConfig) so checkpoints load with torch.load(weights_only=True)."""
        self.config = config
        self.save_hyperparameters(dataclasses.asdict(config))

    @property
    def cache_entry(self) -> Path:
        raise NotImplementedError

    def _build(self, out: Path) -> None:
        raise NotImplementedError

    def _load(self, entry: Path) -> dict:
        raise NotImplementedError

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
    def tokenizer(self) -> CharTokenizer:
        self._split("train")
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def _loader(self, dataset: Dataset, train: bool, collate_fn=None) -> DataLoader:
        """Batches of `dataset`. Training batches follow ResumableShuffle, which a resumed run
        starts at its step; evaluation batches are in order. In a distributed run each rank gets
        its own share (the trainer configs turn Lightning's own DistributedSampler off)."""
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer else (0, 1)
        workers, batch_size = self.config.num_workers, self.config.batch_size
        options = dict(
            collate_fn=collate_fn,
            num_workers=workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=workers > 0,
        )
        if not train:
            sampler = RankShard(len(dataset), rank, world)
            return DataLoader(dataset, batch_size, sampler=sampler, **options)
        steps_done = trainer.global_step * trainer.accumulate_grad_batches if trainer else 0
        # The run's seed (seed_everything sets torch's initial seed), so each seed has its order.
        sampler = ResumableShuffle(
            len(dataset), batch_size, torch.initial_seed(), steps_done, rank, world
        )
        # drop_last: a short last batch would be an oddly weighted training step
        return ResumableLoader(dataset, batch_size, sampler=sampler, drop_last=True, **options)
