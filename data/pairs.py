"""Building (source, target) text pairs: passages and line pairs cut from a script, their
corruption for denoising, and pairs read from local files or the Hub through `datasets`.

Texts travel as Ragged arrays of Unicode code points until the tokenizer exists; MASK stands
for a <mask> token among them."""

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from data.local_files import check_column, expand_paths, read_files
from data.sources import hub_split, hub_title, load_hub

if TYPE_CHECKING:  # it imports this module
    from data.seq2seq_text import Seq2SeqDataConfig

MIN_PASSAGE = 16  # shorter passages hold too little context to restore
MASK = -1  # stands for <mask> in arrays of code points, before the tokenizer exists
FILE_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


@dataclass
class Ragged:
    """Variable-length sequences stored flat: item i is `flat[offsets[i]:offsets[i + 1]]`."""

    flat: np.ndarray
    offsets: np.ndarray

    @classmethod
    def from_texts(cls, texts: Sequence[str]) -> "Ragged":
        """Unicode code points of each text (UTF-32 is one unit per code point)."""
        flat = np.frombuffer("".join(texts).encode("utf-32-le"), dtype=np.uint32)
        offsets = np.zeros(len(texts) + 1, dtype=np.int64)
        np.cumsum([len(t) for t in texts], out=offsets[1:])
        return cls(flat.astype(np.int64), offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.flat[self.offsets[i] : self.offsets[i + 1]]

    def keep_elements(self, keep: np.ndarray) -> "Ragged":
        """Drop the elements where `keep` (one bool per flat element) is False."""
        offsets = np.concatenate(([0], np.cumsum(keep)))[self.offsets]
        return Ragged(self.flat[keep], offsets)

    def select(self, rows: np.ndarray) -> "Ragged":
        """The items at `rows`, in that order."""
        lengths = np.diff(self.offsets)[rows]
        offsets = np.concatenate(([0], np.cumsum(lengths)))
        items = [self[i] for i in rows]
        return Ragged(np.concatenate(items) if items else self.flat[:0], offsets)


# --- Pairs from the Shakespeare corpus ---------------------------------------------------------


def speeches(script: str) -> list[list[str]]:
    """The spoken lines of each speech in script text (`NAME:` line, lines, blank line)."""
    return [block.split("\n")[1:] for block in script.strip("\n").split("\n\n")]


def _wrap(line: str, limit: int) -> Iterator[str]:
    """Cut a line into pieces of at most `limit` characters, at spaces where there are any."""
    while len(line) > limit:
        cut = line.rfind(" ", 1, limit + 1)
        cut = cut if cut > 0 else limit
        yield line[:cut]
        line = line[cut:].lstrip(" ")
    if line:
        yield line


def passages(script: str, limit: int) -> list[str]:
    """Consecutive lines of one speech, greedily packed into passages of 16..limit characters."""
    out = []
    for lines in speeches(script):
        current = ""
        for piece in (p for line in lines for p in _wrap(line, limit)):
            if current and len(current) + 1 + len(piece) <= limit:
                current += "\n" + piece
                continue
            if len(current) >= MIN_PASSAGE:
                out.append(current)
            current = piece
        if len(current) >= MIN_PASSAGE:
            out.append(current)
    return out


def next_line_pairs(script: str, max_source: int, max_target: int) -> tuple[list[str], list[str]]:
    """(line, next line of the same speech) for every such pair, cut to the length limits."""
    sources, targets = [], []
    for lines in speeches(script):
        sources += [line[:max_source] for line in lines[:-1]]
        targets += [line[:max_target] for line in lines[1:]]
    return sources, targets


def corrupt_chars(codes: np.ndarray, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Replace each character with probability `rate` by a different random letter (of the same
    case for a letter, of either case otherwise); lengths are unchanged."""
    out = codes.copy()
    hit = np.flatnonzero(rng.random(len(codes)) < rate)
    c = codes[hit]
    big, small = ord("A"), ord("a")
    upper, lower = (c >= big) & (c < big + 26), (c >= small) & (c < small + 26)
    base = np.where(upper, big, np.where(lower, small, rng.choice([big, small], len(c))))
    # A shift of 1..25 around the alphabet never maps a letter to itself.
    shifted = (c - base + rng.integers(1, 26, len(c))) % 26
    out[hit] = base + np.where(upper | lower, shifted, rng.integers(0, 26, len(c)))
    return out


def corrupt_spans(
    texts: Ragged, rate: float, mean_span: float, rng: np.random.Generator
) -> tuple[Ragged, float]:
    """T5-style span corruption: spans averaging `mean_span` characters, covering about `rate` of
    the text, each become one MASK. Returns the corrupted texts and the fraction removed."""
    n = len(texts.flat)
    # Alternate kept runs and noise spans with geometric lengths whose means are in the ratio
    # (1 - rate) : rate. Every cycle covers at least one character, so n cycles reach the end.
    kept_mean = mean_span * (1 - rate) / rate
    kept = rng.geometric(1 / (kept_mean + 1), n) - 1  # may be 0: spans then merge
    span = rng.geometric(1 / mean_span, n)
    starts = np.cumsum(kept + span) - span
    ends = np.minimum(starts + span, n)
    starts = starts[starts < n]
    depth = np.bincount(starts, minlength=n + 1) - np.bincount(ends[: len(starts)], minlength=n + 1)
    noise = np.cumsum(depth)[:n] > 0
    # A span opens where noise follows a kept character or starts a text; one cut by a text
    # boundary becomes two spans, so no MASK stands for characters of two texts.
    opens = noise & ~np.concatenate(([False], noise[:-1]))
    first = texts.offsets[:-1]  # passages are never empty, so each indexes its own character
    opens[first] = noise[first]
    marked = Ragged(np.where(noise, MASK, texts.flat), texts.offsets)
    return marked.keep_elements(~noise | opens), float(noise.mean())


# --- Pairs from local files or the Hub ---------------------------------------------------------


def file_format(files: Sequence[Path]) -> str:
    """The `datasets` builder that reads the files (expand_paths' of FILE_FORMATS): "json",
    "csv" or "parquet"."""
    formats = {FILE_FORMATS[f.suffix.lower()] for f in files}
    if len(formats) > 1:
        raise ValueError(f"data.paths mixes {sorted(formats)} files; use files of one format")
    return formats.pop()


def load_pair_texts(c: "Seq2SeqDataConfig") -> tuple[list[str], list[str]]:
    """The source and target columns of the local files or Hub dataset (rows with a missing
    value are skipped)."""
    if c.hub_name:
        name = hub_title(c.hub_name, c.hub_config)
        fix = "data=pairs data.paths=[pairs.jsonl]"
        splits = load_hub(
            c.hub_name,
            c.hub_config,
            c.cache_dir,
            key="data.hub_name",
            config_key="data.hub_config",
            local_fix=fix,
            splits={"train": "data.hub_name"},
            columns=c.columns,
        )
        ds = hub_split(splits, "train", name, "data.hub_name")
    else:
        files = expand_paths(c.paths, list(FILE_FORMATS))
        name = ", ".join(str(f) for f in files)
        builder = file_format(files)
        options = csv_text_options(c.columns) if builder == "csv" else {}
        ds = read_files(builder, files, Path(c.cache_dir), "data.paths", **options)
    for column, key in c.columns.items():
        check_column(ds.column_names, column, name, key)
    rows = [
        (str(s), str(t))
        for s, t in zip(ds[c.source_column], ds[c.target_column], strict=True)
        if s is not None and t is not None
    ]
    return [s for s, _ in rows], [t for _, t in rows]


def csv_text_options(columns: Sequence[str]) -> dict[str, object]:
    """The `datasets` CSV builder's options that read `columns` as the text of their cells: left
    to pandas, a column of numbers is read as numbers ("007" as 7, and as 7.0 once a cell of it
    is empty) and "NA", "None", "null" and the like as missing values, so their rows were lost.
    Only an empty cell is missing, as a JSON row without the key is."""
    import datasets

    strings = datasets.Features({column: datasets.Value("string") for column in columns})
    return {"features": strings, "keep_default_na": False, "na_values": [""]}


def split_rows(n: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Train and val row indices from a seeded permutation, each sorted to keep file order."""
    n_val = max(1, round(n * val_fraction))
    if n - n_val < 1:
        raise ValueError(f"task=pairs needs at least 2 pairs to make train and val, got {n}")
    order = np.random.default_rng(seed).permutation(n)
    return np.sort(order[n_val:]), np.sort(order[:n_val])
