"""What the encoder-decoder reads, in plain Python (no Lightning, so evaluate.py loads without
it): the data options, the tasks that build (source, target) text pairs, their token ids, padded
batches of them, and the pairs evaluate.py scores. data/seq2seq.py caches the tasks' pairs for
training."""

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from data.local_files import check_file_columns, expand_paths, path_list
from data.pairs import (
    FILE_FORMATS,
    MASK,
    MIN_PASSAGE,
    Ragged,
    corrupt_chars,
    corrupt_spans,
    file_format,
    load_pair_texts,
    next_line_pairs,
    passages,
    split_rows,
)
from data.sources import load_shakespeare, train_val_split
from data.tokenizer import CharTokenizer
from errors import check, check_field_types, check_int

TASKS = ("denoise", "next_line", "pairs")
CORRUPTIONS = ("char", "span")
# model/blocks.py's IGNORE_INDEX (data/ may not import model/): padded targets add no loss
IGNORE_INDEX = -100


@dataclass
class Seq2SeqDataConfig:
    task: str = "denoise"
    corruption: str = "char"
    noise_rate: float = 0.15
    mean_span: float = 3
    max_source_len: int = 96  # source tokens, <mask> included
    max_target_len: int = 96  # decoder positions: <bos> + target (or target + <eos>)
    batch_size: int = 64
    val_fraction: float = 0.1
    cache_dir: str | os.PathLike = ".cache/tinyformer"
    num_workers: int = 0
    seed: int = 1234
    paths: list[str] = field(default_factory=list)
    hub_name: str | None = None
    hub_config: str | None = None
    source_column: str = "source"
    target_column: str = "target"
    val_subset: int = 256

    def __post_init__(self) -> None:
        check_field_types(self, "data.")
        check(self.task in TASKS, "data.task", f"one of {list(TASKS)}", self.task)
        corruption, known = self.corruption, list(CORRUPTIONS)
        check(corruption in CORRUPTIONS, "data.corruption", f"one of {known}", corruption)
        rate = self.noise_rate
        check(0 < rate < 1, "data.noise_rate", "a number between 0 and 1", rate)
        check(self.mean_span >= 1, "data.mean_span", "a number >= 1", self.mean_span)
        # A denoising source holds a whole passage; a target also needs room for <bos>/<eos>.
        shortest = MIN_PASSAGE if self.task == "denoise" else 1
        for key, least in (("max_source_len", shortest), ("max_target_len", shortest + 1)):
            length = getattr(self, key)
            check(length >= least, f"data.{key}", f"an integer >= {least} for {self.task}", length)
        check_int("data.batch_size", self.batch_size)
        check_int("data.val_subset", self.val_subset)
        check_int("data.num_workers", self.num_workers, minimum=0)
        check_int("data.seed", self.seed, minimum=0)
        v = self.val_fraction
        check(0 < v < 1, "data.val_fraction", "a number between 0 and 1", v)
        check(bool(self.cache_dir), "data.cache_dir", "a directory path", self.cache_dir)
        for key in ("source_column", "target_column"):
            check(bool(getattr(self, key)), f"data.{key}", "a column name", getattr(self, key))
        self.cache_dir = os.fspath(self.cache_dir)  # a string, as a checkpoint holds it
        self.paths = path_list(self.paths)
        paths_ok = all(isinstance(p, str) and p for p in self.paths)
        check(paths_ok, "data.paths", "a list of file paths", self.paths)
        config_ok = self.hub_config is None or bool(self.hub_name)
        check(config_ok, "data.hub_config", "null without hub_name", self.hub_config)
        if self.task != "pairs" and (self.paths or self.hub_name):
            raise ValueError(
                f"data.paths and data.hub_name are only read by task=pairs, got task={self.task}; "
                "use data=pairs"
            )
        if self.task == "pairs" and bool(self.paths) == bool(self.hub_name):
            raise ValueError(
                "task=pairs needs exactly one of data.paths (local files) and data.hub_name, "
                f"got paths={self.paths} and hub_name={self.hub_name!r}; "
                "e.g. data=pairs data.paths=[pairs.jsonl]"
            )
        if self.paths:  # a missing file, files of two formats, a missing column: here, first
            files = expand_paths(self.paths, list(FILE_FORMATS))
            file_format(files)
            check_file_columns(files, self.columns, together="data.paths")

    @property
    def columns(self) -> dict[str, str]:
        """The pairs' columns, each with the option that names it: {column: "data.<option>"}."""
        return {self.source_column: "data.source_column", self.target_column: "data.target_column"}


# --- Token ids and batches ---------------------------------------------------------------------

Split = tuple[Ragged, Ragged]  # (sources, targets)


def encode_pairs(tokenizer: CharTokenizer, pair: Split) -> tuple[Split, int]:
    """Token ids of (sources, targets) held as code points (MASK for <mask>), and the number of
    characters dropped because `tokenizer` has no id for them."""
    codes = np.array([ord(c) for c in tokenizer.chars])
    order = np.argsort(codes)  # ids follow the tokenizer's order of characters
    codes, ids_of = codes[order], order + len(tokenizer.specials)
    sides, dropped = [], 0
    for texts in pair:
        at = np.searchsorted(codes, texts.flat).clip(max=len(codes) - 1)
        ids = np.where(texts.flat == MASK, tokenizer.mask_id, ids_of[at])
        known = (codes[at] == texts.flat) | (texts.flat == MASK)
        sides.append(Ragged(ids, texts.offsets).keep_elements(known))
        dropped += int((~known).sum())
    return tuple(sides), dropped


def drop_empty_sources(pair: Split) -> tuple[Split, int]:
    """Pairs whose source is empty removed: an all-padding row leaves attention nothing to see."""
    sources, targets = pair
    rows = np.flatnonzero(np.diff(sources.offsets) > 0)
    if len(rows) == len(sources):
        return pair, 0
    return (sources.select(rows), targets.select(rows)), len(sources) - len(rows)


class PairDataset(Dataset):
    """(source ids, target ids) as int64 arrays, without <bos>/<eos>."""

    def __init__(self, sources: Ragged, targets: Ragged):
        self.sources, self.targets = sources, targets

    def __len__(self) -> int:
        return len(self.sources)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.sources[i].astype(np.int64), self.targets[i].astype(np.int64)


def pad_sequences(
    sequences: Sequence[Sequence[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad id sequences into (B, L) ids and a (B, L) mask, True at real tokens."""
    lengths = torch.tensor([len(s) for s in sequences])
    ids = torch.full((len(sequences), int(lengths.max())), pad_id, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = torch.as_tensor(sequence, dtype=torch.long)
    return ids, torch.arange(ids.size(1)) < lengths[:, None]


def collate_pairs(
    items: Sequence[tuple[np.ndarray, np.ndarray]], pad_id: int, bos_id: int, eos_id: int
) -> dict[str, torch.Tensor]:
    """Pad a batch to its longest source (S) and longest target + 1 (T).

    source (B, S) and source_mask (B, S), True at real tokens: the source is just the text, no
    <bos>/<eos>, since the encoder reads it whole and the mask says where it ends.
    target_in (B, T) = <bos> + target, target_out (B, T) = target + <eos> with IGNORE_INDEX at
    padding, and target_mask (B, T), True at the real positions of both.
    """
    source, source_mask = pad_sequences([s for s, _ in items], pad_id)
    target_lens = torch.tensor([len(t) + 1 for _, t in items])
    shape_t = (len(items), int(target_lens.max()))
    target_in = torch.full(shape_t, pad_id, dtype=torch.long)
    target_out = torch.full(shape_t, IGNORE_INDEX, dtype=torch.long)
    for row, (_, t) in enumerate(items):
        target_in[row, : len(t) + 1] = torch.from_numpy(np.concatenate(([bos_id], t)))
        target_out[row, : len(t) + 1] = torch.from_numpy(np.concatenate((t, [eos_id])))
    return {
        "source": source,
        "source_mask": source_mask,
        "target_in": target_in,
        "target_out": target_out,
        "target_mask": torch.arange(shape_t[1]) < target_lens[:, None],
    }


# --- The tasks ---------------------------------------------------------------------------------

Facts = dict[str, object]  # what a task reports about its build, kept in meta.json


def _shakespeare_scripts(c: Seq2SeqDataConfig) -> dict[str, str]:
    texts = load_shakespeare(Path(c.cache_dir))["text"]
    return dict(zip(("train", "val"), train_val_split(texts, c.val_fraction), strict=True))


def denoise_task(c: Seq2SeqDataConfig) -> tuple[dict[str, Split], Facts]:
    """Passages as targets, corrupted copies as sources; every pair is corrupted once, here, so
    the data are fixed by the seed. Val gets its own random stream: its noise doesn't depend
    on how much training text came before."""
    limit = min(c.max_source_len, c.max_target_len - 1)
    splits, noise = {}, {}
    rngs = np.random.default_rng(c.seed).spawn(2)
    for (split, script), rng in zip(_shakespeare_scripts(c).items(), rngs, strict=True):
        targets = Ragged.from_texts(passages(script, limit))
        if c.corruption == "char":
            sources = Ragged(corrupt_chars(targets.flat, c.noise_rate, rng), targets.offsets)
            noise[split] = float(np.mean(sources.flat != targets.flat))
        else:
            sources, noise[split] = corrupt_spans(targets, c.noise_rate, c.mean_span, rng)
        splits[split] = (sources, targets)
    return splits, {"noise_fraction": noise}


def next_line_task(c: Seq2SeqDataConfig) -> tuple[dict[str, Split], Facts]:
    splits = {}
    for split, script in _shakespeare_scripts(c).items():
        sources, targets = next_line_pairs(script, c.max_source_len, c.max_target_len - 1)
        splits[split] = (Ragged.from_texts(sources), Ragged.from_texts(targets))
    return splits, {}


def _cut_pairs(c: Seq2SeqDataConfig, sources: list[str], targets: list[str], rows) -> Split:
    """The pairs at `rows`, each text cut to the model's length limits."""
    cut_sources = [sources[i][: c.max_source_len] for i in rows]
    cut_targets = [targets[i][: c.max_target_len - 1] for i in rows]
    return Ragged.from_texts(cut_sources), Ragged.from_texts(cut_targets)


def pairs_task(c: Seq2SeqDataConfig) -> tuple[dict[str, Split], Facts]:
    sources, targets = load_pair_texts(c)
    train_rows, val_rows = split_rows(len(sources), c.val_fraction, c.seed)
    splits = {
        split: _cut_pairs(c, sources, targets, rows)
        for split, rows in (("train", train_rows), ("val", val_rows))
    }
    return splits, {}


TASK_BUILDERS = {"denoise": denoise_task, "next_line": next_line_task, "pairs": pairs_task}


# --- What evaluate.py scores -------------------------------------------------------------------


def eval_pairs(
    c: Seq2SeqDataConfig, tokenizer: CharTokenizer, as_trained: bool = False
) -> tuple[Split, int, str]:
    """The pairs evaluate.py scores as token ids by `tokenizer`, the number of characters it
    dropped, and what they are, in words: every pair of data.paths, or (a Shakespeare task, or
    `as_trained`) the task's validation pairs exactly as training builds them."""
    drawn = f"data.val_fraction={c.val_fraction}, data.seed={c.seed}"
    if c.task != "pairs":
        texts = TASK_BUILDERS[c.task](c)[0]["val"]
        shown = f"the validation pairs of task={c.task} on the embedded plays ({drawn})"
    elif as_trained:
        texts = pairs_task(c)[0]["val"]
        where = f"data.hub_name={c.hub_name}" if c.hub_name else "data.paths"
        shown = f"the validation pairs of {where} ({drawn})"
    elif c.hub_name:
        raise ValueError(
            f"data.hub_name={c.hub_name}: evaluate.py scores pairs from local files; give "
            "them as data=pairs 'data.paths=[pairs.jsonl]', or leave data= out to score the "
            "validation pairs of a run that trained on this dataset"
        )
    else:
        sources, targets = load_pair_texts(c)
        texts = _cut_pairs(c, sources, targets, range(len(sources)))
        files = expand_paths(c.paths, list(FILE_FORMATS))
        shown = f"every pair of data.paths ({len(files)} file(s))"
    pair, dropped = encode_pairs(tokenizer, texts)
    return drop_empty_sources(pair)[0], dropped, shown
