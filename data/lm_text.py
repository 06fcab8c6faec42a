"""What a language model reads, in plain Python (no Lightning, so evaluate.py loads without it):
the data options, the documents that evaluate.py scores, held-out documents as one token stream
and the (x, y) blocks cut from a stream. data/lm.py builds the training streams and caches them.
"""

import io
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np
import torch
from torch.utils.data import Dataset

from data.local_files import (
    TEXT_BUILDERS,
    check_file_columns,
    expand_paths,
    load_text_files,
    path_list,
)
from data.sources import (
    hub_text,
    hub_title,
    hub_val_split,
    load_hub,
    load_shakespeare,
    splits_by_tail,
    tail_split,
    whole_split,
)
from data.tokenizer import BPETokenizer, CharTokenizer, check_bpe_vocab_size, token_dtype
from errors import check, check_field_types, check_int

if TYPE_CHECKING:  # `datasets` (0.6 s to import) loads only when text is read
    import datasets

SOURCES = ("shakespeare", "text_files", "hub")
TOKENIZERS = ("char", "bpe")
# The options that pick, train or load a tokenizer: a trained model's own tokenizer overrules them
TOKENIZER_OPTIONS = ("data.tokenizer_file", "data.tokenizer", "data.bpe_vocab_size")
SPLITS = ("validation", "test")  # what evaluate.py's data.split may ask for
DOCUMENT_SEPARATOR = "\n\n"  # between documents in the token stream, as between paragraphs
BATCH_ROWS = 1000  # documents per batch read from a `datasets` dataset
BPE_SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")  # a BPE tokenizer's, ids 0-3


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
    # hub: the dataset's split that validates; null: its "validation" split if it has one, else
    # val_fraction of its train split
    val_split: str | None = None
    test_split: str | None = None  # hub: the dataset's test split (null: "test")
    # evaluate.py only: the split it scores, validation (null) or test (hub)
    split: str | None = None
    streaming: bool = False  # read the source as a stream: corpora larger than memory
    tokenizer: str = "char"
    bpe_vocab_size: int = 1024  # tokenizer=bpe: the vocabulary it learns
    tokenizer_file: str | os.PathLike | None = None  # reuse this saved tokenizer, not a new one
    block_size: int = 128
    batch_size: int = 32
    val_fraction: float = 0.1
    cache_dir: str | os.PathLike = ".cache/tinyformer"
    num_workers: int = 0
    num_proc: int = 1  # processes tokenizing the corpus (`datasets.map`), when not streaming

    def __post_init__(self) -> None:
        check_field_types(self, "data.")
        if self.source not in SOURCES:
            raise ValueError(f"data.source must be one of {list(SOURCES)}, got {self.source!r}")
        if self.tokenizer not in TOKENIZERS:
            known = list(TOKENIZERS)
            raise ValueError(f"data.tokenizer must be one of {known}, got {self.tokenizer!r}")
        check_int("data.block_size", self.block_size)
        check_int("data.bpe_vocab_size", self.bpe_vocab_size)
        if self.tokenizer == "bpe" and self.tokenizer_file is None:
            # here, not once the corpus is read, as the tokenizer is about to be trained
            check_bpe_vocab_size(self.bpe_vocab_size, BPE_SPECIALS)
        check_int("data.batch_size", self.batch_size)
        check_int("data.num_workers", self.num_workers, minimum=0)
        check_int("data.num_proc", self.num_proc)
        v = self.val_fraction
        check(0 < v < 1, "data.val_fraction", "a number between 0 and 1", v)
        if not self.cache_dir:
            raise ValueError(f"data.cache_dir must be a directory path, got {self.cache_dir!r}")
        # Strings, as a checkpoint's hyper-parameters hold them (see path_list)
        self.cache_dir = os.fspath(self.cache_dir)
        if self.tokenizer_file is not None:
            self.tokenizer_file = os.fspath(self.tokenizer_file)
        if not self.text_column:
            raise ValueError(f"data.text_column must be a column name, got {self.text_column!r}")
        self.paths, self.val_paths = path_list(self.paths), path_list(self.val_paths)
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
        for key in ("config", "val_split", "test_split"):
            value = getattr(self, key)
            if value is not None and self.source != "hub":
                raise ValueError(f"data.{key} is only read by source=hub, got {value!r}")
            check(value is None or bool(value), f"data.{key}", "a split name or null", value)
        self._check_split()
        # A missing file, or a .jsonl file without the text column, is a config mistake: it
        # fails here, before the trainer starts.
        for key, patterns in (("data.paths", self.paths), ("data.val_paths", self.val_paths)):
            if patterns:
                files = expand_paths(patterns, list(TEXT_BUILDERS), key)
                check_file_columns(files, {self.text_column: "data.text_column"})
        if self.tokenizer_file is not None and not Path(self.tokenizer_file).is_file():
            raise FileNotFoundError(
                f"data.tokenizer_file: no tokenizer at {self.tokenizer_file}; point it at the "
                "tokenizer.json of an earlier run (its run directory holds one)"
            )

    def _check_split(self) -> None:
        s = self.split
        check(s is None or s in SPLITS, "data.split", f"one of {list(SPLITS)} or null", s)
        if s is not None and self.source == "text_files":
            raise ValueError(
                f"data.split={s}: evaluate.py scores all of data.paths, which has no splits; "
                "drop data.split"
            )
        if s == "test" and self.source != "hub":
            raise ValueError(
                "data.split=test: the embedded plays have no test split; score held-out text "
                "with data=text_files 'data.paths=[held_out.txt]', or a Hub dataset's with data=hub"
            )


# --- Token streams and blocks --------------------------------------------------------------------


def encode_held_out(
    tokenizer: CharTokenizer | BPETokenizer, texts: list[str]
) -> tuple[list[list[int]], list[int]]:
    """Token ids of text the tokenizer was not trained on, and the characters of each text that
    had to be dropped: those the char tokenizer never saw have no id (a byte-level BPE has one
    for any text)."""
    if isinstance(tokenizer, CharTokenizer):
        kept = [tokenizer.known(text) for text in texts]
        dropped = [len(text) - len(known) for text, known in zip(texts, kept, strict=True)]
        return tokenizer.encode_batch(kept), dropped
    return tokenizer.encode_batch(texts), [0] * len(texts)


class TokenWriter:
    """Appends documents' token ids to a binary file, a separator between documents."""

    def __init__(self, file: BinaryIO, separator: list[int], dtype: type) -> None:
        self.file, self.separator, self.dtype, self.count = file, separator, dtype, 0

    def append(self, ids: list[int]) -> None:
        if ids:
            chunk = np.asarray((self.separator if self.count else []) + ids, dtype=self.dtype)
            self.file.write(chunk.tobytes())
            self.count += len(chunk)


def token_stream(
    tokenizer: CharTokenizer | BPETokenizer, texts: list[str]
) -> tuple[np.ndarray, int]:
    """Held-out documents as one token stream, written as the cache writes its val.bin, and the
    number of characters dropped from them (encode_held_out)."""
    buffer, dtype = io.BytesIO(), token_dtype(tokenizer)
    writer = TokenWriter(buffer, tokenizer.encode(DOCUMENT_SEPARATOR), dtype)
    ids, dropped = encode_held_out(tokenizer, texts)
    for document in ids:
        writer.append(document)
    return np.frombuffer(buffer.getbuffer(), dtype=dtype), sum(dropped)


class TokenBlocks(Dataset):
    """(x, y) pairs of `block_size` tokens, y shifted one token ahead, one every `stride` tokens.

    A DataLoader given collate_fn=whole_batch fetches each batch in one gather (__getitems__),
    in a fraction of the host time that fetching each example and stacking them takes
    (bench/batch_fetch.py): time a GPU waits through when the model is small."""

    def __init__(self, tokens: np.ndarray, block_size: int, stride: int):
        self.tokens, self.block_size, self.stride = tokens, block_size, stride

    def __len__(self) -> int:
        return (len(self.tokens) - self.block_size - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.stride
        chunk = torch.from_numpy(self.tokens[start : start + self.block_size + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The examples at `indices`, stacked: (x, y), each (len(indices), block_size)."""
        positions = (np.asarray(indices) * self.stride)[:, None] + np.arange(self.block_size)
        x = torch.from_numpy(self.tokens[positions].astype(np.int64))
        return x, torch.from_numpy(self.tokens[positions + 1].astype(np.int64))


def whole_batch(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The collate_fn of a dataset whose __getitems__ makes the batch itself (TokenBlocks)."""
    return batch


def texts_of(
    ds: "datasets.Dataset | datasets.IterableDataset", column: str = "text"
) -> Iterator[str]:
    """The strings of a dataset's `column`, read batch by batch (a stream, as it comes); "" for
    a row without one (documents_of)."""
    for batch in ds.iter(batch_size=BATCH_ROWS):
        yield from documents_of(batch, column)


def documents_of(batch: dict, column: str = "text") -> list[str]:
    """The texts of a batch's `column`, "" for a row without one: `datasets` reads a JSON Lines
    row that lacks the key as None (a null of a Hub dataset too), and such a row holds no
    document."""
    return [text or "" for text in batch[column]]


# --- What evaluate.py scores ---------------------------------------------------------------------


def _whole(ds: "datasets.Dataset | datasets.IterableDataset") -> list[str]:
    return [text.strip("\n") for text in texts_of(ds)]  # separators come between documents


def eval_documents(c: LMDataConfig, trained_block_size: int | None = None) -> tuple[list[str], str]:
    """The documents evaluate.py scores, and what they are, in words: every one of data.paths;
    a Hub dataset's test split; or the validation text exactly as training cuts it, from the
    embedded plays, a Hub dataset (its own validation split, or its train split's share) or,
    given the block size a run trained with (which decides how much a small text gives
    validation), text files."""
    cache_dir = Path(c.cache_dir)
    if c.source == "text_files" and trained_block_size is not None:
        return _text_files_validation(c, trained_block_size)
    if c.val_paths:
        raise ValueError(
            "data.val_paths: evaluate.py scores all of data.paths; put the files to score there"
        )
    if c.source == "text_files":
        files = expand_paths(c.paths, list(TEXT_BUILDERS))
        docs = load_text_files(files, c.text_column, cache_dir, c.streaming)
        return _whole(docs), f"all of data.paths ({len(files)} file(s))"
    if c.source == "shakespeare":
        tails = [
            tail for _, tail in tail_split(load_shakespeare(cache_dir)["text"], c.val_fraction)
        ]
        return tails, f"the embedded plays' validation split (data.val_fraction={c.val_fraction})"
    title = hub_title(c.name, c.config)
    if c.split == "test":  # the split read, checked before its rows are (see load_hub)
        wanted = {c.test_split or "test": "data.test_split"}
    else:
        wanted = {c.val_split: "data.val_split"} if c.val_split else {}
    text = {c.text_column: "data.text_column"}
    splits = load_hub(c.name, c.config, cache_dir, c.streaming, splits=wanted, columns=text)
    if c.split == "test":
        name = c.test_split or "test"
        docs = hub_text(splits, name, c.text_column, title, "data.test_split")
        return _whole(docs), f"the {name!r} split of {title}"
    name, shown = hub_val_split(splits, c.val_split, c.val_fraction, title)
    if name is not None:
        return _whole(hub_text(splits, name, c.text_column, title, "data.val_split")), shown
    train = hub_text(splits, "train", c.text_column, title, "data.name")
    return _carved_validation(train, c.val_fraction), shown


def _text_files_validation(c: LMDataConfig, block_size: int) -> tuple[list[str], str]:
    """The validation text of text files, as data/lm.py cuts it for training: data.val_paths's
    documents whole, else the tail of each document of a corpus of few (at least one block's
    worth in all), else one whole document in every 1/val_fraction."""
    cache_dir = Path(c.cache_dir)
    if c.val_paths:
        files = expand_paths(c.val_paths, list(TEXT_BUILDERS), "data.val_paths")
        docs = load_text_files(files, c.text_column, cache_dir, c.streaming, "data.val_paths")
        return _whole(docs), f"all of data.val_paths ({len(files)} file(s))"
    files = expand_paths(c.paths, list(TEXT_BUILDERS))
    docs = load_text_files(files, c.text_column, cache_dir, c.streaming)
    shown = (
        f"the validation split of data.paths ({len(files)} file(s), "
        f"data.val_fraction={c.val_fraction})"
    )
    return _carved_validation(docs, c.val_fraction, min_tail=least_val_tail(block_size)), shown


def least_val_tail(block_size: int) -> int:
    """The fewest characters that text files carved by val_fraction give validation: a block's
    worth and one more, so that any text of two blocks trains."""
    return block_size + 1


def _carved_validation(
    docs: "datasets.Dataset | datasets.IterableDataset", val_fraction: float, min_tail: int = 0
) -> list[str]:
    """The validation text that training carves out of `docs` by val_fraction (data/lm.py):
    the tail of each of few documents, else one whole document in every 1/val_fraction, the
    others read as a stream and let go (a corpus may be larger than memory)."""
    if splits_by_tail(texts_of(docs), val_fraction):
        return [tail for _, tail in tail_split(list(texts_of(docs)), val_fraction, min_tail)]
    parts = (whole_split(text, i, val_fraction)[1] for i, text in enumerate(texts_of(docs)))
    return [part for part in parts if part]
