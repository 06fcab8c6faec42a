"""Next-token language-modelling data: a corpus (the embedded Shakespeare, local text files or a
Hub dataset) split into train/val, tokenized once into a cache of flat token arrays, and served
as (x, y) blocks with y one token ahead of x. The Lightning DataModule; the plain pieces it is
built from are data/lm_text.py's, data/sources.py's and data/local_files.py's."""

import hashlib
import json
from collections.abc import Iterator
from functools import cached_property, partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import DataLoader

from data.cache import CachedDataModule, entry_path, sized_meta, write_marker
from data.lm_text import (
    BATCH_ROWS,
    BPE_SPECIALS,
    DOCUMENT_SEPARATOR,
    LMDataConfig,
    TokenBlocks,
    TokenWriter,
    documents_of,
    encode_held_out,
    least_val_tail,
    texts_of,
    whole_batch,
)
from data.local_files import TEXT_BUILDERS, expand_paths, file_fingerprint, load_text_files
from data.sources import (
    hub_text,
    hub_title,
    hub_val_split,
    load_hub,
    load_shakespeare,
    most_tail_documents,
    shakespeare_version,
    splits_by_tail,
    tail_split,
    whole_split,
)
from data.tokenizer import BPETokenizer, CharTokenizer, load_tokenizer, token_dtype
from errors import config_from

if TYPE_CHECKING:  # `datasets` (0.6 s to import) loads only when a cache entry is built
    import datasets

# Bump whenever the cache entry's contents change meaning (normalisation, split, file layout).
# 3: a corpus too small to give validation whole documents is split inside them; a Hub dataset
# validates on its own validation split. 4: BPE encodes a special's name in the text as text.
# 5: a text file's byte-order mark is not read as text.
FORMAT_VERSION = 5


# --- Building the cache entry --------------------------------------------------------------------


def _split_rows(batch: dict, indices: list[int], val_fraction: float) -> dict:
    """Each document's train and val parts: all of it for one document in every
    1/val_fraction, nothing of the others."""
    texts = documents_of(batch)
    parts = [whole_split(text, i, val_fraction) for text, i in zip(texts, indices, strict=True)]
    return {"train": [t for t, _ in parts], "val": [v for _, v in parts]}


def _whole_rows(batch: dict, split: str) -> dict:
    """Each document whole in `split` ("train" or "val"), nothing in the other."""
    texts = [text.strip("\n") for text in documents_of(batch)]  # separators come between them
    empty = [""] * len(texts)
    return {"train": texts, "val": empty} if split == "train" else {"train": empty, "val": texts}


def _encode_rows(batch: dict, tokenizer: CharTokenizer | BPETokenizer) -> dict:
    """Token ids of each document's train and val parts. Characters the char tokenizer never saw
    in training have no id: they are dropped from val, and counted."""
    val_ids, val_dropped = encode_held_out(tokenizer, batch["val"])
    train_ids = tokenizer.encode_batch(batch["train"])
    return {"train_ids": train_ids, "val_ids": val_ids, "val_dropped": val_dropped}


def _encoded_features() -> "datasets.Features":
    """_encode_rows' columns, declared: a batch whose val (or train) parts are all empty, as
    with data.val_paths, would otherwise type them as lists of nothing."""
    import datasets

    ids = datasets.Sequence(datasets.Value("int64"))
    return datasets.Features(
        {"train_ids": ids, "val_ids": ids, "val_dropped": datasets.Value("int64")}
    )


def _text_bytes(docs: "datasets.Dataset") -> int:
    """The UTF-8 bytes of the text of `docs`, summed from the lengths Arrow keeps of its "text"
    column, without a row decoded (a row without text holds none)."""
    from pyarrow import compute  # ships with `datasets`

    lengths = compute.binary_length(docs.data.column("text"))
    return compute.sum(lengths).as_py() or 0


def _texts(corpus, column: str) -> Iterator[str]:
    """The non-empty strings of `column`, streamed."""
    return (text for text in texts_of(corpus, column) if text)


def _train_characters(corpus) -> set[str]:
    """Every character of the training parts, read as a stream."""
    characters: set[str] = set()
    for text in _texts(corpus, "train"):
        characters.update(text)
    return characters


class LMDataModule(CachedDataModule):
    """Token blocks for the GPT; LMDataConfig documents the options."""

    def __init__(self, **options) -> None:
        super().__init__()
        if options.get("split") is not None:
            raise ValueError(
                f"data.split={options['split']} picks the split evaluate.py scores; training "
                "trains on the train split and validates on data.val_split (data=hub: its own "
                "validation split by default), or on data.val_fraction of the text"
            )
        self.keep_config(config_from(LMDataConfig, options, "data.", "a GPT's data"))
        self._given_tokenizer = None
        self._given_by = ""
        if self.config.tokenizer_file is not None:
            given_by = f"data.tokenizer_file={self.config.tokenizer_file}"
            try:
                tokenizer = load_tokenizer(self.config.tokenizer_file)
            except ValueError as error:  # its message names the file, not the option
                raise ValueError(f"{given_by}: {error}") from None
            self.use_tokenizer(tokenizer, given_by)

    def use_tokenizer(self, tokenizer: CharTokenizer | BPETokenizer, given_by: str) -> None:
        """Encode the corpus with `tokenizer` (a resumed run's, init_from's or
        data.tokenizer_file's: `given_by`, the option that gave it, for the messages) rather
        than training one, so token ids keep their meaning."""
        self._given_tokenizer = tokenizer
        self._given_by = given_by
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
            else:
                key["min_val_tail"] = least_val_tail(c.block_size)
            return key
        if c.source == "hub":
            return {
                "hub": [c.name, c.config],
                "text_column": c.text_column,
                "val_split": c.val_split,
            }
        return {c.source: shakespeare_version()}

    def _tokenizer_key(self) -> object:
        c = self.config
        if self._given_tokenizer is not None:
            saved = json.dumps(self._given_tokenizer.to_dict(), sort_keys=True)
            return {"given": hashlib.sha256(saved.encode()).hexdigest()}
        return [c.tokenizer, c.bpe_vocab_size] if c.tokenizer == "bpe" else c.tokenizer

    @cached_property
    def cache_entry(self) -> Path:
        """Directory holding the tokenized corpus, keyed by (source, split, tokenizer): batch
        size, streaming and num_proc don't change it, nor does block size, but for text files
        split by data.val_fraction (their validation tail must hold a block). Fixed at first use,
        so files edited between prepare_data and setup cannot point them at different entries."""
        c = self.config
        key = {"version": FORMAT_VERSION, "source": self._source_key()}
        split = "val_paths" if c.val_paths else c.val_fraction  # val_fraction is not used then
        key |= {"val_fraction": split, "tokenizer": self._tokenizer_key()}
        return entry_path(c.cache_dir, "lm", key)

    def _corpus(self) -> tuple["datasets.Dataset | datasets.IterableDataset", bool]:
        """The source as one row per document, with its "train" and "val" parts; and whether
        val is carved out of the text by data.val_fraction (not given by files or a split)."""
        import datasets

        c, cache_dir = self.config, Path(self.config.cache_dir)
        min_tail = 0
        if c.source == "shakespeare":
            docs = load_shakespeare(cache_dir).select_columns(["text"])
        elif c.source == "text_files":
            files = expand_paths(c.paths, list(TEXT_BUILDERS))
            docs = load_text_files(files, c.text_column, cache_dir, c.streaming)
            if c.val_paths:
                val_files = expand_paths(c.val_paths, list(TEXT_BUILDERS), "data.val_paths")
                val_docs = load_text_files(
                    val_files, c.text_column, cache_dir, c.streaming, "data.val_paths"
                )
                self._check_read_text_holds_blocks({"train": docs, "val": val_docs})
                return self._given_split(docs, val_docs), False
            self._check_read_text_holds_blocks({None: docs})
            min_tail = least_val_tail(c.block_size)
        else:
            title = hub_title(c.name, c.config)
            wanted = {"train": "data.name"}  # the splits read, checked before their rows are
            if c.val_split:
                wanted[c.val_split] = "data.val_split"
            text = {c.text_column: "data.text_column"}
            splits = load_hub(c.name, c.config, cache_dir, c.streaming, splits=wanted, columns=text)
            docs = hub_text(splits, "train", c.text_column, title, "data.name")
            val_split, shown = hub_val_split(splits, c.val_split, c.val_fraction, title)
            print(f"data=hub: validating on {shown}")
            if val_split is not None:
                val_docs = hub_text(splits, val_split, c.text_column, title, "data.val_split")
                self._check_read_text_holds_blocks({"train": docs, "val": val_docs})
                return self._given_split(docs, val_docs), False
            self._check_read_text_holds_blocks({None: docs})
        # A play's tail keeps val in the same style as train, and so does the tail of each
        # document of a corpus too small to give whole ones to val (one file, say); held in
        # memory, as they are few. A corpus of many documents gives whole ones to val, which a
        # stream can decide one document at a time.
        if c.source == "shakespeare" or splits_by_tail(docs, c.val_fraction):
            texts = list(texts_of(docs))
            heads, tails = zip(*tail_split(texts, c.val_fraction, min_tail), strict=True)
            return datasets.Dataset.from_dict({"train": heads, "val": tails}), True
        split = partial(_split_rows, val_fraction=c.val_fraction)
        return self._map(docs, split, "split", with_indices=True, remove_columns=["text"]), True

    def _given_split(self, train_docs, val_docs):
        """The documents of `train_docs` as training text and those of `val_docs` as
        validation text, whole: data.val_paths's files, or a Hub dataset's own split."""
        import datasets

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
        return CharTokenizer(sorted(_train_characters(corpus) | set(DOCUMENT_SEPARATOR)))

    def _check_given_chars(self, corpus) -> None:
        """A given char tokenizer has no id for the characters it was not trained on: in the
        training text they are refused, all named at once, with the option that gave the
        tokenizer (one trained on the text knows them all; validation drops them)."""
        if not isinstance(self._given_tokenizer, CharTokenizer):
            return  # a byte-level BPE encodes any text
        unknown = _train_characters(corpus) - set(self._given_tokenizer.chars)
        if unknown:
            shown = ", ".join(repr(c) for c in sorted(unknown)[:10])
            more = f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""
            raise ValueError(
                f"{self._given_by}: its char tokenizer has no id for {len(unknown)} character(s) "
                f"of the training text: {shown}{more}; remove them from the text, or let a run "
                "without that tokenizer train one on it"
            )

    def _build(self, out: Path) -> None:
        c = self.config
        if c.source == "text_files":
            self._check_files_hold_blocks()
        corpus, carved = self._corpus()
        if self._given_tokenizer is None:
            tokenizer = self._train_tokenizer(corpus)
        else:
            tokenizer = self._given_tokenizer
            self._check_given_chars(corpus)
        encode = partial(_encode_rows, tokenizer=tokenizer)
        encoded = self._map(
            corpus, encode, "encode", remove_columns=["train", "val"], features=_encoded_features()
        )
        dtype = token_dtype(tokenizer)
        separator = tokenizer.encode(DOCUMENT_SEPARATOR)
        dropped = 0
        with open(out / "train.bin", "wb") as train_file, open(out / "val.bin", "wb") as val_file:
            train = TokenWriter(train_file, separator, dtype)
            val = TokenWriter(val_file, separator, dtype)
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
            if count == 0:  # an empty file cannot be mapped
                self._check_sizes(counts, carved, dropped)
        val_tokens = np.memmap(out / "val.bin", dtype=dtype, mode="r")
        tokenizer.save(out / "tokenizer.json")
        meta = {
            "key": json.loads(json.dumps(self._source_key())),
            "format_version": FORMAT_VERSION,
            "tokenizer": c.tokenizer if self._given_tokenizer is None else "given",
            "val_fraction": c.val_fraction,
            "val_carved": carved,
            "dtype": np.dtype(dtype).name,
            "vocab_size": tokenizer.vocab_size,
            "train_tokens": counts["train"],
            "val_tokens": counts["val"],
            "val_chars": int(np.asarray(tokenizer.token_char_counts())[val_tokens].sum()),
            "val_chars_dropped": dropped,
        }
        write_marker(out, meta)

    def _check_files_hold_blocks(self) -> None:
        """Before a file is read, files too small to hold the blocks fail in one line, judged by
        their sizes (_check_holds_blocks). Text over that bound but short of tokens is found
        once read whole, by the bytes of its text (the keys and other columns of JSON Lines
        count in its size), and else once tokenized, by _check_sizes (a warm entry's counts, at
        once)."""
        c = self.config
        if c.val_paths:
            sides = [("train", c.paths, "data.paths"), ("val", c.val_paths, "data.val_paths")]
        else:
            sides = [(None, c.paths, "data.paths")]
        for split, patterns, key in sides:
            files = expand_paths(patterns, list(TEXT_BUILDERS), key)
            size = sum(f.stat().st_size for f in files)
            if size:  # empty files are load_text_files' to name
                self._check_holds_blocks(split, size, len(files))

    def _check_read_text_holds_blocks(
        self, texts: dict[str | None, "datasets.Dataset | datasets.IterableDataset"]
    ) -> None:
        """Text read whole ({split: its documents}, as _check_holds_blocks takes the split)
        fails in one line where the bytes of its text cannot hold the blocks: before the
        tokenizer is trained and the text tokenized under progress bars, and, for a Hub dataset,
        as soon as that can be known (its card's split sizes, before it is read, are no bound:
        `datasets` never checks them). A stream's text is counted once tokenized."""
        import datasets

        for split, docs in texts.items():
            if isinstance(docs, datasets.Dataset):
                self._check_holds_blocks(split, _text_bytes(docs), len(docs))

    def _check_holds_blocks(self, split: str | None, size: int, documents: int) -> None:
        """Text of at most `size` bytes in `documents` documents holds a block of data.block_size
        tokens and the token after it for `split` ("train" or "val", or None: the text both
        come from, val carved out of it by data.val_fraction), else a one-line error naming it
        and the fix. No tokenizer here makes more tokens than a text has bytes (a character is a
        byte or more, a byte-level BPE token covers a byte or more), besides the separators
        between documents."""
        c, block = self.config, self.config.block_size
        separator = len(DOCUMENT_SEPARATOR)  # tokens, at most, of each separator
        if split is None:
            # A text of few documents, split at each one's tail, repeats in both splits the
            # separator between two documents.
            need = 2 * (block + 1)
            repeated = separator * (most_tail_documents(c.val_fraction) - 1)
            what = "to train on and as many to validate on"
        else:
            need, repeated = block + 1, 0
            what = "to train on" if split == "train" else "to validate on"
        if size + separator * (documents - 1) + repeated >= need:
            return
        key, shown = self._text_of(split)
        raise ValueError(
            f"{key} holds {size} bytes of text ({shown}), so fewer than the {need} tokens that "
            f"data.block_size={block} needs: a block and the token after it {what}; add text or "
            "lower model.block_size"
        )

    def _text_of(self, split: str | None) -> tuple[str, str]:
        """The option that gives the text of `split` ("train" or "val", or None: the text both
        come from), and that text in words, for messages: its files, or a Hub dataset's split."""
        c = self.config
        if c.source == "text_files":
            key = "data.val_paths" if split == "val" else "data.paths"
            patterns = c.val_paths if split == "val" else c.paths
            return key, ", ".join(map(str, expand_paths(patterns, list(TEXT_BUILDERS), key)))
        if c.source == "hub":
            title = hub_title(c.name, c.config)
            if split != "val":
                return "data.name", f"the train split of {title}"
            name = c.val_split or "validation"  # hub_val_split's, for a split not carved
            return (
                "data.val_split" if c.val_split else "data.name",
                f"the {name!r} split of {title}",
            )
        return "data.source", "the embedded plays"

    def prepare_data(self) -> None:
        # A warm entry too short for the block is refused by its recorded lengths before
        # build_once reads all of it for its checksums (0.7 s a GiB on a 2-core CPU). Its
        # files' sizes are checked first, and damage only the checksums find leaves lengths as
        # they were; they still decide, as ever, whether the entry is used or built again.
        meta = sized_meta(self.cache_entry)
        if meta is not None:
            self._check_entry_sizes(meta)
        super().prepare_data()

    def _load(self, entry: Path) -> dict[str, np.ndarray]:
        meta = json.loads((entry / "meta.json").read_text())
        self._check_entry_sizes(meta)  # an entry built since prepare_data's check
        return {
            split: np.memmap(entry / f"{split}.bin", dtype=meta["dtype"], mode="r")
            for split in ("train", "val")
        }

    def _check_entry_sizes(self, meta: dict) -> None:
        """_check_sizes of the entry whose meta.json holds `meta`, its splits' token counts
        those of the files' recorded sizes (as many as a memmap of each has)."""
        itemsize = np.dtype(meta["dtype"]).itemsize
        files = meta["files"]
        counts = {split: files[f"{split}.bin"]["bytes"] // itemsize for split in ("train", "val")}
        self._check_sizes(counts, meta["val_carved"], meta.get("val_chars_dropped", 0))

    def _check_sizes(self, counts: dict[str, int], carved: bool, dropped: int) -> None:
        """Each split holds a block of data.block_size tokens and the token after it, or a
        one-line error says what is short: the whole text, or one split, and the text it comes
        from (`carved`: val is data.val_fraction of the text; `dropped`: its characters that
        the tokenizer, trained on the train split, lacks, which a text too short to train on has
        almost all of)."""
        block = self.config.block_size
        short = [split for split, count in counts.items() if count < block + 1]
        if not short:
            return
        split = short[0]
        key, shown = self._text_of(None if carved else split)
        needs = (
            f"data.block_size={block} needs at least {block + 1} tokens but the {split} split "
            f"has {counts[split]} (from {key}: {shown})"
        )
        total = sum(counts.values()) + dropped
        if total < 2 * (block + 1):
            raise ValueError(
                f"{needs}, and the whole text {total}: it is shorter than two blocks (one to train "
                "on, one to validate); add text or lower model.block_size"
            )
        fix = " or raise data.val_fraction" if split == "val" and carved else ""
        raise ValueError(f"{needs}; lower model.block_size{fix}")

    def train_dataset(self) -> TokenBlocks:
        # Every offset starts a training block; overlapping blocks are distinct examples.
        return TokenBlocks(self._split("train"), self.config.block_size, stride=1)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_dataset(), train=True, collate_fn=whole_batch)

    def val_dataloader(self) -> DataLoader:
        # Non-overlapping blocks score each validation token once per epoch.
        block = self.config.block_size
        blocks = TokenBlocks(self._split("val"), block, stride=block)
        return self._loader(blocks, train=False, collate_fn=whole_batch)

    def val_sample(self, length: int) -> torch.Tensor:
        """The first `length` validation tokens: fixed from one call to the next (for the
        embedded plays, they start at a speaker's name)."""
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
