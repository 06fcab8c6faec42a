"""Sequence-to-sequence data for the encoder-decoder: (source, target) text pairs, either built
from the Shakespeare corpus (`denoise`: restore a corrupted passage; `next_line`: continue a
speech) or read from any dataset with two text columns (`pairs`), tokenized once into a cache
and served as padded batches with padding masks. The Lightning DataModule; the plain pieces it
is built from are data/seq2seq_text.py's."""

from functools import cached_property, partial
from pathlib import Path

import numpy as np
from torch.utils.data import DataLoader

from data.cache import CachedDataModule, entry_path, write_marker
from data.local_files import expand_paths, file_fingerprint
from data.metrics import character_error_rate
from data.pairs import FILE_FORMATS, MASK, Ragged
from data.sampler import evaluation_order
from data.seq2seq_text import (
    TASK_BUILDERS,
    PairDataset,
    Seq2SeqDataConfig,
    Split,
    collate_pairs,
    drop_empty_sources,
    encode_pairs,
)
from data.sources import shakespeare_version
from data.tokenizer import CharTokenizer, token_dtype
from errors import config_from, is_int

# Bump whenever the cache entry's contents change meaning (passages, corruption, file layout).
# 2: a CSV file's cells are read as text.
FORMAT_VERSION = 2
SPECIALS = ("<pad>", "<bos>", "<eos>", "<mask>")


def tokenize(splits: dict[str, Split]) -> tuple[CharTokenizer, dict[str, Split], int]:
    """A char tokenizer (with SPECIALS) fit on the train split only, and every split as token
    ids. Characters seen only in validation have no id: they are dropped, and counted."""
    train = np.concatenate([texts.flat for texts in splits["train"]])
    chars = np.unique(train[train != MASK])
    tokenizer = CharTokenizer([chr(c) for c in chars], SPECIALS)
    encoded, dropped = {}, 0
    for split, pair in splits.items():
        encoded[split], count = encode_pairs(tokenizer, pair)
        dropped += count
    return tokenizer, encoded, dropped


class Seq2SeqDataModule(CachedDataModule):
    """(source, target) pairs for the encoder-decoder; Seq2SeqDataConfig documents the options."""

    def __init__(self, **options) -> None:
        super().__init__()
        self.keep_config(
            config_from(Seq2SeqDataConfig, options, "data.", "an encoder-decoder's data")
        )

    @cached_property
    def _cache_key(self) -> dict:
        """Everything that changes the prepared pairs; batching and val_subset don't. Taken once,
        so files edited between prepare_data and setup cannot point them at different entries."""
        c = self.config
        key: dict = {"version": FORMAT_VERSION, "task": c.task, "val_fraction": c.val_fraction}
        key["max_len"] = [c.max_source_len, c.max_target_len]
        if c.task != "pairs":
            key["plays"] = shakespeare_version()
        if c.task == "denoise":
            key |= {"corruption": c.corruption, "noise_rate": c.noise_rate, "seed": c.seed}
            if c.corruption == "span":
                key["mean_span"] = c.mean_span
        elif c.task == "pairs":
            key |= {"seed": c.seed, "columns": [c.source_column, c.target_column]}
            key |= {"hub": [c.hub_name, c.hub_config]}
            # Each file's size, times and inode, so an edited file gets a fresh entry.
            if c.paths:
                key["files"] = file_fingerprint(expand_paths(c.paths, list(FILE_FORMATS)))
        return key

    @property
    def cache_entry(self) -> Path:
        return entry_path(self.config.cache_dir, "seq2seq", self._cache_key)

    def _build(self, out: Path) -> None:
        texts, facts = TASK_BUILDERS[self.config.task](self.config)
        tokenizer, splits, val_chars_dropped = tokenize(texts)
        dtype = token_dtype(tokenizer)
        meta = {"key": self._cache_key, "dtype": np.dtype(dtype).name, **facts}
        meta |= {"vocab_size": tokenizer.vocab_size, "val_chars_dropped": val_chars_dropped}
        for split, pair in splits.items():
            pair, meta[f"{split}_empty_sources_dropped"] = drop_empty_sources(pair)
            meta[f"{split}_pairs"] = len(pair[0])
            for side, seqs in zip(("source", "target"), pair, strict=True):
                np.save(out / f"{split}_{side}_ids.npy", seqs.flat.astype(dtype))
                np.save(out / f"{split}_{side}_offsets.npy", seqs.offsets)
        tokenizer.save(out / "tokenizer.json")
        write_marker(out, meta)

    def _load(self, entry: Path) -> dict[str, Split]:
        splits = {
            split: tuple(
                Ragged(
                    np.load(entry / f"{split}_{side}_ids.npy", mmap_mode="r"),
                    np.load(entry / f"{split}_{side}_offsets.npy"),
                )
                for side in ("source", "target")
            )
            for split in ("train", "val")
        }
        n_train, batch = len(splits["train"][0]), self.config.batch_size
        if n_train < batch:
            raise ValueError(
                f"data.batch_size={batch} is more than the {n_train} training pairs; "
                "lower data.batch_size"
            )
        return splits

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_id

    @property
    def bos_id(self) -> int:
        return self.tokenizer.bos_id

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_id

    def _pair_loader(self, pairs: PairDataset, train: bool) -> DataLoader:
        collate = partial(collate_pairs, pad_id=self.pad_id, bos_id=self.bos_id, eos_id=self.eos_id)
        return self._loader(pairs, train, collate)

    def train_dataset(self) -> PairDataset:
        return PairDataset(*self._split("train"))

    def train_dataloader(self) -> DataLoader:
        return self._pair_loader(self.train_dataset(), train=True)

    def val_dataloader(self) -> DataLoader:
        return self._pair_loader(PairDataset(*self._split("val")), train=False)

    def val_pairs(self, n: int) -> list[tuple[list[int], list[int]]]:
        """The first n (or all, if fewer) validation pairs in evaluation's fixed order (the
        validation loader's), as (source ids, target ids): a fixed sample of the whole split for
        attention maps and exact-match decoding. Sources are what the encoder reads (<mask>
        tokens included); targets carry no <bos>/<eos>."""
        if not is_int(n, 1):
            raise ValueError(f"val_pairs needs a positive number of pairs, got {n!r}")
        sources, targets = self._split("val")
        return [
            (sources[i].tolist(), targets[i].tolist()) for i in evaluation_order(len(sources))[:n]
        ]

    def val_texts(self, n: int) -> list[tuple[str, str]]:
        """`val_pairs(n)` decoded; sources show <mask> tokens by name."""
        decode = self.tokenizer.decode
        return [(decode(s, skip_special=False), decode(t)) for s, t in self.val_pairs(n)]

    def copy_baseline(self) -> dict[str, float]:
        """Exact match and character error rate, over the first val_subset validation pairs, of
        predicting the source itself (minus <mask> tokens): the trivial score to beat."""
        pairs = self.val_pairs(self.config.val_subset)
        specials = self.tokenizer.special_ids
        predictions = [[i for i in source if i not in specials] for source, _ in pairs]
        references = [target for _, target in pairs]
        exact = sum(p == r for p, r in zip(predictions, references, strict=True)) / len(pairs)
        return {"exact_match": exact, "cer": character_error_rate(predictions, references)}
