"""Next-token language-modelling data: a corpus split into train/val, tokenized once into a
cache of flat token arrays, and served as (x, y) blocks with y one token ahead of x."""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from data.cache import CachedDataModule, entry_path
from data.sources import load_shakespeare, train_val_split
from data.tokenizer import BPETokenizer, CharTokenizer

# Bump whenever the cache entry's contents change meaning (normalisation, split, file layout).
FORMAT_VERSION = 1
SOURCES = {"shakespeare": load_shakespeare}
TOKENIZER_BUILDERS = {
    "char": lambda text, config: CharTokenizer.from_text(text),
    "bpe": lambda text, config: BPETokenizer.train(text, config.bpe_vocab_size),
}


def _check_int(key: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive" if minimum == 1 else "a non-negative"
        raise ValueError(f"data.{key} must be {kind} integer, got {value!r}")


@dataclass
class LMDataConfig:
    source: str = "shakespeare"
    tokenizer: str = "char"
    bpe_vocab_size: int = 1024  # tokenizer=bpe: the vocabulary it learns
    block_size: int = 128
    batch_size: int = 32
    val_fraction: float = 0.1
    cache_dir: str = ".cache/tinyformer"
    num_workers: int = 0

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"data.source must be one of {sorted(SOURCES)}, got {self.source!r}")
        if self.tokenizer not in TOKENIZER_BUILDERS:
            known = sorted(TOKENIZER_BUILDERS)
            raise ValueError(f"data.tokenizer must be one of {known}, got {self.tokenizer!r}")
        _check_int("block_size", self.block_size, minimum=1)
        _check_int("bpe_vocab_size", self.bpe_vocab_size, minimum=1)
        _check_int("batch_size", self.batch_size, minimum=1)
        _check_int("num_workers", self.num_workers, minimum=0)
        v = self.val_fraction
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v < 1:
            raise ValueError(f"data.val_fraction must be a number between 0 and 1, got {v!r}")
        if not self.cache_dir:
            raise ValueError(f"data.cache_dir must be a directory path, got {self.cache_dir!r}")


class TokenBlocks(Dataset):
    """(x, y) pairs of `block_size` tokens, y shifted one token ahead, one every `stride` tokens."""

    def __init__(self, tokens: np.ndarray, block_size: int, stride: int):
        self.tokens, self.block_size, self.stride = tokens, block_size, stride

    def __len__(self) -> int:
        return (len(self.tokens) - self.block_size - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.stride
        chunk = torch.from_numpy(self.tokens[start : start + self.block_size + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


class LMDataModule(CachedDataModule):
    def __init__(
        self,
        source: str = "shakespeare",
        tokenizer: str = "char",
        bpe_vocab_size: int = 1024,
        block_size: int = 128,
        batch_size: int = 32,
        val_fraction: float = 0.1,
        cache_dir: str = ".cache/tinyformer",
        num_workers: int = 0,
    ):
        super().__init__()
        self.config = LMDataConfig(
            source,
            tokenizer,
            bpe_vocab_size,
            block_size,
            batch_size,
            val_fraction,
            cache_dir,
            num_workers,
        )
        self.save_hyperparameters()

    @property
    def cache_entry(self) -> Path:
        """Directory holding the tokenized corpus; block and batch size don't affect it."""
        c = self.config
        key = [c.source, c.tokenizer, c.val_fraction, FORMAT_VERSION]
        if c.tokenizer == "bpe":
            key.append(c.bpe_vocab_size)
        return entry_path(c.cache_dir, "lm", key)

    def _build(self, out: Path) -> None:
        c = self.config
        texts = SOURCES[c.source](Path(c.cache_dir))["text"]
        train_text, val_text = train_val_split(texts, c.val_fraction)
        tokenizer = TOKENIZER_BUILDERS[c.tokenizer](train_text, c)  # never fit on validation
        # Characters seen only in validation have no char id; drop them rather than fail the
        # build. (Byte-level BPE encodes every character.)
        unseen = set(val_text) - set(tokenizer.chars) if c.tokenizer == "char" else set()
        kept_val = val_text.translate({ord(ch): None for ch in unseen})
        dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
        train = np.array(tokenizer.encode(train_text), dtype=dtype)
        val = np.array(tokenizer.encode(kept_val), dtype=dtype)
        train.tofile(out / "train.bin")
        val.tofile(out / "val.bin")
        tokenizer.save(out / "tokenizer.json")
        meta = {
            "format_version": FORMAT_VERSION,
            "source": c.source,
            "tokenizer": c.tokenizer,
            "val_fraction": c.val_fraction,
            "dtype": np.dtype(dtype).name,
            "vocab_size": tokenizer.vocab_size,
            "train_tokens": len(train),
            "val_tokens": len(val),
            "val_chars_dropped": len(val_text) - len(kept_val),
        }
        (out / "meta.json").write_text(json.dumps(meta, indent=2))

    def _load(self, entry: Path) -> dict[str, np.ndarray]:
        meta = json.loads((entry / "meta.json").read_text())
        block, splits = self.config.block_size, {}
        for split in ("train", "val"):
            tokens = np.memmap(entry / f"{split}.bin", dtype=meta["dtype"], mode="r")
            if len(tokens) < block + 1:
                raise ValueError(
                    f"data.block_size={block} needs at least {block + 1} tokens but the {split} "
                    f"split has {len(tokens)}; lower data.block_size"
                )
            splits[split] = tokens
        return splits

    def train_dataloader(self) -> DataLoader:
        # Every offset starts a training block; overlapping blocks are distinct examples.
        blocks = TokenBlocks(self._split("train"), self.config.block_size, stride=1)
        return self._loader(blocks, train=True)

    def val_dataloader(self) -> DataLoader:
        # Non-overlapping blocks score each validation token once per epoch.
        block = self.config.block_size
        return self._loader(TokenBlocks(self._split("val"), block, stride=block), train=False)

    def val_sample(self, length: int) -> torch.Tensor:
        """The first `length` validation tokens: fixed, and starting at a speaker's name."""
        val = self._split("val")
        if not 0 < length <= len(val):
            raise ValueError(f"val_sample length must be in [1, {len(val)}], got {length}")
        return torch.from_numpy(val[:length].astype(np.int64))

    def unigram_loss(self) -> float:
        """Validation cross-entropy (nats/token) of add-one-smoothed train token frequencies: the
        loss a model that ignores context gets, so a trained model must beat it."""
        counts = np.bincount(self._split("train"), minlength=self.vocab_size) + 1.0
        log_probs = np.log(counts / counts.sum())
        val = self._split("val")
        return float(-(np.bincount(val, minlength=self.vocab_size) * log_probs).sum() / len(val))
