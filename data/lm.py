"""Next-token language-modelling data: a corpus (the embedded Shakespeare, local text files or a
Hub dataset) split into train/val, tokenized once into a cache of flat token arrays, and served
as (x, y) blocks with y one token ahead of x."""

import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property, partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from data.cache import CachedDataModule, entry_path, write_marker
from data.sources import (
    TEXT_BUILDERS,
    expand_paths,
    file_fingerprint,
    is_val_document,
    load_hub_text,
    load_shakespeare,
    load_text_files,
    split_tail,
)
from data.tokenizer import BPETokenizer, CharTokenizer, load_tokenizer
from errors import check, check_int, is_number

if TYPE_CHECKING:  # `datasets` (0.6 s to import) loads only when a cache entry is built
    import datasets

# Bump whenever the cache entry's contents change meaning (normalisation, split, file layout).
FORMAT_VERSION = 2
SOURCES = ("shakespeare", "text_files", "hub")
TOKENIZERS = ("char", "bpe")
BPE_SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
DOCUMENT_SEPARATOR = "\n\n"  # between documents in the token stream, as between paragraphs
BATCH_ROWS = 1000  # documents per `datasets.map` batch


@dataclass
class LMDataConfig:
    source: str = "shakespeare"  # shakespeare | text_files | hub
    paths: list[str] = field(default_factory=list)  # text_files: files, globs or folders
    # text_files: the validation text, as files, globs or folders (then paths is all training
    # text and val_fraction is not used)
    val_paths: list[str] = field(default_factory=list)
    text_column: str = "text"  # .jsonl files and Hub datasets: the column holding the text
    name: str | None = None  # hub: the dataset's name
    config: str | None = None  # hub: its configuration, if it has several
    streaming: bool = False  # read the source as a stream: corpora larger than memory
    tokenizer: str = "char"
    bpe_vocab_size: int = 1024  # tokenizer=bpe: the vocabulary it learns
    tokenizer_file: str | None = None  # reuse this saved tokenizer instead of training one
    block_size: int = 128
    batch_size: int = 32
    val_fraction: float = 0.1
    cache_dir: str = ".cache/tinyformer"
    num_workers: int = 0
    num_proc: int = 1  # processes tokenizing the corpus (`datasets.map`), when not streaming

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"data.source must be one of {list(SOURCES)}, got {self.source!r}")
        if self.tokenizer not in TOKENIZERS:
            known = list(TOKENIZERS)
            raise ValueError(f"data.tokenizer must be one of {known}, got {self.tokenizer!r}")
        check_int("data.block_size", self.block_size)
        check_int("data.bpe_vocab_size", self.bpe_vocab_size)
        check_int("data.batch_size", self.batch_size)
        check_int("data.num_workers", self.num_workers, minimum=0)
        check_int("data.num_proc", self.num_proc)
        v = self.val_fraction
        check(is_number(v) and 0 < v < 1, "data.val_fraction", "a number between 0 and 1", v)
        if not self.cache_dir:
            raise ValueError(f"data.cache_dir must be a directory path, got {self.cache_dir!r}")
        if not isinstance(self.streaming, bool):
            raise ValueError(f"data.streaming must be true or false, got {self.streaming!r}")
        if not (isinstance(self.text_column, str) and self.text_column):
            raise ValueError(f"data.text_column must be a column name, got {self.text_column!r}")
        # Hydra hands lists over as ListConfig, and a single path from the shell as a string.
        self.paths = [self.paths] if isinstance(self.paths, str) else list(self.paths or ())
        self.val_paths = [self.val_paths] if isinstance(self.val_paths, str) else self.val_paths
        self.val_paths = list(self.val_paths or ())
        if self.val_paths and self.source != "text_files":
            raise ValueError(
                f"data.val_paths is only read by source=text_files, got source={self.source}; "
                "e.g. data=text_files 'data.paths=[train.txt]' 'data.val_paths=[valid.txt]'"
            )
        # Each source's own key: required by that source, and meaningless to the others.
        for source, key, example in (
            ("text_files", "paths", "data=text_files 'data.paths=[corpus/*.txt]'"),
            ("hub", "name", "data=hub data.name=NAME"),
        ):
            value = getattr(self, key)
            if self.source == source and not value:
                problem = f"source={source} needs data.{key}"
            elif self.source != source and value:
                problem = f"data.{key} is only read by source={source}"
            else:
                continue
            raise ValueError(
                f"{problem}, got source={self.source} and {key}={value!r}; e.g. {example}"
            )
        if self.config is not None and self.source != "hub":
            raise ValueError(f"data.config is only read by source=hub, got {self.config!r}")
        # A missing file is a config mistake: it fails here, before the trainer starts.
        if self.paths:
            expand_paths(self.paths, list(TEXT_BUILDERS))
        if self.val_paths:
            expand_paths(self.val_paths, list(TEXT_BUILDERS), "data.val_paths")
        if self.tokenizer_file is not None and not Path(self.tokenizer_file).is_file():
            raise FileNotFoundError(
                f"data.tokenizer_file: no tokenizer at {self.tokenizer_file}; point it at the "
                "tokenizer.json of an earlier run (its run directory holds one)"
            )


# --- Building the cache entry --------------------------------------------------------------------


def _split_rows(batch: dict, indices: list[int], val_fraction: float, by_tail: bool) -> dict:
    """Each document's train and val parts: its tail (`by_tail`), or all of it for one document
    in every 1/val_fraction."""
    if by_tail:
        parts = [split_tail(text, val_fraction) for text in batch["text"]]
    else:
        texts = (text.strip("\n") for text in batch["text"])  # separators come between them
        parts = [
            ("", text) if is_val_document(i, val_fraction) else (text, "")
            for text, i in zip(texts, indices, strict=True)
        ]
    return {"train": [t for t, _ in parts], "val": [v for _, v in parts]}


def _whole_rows(batch: dict, split: str) -> dict:
    """Each document whole in `split` ("train" or "val"), nothing in the other."""
    texts = [text.strip("\n") for text in batch["text"]]  # separators come between documents
    empty = [""] * len(texts)
    return {"train": texts, "val": empty} if split == "train" else {"train": empty, "val": texts}


def _encode_rows(batch: dict, tokenizer: CharTokenizer | BPETokenizer) -> dict:
    """Token ids of each document's train and val parts. Characters the char tokenizer never saw
    in training have no id: they are dropped from val, and counted."""
    out = {"train_ids": tokenizer.encode_batch(batch["train"])}
    val = batch["val"]
    if isinstance(tokenizer, CharTokenizer):
        kept = [tokenizer.known(text) for text in val]
        out["val_dropped"] = [len(a) - len(b) for a, b in zip(val, kept, strict=True)]
        val = kept
    else:
        out["val_dropped"] = [0] * len(val)
    out["val_ids"] = tokenizer.encode_batch(val)
    return out


def _encoded_features() -> "datasets.Features":
    """_encode_rows' columns, declared: a batch whose val (or train) parts are all empty, as
    with data.val_paths, would otherwise type them as lists of nothing."""
    import datasets

    ids = datasets.Sequence(datasets.Value("int64"))
    return datasets.Features(
        {"train_ids": ids, "val_ids": ids, "val_dropped": datasets.Value("int64")}
    )


def _texts(corpus, column: str):
    """The non-empty strings of `column`, streamed batch by batch."""
    for batch in corpus.iter(batch_size=BATCH_ROWS):
        yield from (text for text in batch[column] if text)


class TokenWriter:
    """Appends documents' token ids to a flat token file, a separator between documents."""

    def __init__(self, path: Path, separator: list[int], dtype: type) -> None:
        self.file = open(path, "wb")
        self.separator, self.dtype, self.count = separator, dtype, 0

    def append(self, ids: list[int]) -> None:
        if ids:
            chunk = np.asarray((self.separator if self.count else []) + ids, dtype=self.dtype)
            self.file.write(chunk.tobytes())
            self.count += len(chunk)

    def __enter__(self) -> "TokenWriter":
        return self

    def __exit__(self, *exc_info) -> None:
        self.file.close()


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
    """Token blocks for the GPT; LMDataConfig documents the options."""

    def __init__(self, **options) -> None:
        super().__init__()
        self.keep_config(LMDataConfig(**options))
        self._given_tokenizer = None
        if self.config.tokenizer_file is not None:
            self.use_tokenizer(load_tokenizer(self.config.tokenizer_file))

    def use_tokenizer(self, tokenizer: CharTokenizer | BPETokenizer) -> None:
        """Encode the corpus with `tokenizer` (a resumed run's, or data.tokenizer_file's) rather
        than training one, so token ids keep their meaning."""
        self._given_tokenizer = tokenizer
        self.__dict__.pop("cache_entry", None)

    def _source_key(self) -> object:
        c = self.config
        if c.source == "text_files":
            files = expand_paths(c.paths, list(TEXT_BUILDERS))
            key = {"files": file_fingerprint(files), "text_column": c.text_column}
            if c.val_paths:
                val_files = expand_paths(c.val_paths, list(TEXT_BUILDERS), "data.val_paths")
                both = sorted(set(files) & set(val_files))
                if both:
                    raise ValueError(
                        f"data.val_paths: {both[0]} is also in data.paths, so the model would "
                        "train on its validation text; keep the validation files out of "
                        "data.paths"
                    )
                key["val_files"] = file_fingerprint(val_files)
            return key
        if c.source == "hub":
            return {"hub": [c.name, c.config], "text_column": c.text_column}
        return c.source

    def _tokenizer_key(self) -> object:
        c = self.config
        if self._given_tokenizer is not None:
            saved = json.dumps(self._given_tokenizer.to_dict(), sort_keys=True)
            return {"given": hashlib.sha256(saved.encode()).hexdigest()}
        return [c.tokenizer, c.bpe_vocab_size] if c.tokenizer == "bpe" else c.tokenizer

    @cached_property
    def cache_entry(self) -> Path:
        """Directory holding the tokenized corpus, keyed by (source, split, tokenizer): block and
        batch size, streaming and num_proc don't change it. Fixed at first use, so files edited
        between prepare_data and setup cannot point them at different entries."""
        c = self.config
        key = {"version": FORMAT_VERSION, "source": self._source_key()}
        split = "val_paths" if c.val_paths else c.val_fraction  # val_fraction is not used then
        key |= {"val_fraction": split, "tokenizer": self._tokenizer_key()}
        return entry_path(c.cache_dir, "lm", key)

    def _corpus(self) -> "datasets.Dataset | datasets.IterableDataset":
        """The source as one row per document, with its "train" and "val" parts."""
        c, cache_dir = self.config, Path(self.config.cache_dir)
        if c.source == "shakespeare":
            docs = load_shakespeare(cache_dir).select_columns(["text"])
            if c.streaming:
                docs = docs.to_iterable_dataset()
        elif c.source == "text_files":
            files = expand_paths(c.paths, list(TEXT_BUILDERS))
            docs = load_text_files(files, c.text_column, cache_dir, c.streaming)
            if c.val_paths:
                return self._given_split(docs)
        else:
            docs = load_hub_text(c.name, c.config, c.text_column, cache_dir, c.streaming)
        # A play's tail keeps val in the same style as train; a corpus of many documents gives
        # whole documents to val, which a stream can decide one document at a time.
        split = partial(_split_rows, val_fraction=c.val_fraction, by_tail=c.source == "shakespeare")
        return self._map(docs, split, "split", with_indices=True, remove_columns=["text"])

    def _given_split(self, train_docs):
        """The documents of data.paths as training text and those of data.val_paths as
        validation text, whole."""
        import datasets

        c = self.config
        files = expand_paths(c.val_paths, list(TEXT_BUILDERS), "data.val_paths")
        val_docs = load_text_files(
            files, c.text_column, Path(c.cache_dir), c.streaming, "data.val_paths"
        )
        parts = [
            self._map(
                docs, partial(_whole_rows, split=split), f"split-{split}", remove_columns=["text"]
            )
            for split, docs in (("train", train_docs), ("val", val_docs))
        ]
        return datasets.concatenate_datasets(parts)

    def _map(self, ds, function, step: str, **kwargs):
        """`ds.map(function, batched=True)`, over num_proc processes when ds is in memory or on
        disk. Its `datasets` cache is named after this entry, so a rerun of a build that died
        halfway picks up the finished steps."""
        import datasets

        if isinstance(ds, datasets.Dataset):
            # num_proc=1 would still start a pool (one worker and a manager process): None maps
            # in this process.
            parallel = self.config.num_proc > 1 and len(ds) > 1
            kwargs["num_proc"] = self.config.num_proc if parallel else None
            kwargs["new_fingerprint"] = f"{self.cache_entry.name}-{step}"
        return ds.map(function, batched=True, batch_size=BATCH_ROWS, **kwargs)

    def _train_tokenizer(self, corpus) -> CharTokenizer | BPETokenizer:
        """A tokenizer fit on the training parts only, read as a stream."""
        c = self.config
        if c.tokenizer == "bpe":
            paragraphs = (p for text in _texts(corpus, "train") for p in text.split("\n\n"))
            return BPETokenizer.train(paragraphs, c.bpe_vocab_size, BPE_SPECIALS)
        chars = set(DOCUMENT_SEPARATOR)
        for text in _texts(corpus, "train"):
            chars.update(text)
        return CharTokenizer(sorted(chars))

    def _build(self, out: Path) -> None:
        c = self.config
        corpus = self._corpus()
        tokenizer = self._given_tokenizer or self._train_tokenizer(corpus)
        encode = partial(_encode_rows, tokenizer=tokenizer)
        encoded = self._map(
            corpus, encode, "encode", remove_columns=["train", "val"], features=_encoded_features()
        )
        dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
        separator = tokenizer.encode(DOCUMENT_SEPARATOR)
        dropped = 0
        with (
            TokenWriter(out / "train.bin", separator, dtype) as train,
            TokenWriter(out / "val.bin", separator, dtype) as val,
        ):
            for batch in encoded.iter(batch_size=BATCH_ROWS):  # one pass, also when streaming
                for ids in batch["train_ids"]:
                    train.append(ids)
                for ids in batch["val_ids"]:
                    val.append(ids)
                dropped += sum(batch["val_dropped"])
        counts = {"train": train.count, "val": val.count}
        for split, count in counts.items():
            if count == 0 and c.val_paths:
                key = "data.val_paths" if split == "val" else "data.paths"
                raise ValueError(
                    f"the {split} split is empty: {key} holds no text this tokenizer keeps (a "
                    "character tokenizer drops validation characters the training text lacks); "
                    f"check the files of {key}"
                )
            if count == 0:
                raise ValueError(
                    f"the {split} split of data.source={c.source} is empty: too few documents "
                    f"for data.val_fraction={c.val_fraction}; add text or change val_fraction"
                )
        val_tokens = np.memmap(out / "val.bin", dtype=dtype, mode="r")
        tokenizer.save(out / "tokenizer.json")
        meta = {
            "key": json.loads(json.dumps(self._source_key())),
            "format_version": FORMAT_VERSION,
            "tokenizer": c.tokenizer if self._given_tokenizer is None else "given",
            "val_fraction": c.val_fraction,
            "dtype": np.dtype(dtype).name,
            "vocab_size": tokenizer.vocab_size,
            "train_tokens": counts["train"],
            "val_tokens": counts["val"],
            "val_chars": int(np.asarray(tokenizer.token_char_counts())[val_tokens].sum()),
            "val_chars_dropped": dropped,
        }
        write_marker(out, meta)

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
