"""Data files on this machine, read with Hugging Face `datasets`: `data.paths` expanded and
fingerprinted, their columns told from their first rows before anything is read, and the files
read into one dataset, a file `datasets` cannot read named in one line with its fault."""

import codecs
import csv
import glob
import hashlib
import json
import logging
import os
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from data.files import disk_full_cause

if TYPE_CHECKING:  # `datasets` (0.6 s to import) loads only when a cache entry is built
    import datasets

# Text files are read one paragraph (blank-line separated) per document; .jsonl one row each.
TEXT_BUILDERS = {".txt": "text", ".md": "text", ".jsonl": "json"}
# The data options that name files, folders or globs (data=text_files, data=pairs), a file (a
# saved tokenizer), and a Hub dataset or a directory laid out as one (data=hub, data=pairs)
PATH_LIST_KEYS = ("paths", "val_paths")
PATH_KEYS = ("tokenizer_file",)
HUB_NAME_KEYS = ("name", "hub_name")
DATA_PATH_KEYS = (*PATH_LIST_KEYS, *PATH_KEYS, *HUB_NAME_KEYS)


def expand_paths(
    patterns: Sequence[str], suffixes: Sequence[str], key: str = "data.paths"
) -> list[Path]:
    """The files named by `patterns` (files, globs, or folders searched recursively for files
    ending in `suffixes`), each glob's and folder's matches sorted, in order, made absolute,
    each once, where it is first named. `key` is the option that gave them, for the messages.
    A file that ends in none of `suffixes` is an error here, with the config's checks, rather
    than once the files before it have been read (under `datasets`' progress bars)."""
    if isinstance(patterns, str) or not patterns:
        raise ValueError(
            f"{key} must be a non-empty list of files, globs or folders, got {patterns!r}; "
            f"e.g. '{key}=[corpus/*.txt]'"
        )
    files: list[Path] = []
    for pattern in map(os.path.expanduser, patterns):
        # A file or folder that exists is taken as named before the pattern is read as a glob:
        # a name may hold a glob's characters ("notes[1].txt"), which match other names.
        if Path(pattern).is_file():
            files.append(Path(pattern))
        elif Path(pattern).is_dir():
            # is_file: a folder inside named like a file ("notes.txt/") is searched, not read
            named = (f for f in Path(pattern).rglob("*") if f.suffix.lower() in suffixes)
            found = sorted(f for f in named if f.is_file())
            if not found:
                raise FileNotFoundError(
                    f"{key}: the folder {pattern} holds no {'/'.join(suffixes)} files"
                )
            files += found
        elif is_glob(pattern):
            matches = sorted(Path(m) for m in glob.glob(pattern, recursive=True))
            matches = [m for m in matches if m.is_file()]
            if not matches:
                raise FileNotFoundError(f"{key}: no file matches {pattern!r}; check the glob")
            files += matches
        else:
            raise FileNotFoundError(f"{key}: no file at {pattern}; check the path")
    for f in files:
        if f.suffix.lower() not in suffixes:
            known = ", ".join(suffixes)
            raise ValueError(f"{key}: {f} has an unsupported extension; use one of {known}")
    # A file named twice (a folder and a glob inside it, two globs that overlap, a link to it)
    # is read once: read twice, its documents would train twice, and a document that one copy
    # gives to validation another would train on.
    return list(dict.fromkeys(f.resolve() for f in files))


def from_launch_dir(
    options: Mapping[str, Any], launch_dir: Path, *, moved_to: Path | None = None
) -> dict:
    """Data options (a data config's) with the relative paths made absolute under the directory
    a run was launched in, where it read them: its checkpoint may be resumed or scored from
    anywhere. With `moved_to`, a path that names nothing there any more but does under
    `moved_to` (where the project has moved, say) is taken there. A Hub dataset's name is a
    local directory's only where one is there: a name that was none was the Hub's."""

    def absolute(path: str) -> str:
        there = (launch_dir / Path(path).expanduser()).resolve()  # absolute ones stay
        if moved_to is not None and not names_files(there):
            moved = (moved_to / Path(path).expanduser()).resolve()
            if names_files(moved):
                return str(moved)
        return str(there)

    resolved = dict(options)
    for key in PATH_LIST_KEYS:
        if key in resolved:
            resolved[key] = [absolute(path) for path in path_list(resolved[key])]
    for key in PATH_KEYS:
        if resolved.get(key) is not None:
            resolved[key] = absolute(os.fspath(resolved[key]))
    for key in HUB_NAME_KEYS:
        name = resolved.get(key)
        if name and (launch_dir / name).is_dir():
            resolved[key] = str((launch_dir / name).resolve())
    return resolved


def from_launch_dir_or_here(
    options: Mapping[str, Any], launch_dir: Path, here: Path
) -> tuple[dict, list[str]]:
    """from_launch_dir's options, taking from `here` each path that names nothing in launch_dir
    any more but does here (the project has moved, or was copied to another machine), and one
    line for each option so taken, for the command to print: it reads other files than the run
    did, where they had the same names."""
    read = from_launch_dir(options, launch_dir, moved_to=here)
    there = from_launch_dir(options, launch_dir)
    notes = []
    for key in (key for key in (*PATH_LIST_KEYS, *PATH_KEYS) if read.get(key) != there.get(key)):
        each = [
            path_list(o[key]) if key in PATH_LIST_KEYS else [o[key]] for o in (options, read, there)
        ]
        gone = [name for name, now, before in zip(*each, strict=True) if now != before]
        notes.append(
            f"data.{key}: {', '.join(gone)} named nothing in {launch_dir}, where the run was "
            f"launched, any more: read from here, {here}"
        )
    return read, notes


def names_files(path: Path) -> bool:
    """Whether `path`, a file, a folder or a glob, names anything on this machine."""
    return path.exists() or (is_glob(str(path)) and bool(glob.glob(str(path), recursive=True)))


def is_glob(pattern: str) -> bool:
    return any(ch in pattern for ch in "*?[")


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


def load_local(
    builder: str,
    files: Sequence[Path],
    cache_dir: str,
    streaming: bool = False,
    **options: object,
) -> "datasets.Dataset | datasets.IterableDataset":
    """The train split of `datasets.load_dataset(builder, data_files=files)`: the files on this
    machine read by the packaged builder `builder` ("text", "json", ...), `datasets`' copy of
    them kept in `cache_dir`, with no request to the network.

    For a packaged builder, every load_dataset call first sends a HEAD request to S3 that
    counts a download of it (datasets.load.increase_load_count), and waits for it, unless
    HF_HUB_OFFLINE is set: a round trip online; offline, as long as the DNS takes to fail,
    which now and then is the resolver's whole 5 s timeout. load_text_files read each file in
    a call of its own (a .jsonl file still is), so that was paid per file, streamed or not:
    0.1-0.2 s a file on average (bench/many_files.py). Nothing is downloaded here, so there is
    nothing to count; no argument of load_dataset turns it off, but its switch,
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS, is read at each call: it is off for this one
    and set back after."""
    import datasets

    with library_switches(False, (datasets.config, "HF_UPDATE_DOWNLOAD_COUNTS")):
        return datasets.load_dataset(
            builder,
            # escaped: `datasets` reads data_files as globs, and "notes[1].txt" as one matches
            # "notes1.txt", not itself
            data_files=[glob.escape(str(f)) for f in files],
            split="train",
            streaming=streaming,
            cache_dir=cache_dir,
            **options,
        )


@contextmanager
def library_switches(value: bool, *switches: tuple[object, str]) -> Iterator[None]:
    """Each switch (module, name) of `switches` set to `value` within, and set back after: the
    settings that `datasets` and huggingface_hub read from their modules at each call, which
    no argument of theirs sets. They are the process's: no two loads run in threads at once
    (the data is read in prepare_data alone)."""
    saved = [getattr(module, name) for module, name in switches]
    for module, name in switches:
        setattr(module, name, value)
    try:
        yield
    finally:
        for (module, name), before in zip(switches, saved, strict=True):
            setattr(module, name, before)


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


# Files of JSON rows, which have no header: the keys of their rows are their columns
JSON_SUFFIXES = (".jsonl", ".json")
# How much of a JSON Lines file `datasets` reads to find its columns: its JSON reader's first
# chunk (JsonConfig.chunksize) and the rest of the line that chunk ends in. Every key of a row
# there is a column, null in the rows that lack it; a key first met further on fails the read
# as a column too many.
JSON_COLUMNS_BYTES = 10 << 20


def json_lines_keys(path: Path, wanted: Collection[str]) -> tuple[list[str], bool]:
    """The keys of the rows of the JSON Lines file `path` that `datasets` finds its columns in
    (those that start in its first JSON_COLUMNS_BYTES), in the order met, read only until every
    one of `wanted` is among them: where the first row holds them, no further. And whether the
    whole file was read. Lines that are no JSON object are passed over: reading names them."""
    keys: dict[str, None] = {}
    start = 0  # where the next line starts
    with open(path, "rb") as file:
        for line in file:
            if start > JSON_COLUMNS_BYTES:
                return list(keys), False
            start += len(line)
            try:
                row = json.loads(line)  # from bytes: a byte-order mark passes, as in `datasets`
            except ValueError:  # not JSON, or not UTF-8
                continue
            if isinstance(row, dict):
                keys.update(dict.fromkeys(row))
                if keys.keys() >= set(wanted):
                    break
    return list(keys), start == path.stat().st_size


def told_columns(path: Path, wanted: Collection[str]) -> tuple[list[str], str] | None:
    """The columns of the data file `path` as far as they can be told before `datasets` reads
    it, and where they were told, for messages: a CSV file's header or a Parquet file's schema
    (the file), or the keys of a JSON Lines file's rows, read until each of `wanted` is found
    (json_lines_keys: the file, or the part of it that `datasets` finds its columns in). None
    where its first row cannot tell (another format, a JSON array): they are checked once read."""
    names = first_row_columns(path)
    if names is None or path.suffix.lower() not in JSON_SUFFIXES:
        return None if names is None else (names, str(path))
    keys, whole = json_lines_keys(path, wanted)
    if whole:
        return keys, str(path)
    head = f"its first {JSON_COLUMNS_BYTES >> 20} MiB"
    return keys, f"the rows of {path} in {head}, where `datasets` finds the columns of JSON Lines"


def check_file_columns(
    files: Sequence[Path], columns: dict[str, str], together: str | None = None
) -> None:
    """Each of `files` whose columns told_columns tells has every one of `columns` ({column: the
    option that names it}): a wrong column fails with the config's checks, naming the file, not
    once the files have been read under `datasets`' progress bars.

    `together` is the option that gave files `datasets` reads as one dataset (data=pairs'
    data.paths, a card-less dataset's splits): it takes the columns of the first file, fills
    those another file lacks with nulls, and refuses, in a traceback, a file with a column
    more. Such a file, and one that lacks a column of `columns` that the first file has, is
    refused first, naming both files: it is the files that disagree, not the option. A column
    more is told only against a first file's header or schema: of JSON rows, only those up to
    the ones that hold `columns` are read, and later rows may hold more keys."""
    told = [(file, *found) for file in files if (found := told_columns(file, columns)) is not None]
    if together and told and told[0][0] == files[0]:  # else the first file's columns are unknown
        first, first_names, _ = told[0]
        exact = first.suffix.lower() not in JSON_SUFFIXES
        for file, names, _ in told[1:]:
            more = set(names) - set(first_names) if exact else set()
            if more or set(columns) & set(first_names) - set(names):
                raise ValueError(
                    f"{together}: {file} has the columns {names} and {first} has {first_names}, "
                    "but the files of a dataset must share their columns (`datasets` gives them "
                    "all the first file's); give every file the same columns"
                )
    for file, names, where in told:
        late = first_met_late(file, [c for c in columns if c not in names])
        for column, key in columns.items():
            if column in late:
                raise ValueError(
                    f"{key}={column!r} is first met in a row of {file} past its first "
                    f"{JSON_COLUMNS_BYTES >> 20} MiB, where `datasets` has taken the columns of "
                    f"JSON Lines to be {names} and refuses a row with another; give the rows "
                    f"before it the key {column!r} too (null where they have none), or put a row "
                    "that holds it first"
                )
            check_column(names, column, where, key)


def first_met_late(path: Path, columns: Collection[str]) -> set[str]:
    """Those of `columns` that are keys of a row of the JSON Lines file `path` starting past the
    first JSON_COLUMNS_BYTES, where `datasets` took its columns from (json_lines_keys): a column
    missing there is then the file's fault, not the option's. Read only on the way to an error,
    and fast, as a typo in an option takes this way too: a row is parsed only if its bytes hold
    a column's name in quotes."""
    if not columns or path.suffix.lower() not in JSON_SUFFIXES:
        return set()
    quoted = {json.dumps(column, ensure_ascii=False).encode(): column for column in columns}
    met = set()
    with open(path, "rb") as file:
        file.seek(JSON_COLUMNS_BYTES)
        file.readline()  # the rest of a row that starts within the first bytes
        for line in file:
            if not any(name in line for name in quoted):
                continue
            try:
                row = json.loads(line)
            except ValueError:  # not JSON, or not UTF-8: reading names it
                continue
            if isinstance(row, dict):
                met |= {column for column in quoted.values() if column in row}
                if len(met) == len(quoted):
                    break
    return met


# The `datasets` types of a text column: strings, or nulls only (rows that hold no document)
TEXT_DTYPES = ("string", "large_string", "null")


def with_text_column(ds, column: str, where: str):
    """`ds` reduced to one string column named "text". A column of another type (numbers, lists
    of words, JSON values of mixed types) is refused in one line, where it failed in a traceback
    as its bytes were counted or its rows tokenized."""
    if ds.column_names is not None:  # a stream may not know them
        check_column(ds.column_names, column, where, "data.text_column")
    feature = ds.features.get(column) if ds.features is not None else None
    if feature is not None and getattr(feature, "dtype", None) not in TEXT_DTYPES:
        raise ValueError(
            f"data.text_column={column!r} of {where} holds {feature}, not text; set "
            "data.text_column to a column of strings, or make every value of it a string"
        )
    ds = ds.select_columns([column])
    return ds if column == "text" else ds.rename_column(column, "text")


def is_blank(path: Path) -> bool:
    """Whether the file `path` holds nothing but ASCII whitespace, if anything, read only up to
    its first other byte: a file of text is told apart in its first chunk, not read whole."""
    with open(path, "rb") as file:
        while chunk := file.read(1 << 16):
            if chunk.strip():  # bytes.strip: ASCII whitespace, what an empty file may hold
                return False
    return True


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

    # an empty file holds no document (and `datasets` cannot type its rows)
    parts = []  # (builder, the files' documents, the files), as naming_unreadable_stream takes
    for builder, read in _reads([f for f in files if not is_blank(f)]):
        # utf-8-sig: a byte-order mark that starts a file (Windows editors write one) is not
        # text; read as utf-8, it was a character of the vocabulary and of the first document
        text_options = {"sample_by": "paragraph", "encoding": "utf-8-sig"}
        options = text_options if builder == "text" else {}
        ds = read_files(builder, read, cache_dir, key, streaming, **options)
        where = ", ".join(map(str, read))
        text = with_text_column(ds, "text" if builder == "text" else text_column, where)
        parts.append((builder, text, read))
    if not parts:
        shown = ", ".join(str(f) for f in files)
        raise ValueError(f"{key}: every file is empty ({shown}); point it at some text")
    if streaming:
        return naming_unreadable_stream(parts, cache_dir, key)
    return datasets.concatenate_datasets([text for _, text, _ in parts])


def _reads(files: Sequence[Path]) -> list[tuple[str, list[Path]]]:
    """`files` in the reads that load_text_files makes of them, in order, each with its
    `datasets` builder: text files that follow one another in one read, a JSON Lines file alone.

    Each read costs `datasets` a builder, and one made whole an Arrow file of its own: about
    10 ms, which a corpus of one small file per document paid for each. The text builder
    splits every file of a read into paragraphs on its own, and gives all the one column
    "text", so text files read together give the documents that they give read one by one.
    The files of one JSON read would all take the columns of the first (a key that another
    file has more fails the read), so each is read alone, and its columns are its own."""
    reads: list[tuple[str, list[Path]]] = []
    for f in files:
        builder = TEXT_BUILDERS[f.suffix.lower()]  # expand_paths took no other
        if builder == "text" and reads and reads[-1][0] == "text":
            reads[-1][1].append(f)
        else:
            reads.append((builder, [f]))
    return reads


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
    with naming_unreadable_files(builder, files, cache_dir, key):
        ds = load_local(builder, files, datasets_cache_for(files, cache_dir), streaming, **options)
        if not streaming:  # a stream decodes its rows as it reads them
            check_strings([ds])
        return ds


def check_strings(parts: Iterable["datasets.Dataset"]) -> None:
    """Every string of the datasets `parts` is UTF-8, else pyarrow's ArrowInvalid (for
    naming_unreadable_files): the JSON and Parquet readers keep a string's bytes as they are,
    and `datasets` failed only once the rows were decoded, later, naming no file. In C++, over
    the Arrow data (10 ms for 200 MB of text in memory)."""
    for ds in parts:
        ds.data.validate(full=True)


def _read_faults() -> tuple[type[Exception], ...]:
    """What a `datasets` builder raises, bare, reading a file that it cannot read: pandas',
    pyarrow's and decoding errors (ValueError), and pyarrow's others of a damaged file (an
    OSError: "Couldn't deserialize thrift"). Read whole, it wraps them in its
    DatasetGenerationError; a stream, and a file read alone as one (_unreadable), raise them."""
    import pyarrow  # ships with `datasets`

    return (ValueError, OSError, pyarrow.ArrowException)


@contextmanager
def naming_unreadable_files(
    builder: str, files: Sequence[Path], cache_dir: Path, key: str, streamed: bool = False
) -> Iterator[None]:
    """Inside, `datasets` failing to read the local `files` with its `builder` is a one-line
    ValueError naming the file and the fault, after `key`; a full disk (not the files' fault:
    build_once names it) and a builder or files this cannot tell about are left as they are.
    `streamed`: a stream of them is read inside, which raises the builder's own errors."""
    import datasets
    import pyarrow  # ships with `datasets`

    # ArrowInvalid: a file that is not Parquet fails as its schema is read, before generating
    faults = (datasets.exceptions.DatasetGenerationError, pyarrow.ArrowInvalid)
    if streamed:
        faults = _read_faults()
    # The JSON builder logs a file it cannot read (an ERROR line, counting rows from 0) before it
    # raises: the one line below says it, with the file's line number
    json_log = logging.getLogger("datasets.packaged_modules.json.json")
    level = json_log.level
    json_log.setLevel(logging.CRITICAL)
    try:
        yield
    except faults as error:
        if disk_full_cause(error) is not None or not files or builder not in READ_FIXES:
            raise
        raise ValueError(f"{key}: {_unreadable(builder, files, cache_dir, error)}") from error
    finally:
        json_log.setLevel(level)


def naming_unreadable_stream(
    parts: Sequence[tuple[str, "datasets.IterableDataset", Sequence[Path]]],
    cache_dir: Path,
    key: str,
) -> "datasets.IterableDataset":
    """The rows of the streams of `parts`, one after another, as one stream, in which a local
    file that cannot be read is a one-line error naming it, as naming_unreadable_files makes it
    where files are read whole: a stream reads its files only as it is iterated, long after it
    was made. Each part is (the `datasets` builder, its stream, the local files it reads)."""
    import datasets

    features = parts[0][1].features  # each part's, where they agree
    same = all(stream.features == features for _, stream, _ in parts)
    return datasets.IterableDataset.from_generator(
        _rows_naming_files,
        features=features if same else None,
        gen_kwargs={"parts": tuple(parts), "cache_dir": cache_dir, "key": key},
    )


def _rows_naming_files(
    parts: Sequence[tuple[str, "datasets.IterableDataset", Sequence[Path]]],
    cache_dir: Path,
    key: str,
) -> Iterator[dict]:
    """naming_unreadable_stream's rows."""
    for builder, stream, files in parts:
        with naming_unreadable_files(builder, files, cache_dir, key, streamed=True):
            yield from stream


def _unreadable(builder: str, files: Sequence[Path], cache_dir: Path, error: Exception) -> str:
    """Which of `files` `datasets` failed to read with `error`, why, and what to check, in one
    line. A JSON Lines file is read here line by line: `datasets` counts the rows of its message
    from the start of its 10 MB chunk, and calls a cut-off line an "invalid encoding". Of
    several files where that finds nothing, each is read alone as a stream (nothing cached)
    until one fails: the error does not say which file it comes from. Where none fails alone,
    they fail as one dataset: their columns disagree in a way their first rows did not tell
    (check_file_columns)."""
    if builder == "json":
        for file in files:
            if problem := json_lines_problem(file):
                return f"cannot read {file} ({problem}); {READ_FIXES[builder]}"
    if len(files) > 1:
        for file in files:
            try:
                for _ in load_local(builder, [file], datasets_cache_for([file], cache_dir), True):
                    pass
            except _read_faults() as file_error:
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
