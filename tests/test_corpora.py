"""Language-model corpora beyond the embedded one: local text files, the Hub, streaming,
parallel tokenisation, reused tokenizers, and cache entries built once under concurrency."""

import json
import logging
import re
import socket
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import datasets
import huggingface_hub
import numpy as np
import pytest

from data.lm import LMDataModule
from data.lm_text import LMDataConfig
from data.local_files import TEXT_BUILDERS, expand_paths, load_text_files, read_files
from data.sources import hub_reachable
from data.tokenizer import BPETokenizer, CharTokenizer, load_tokenizer
from helpers import ROOT, clean_env, write_hub_dataset

PARAGRAPHS = [
    f"Paragraph {i} of 0123456789: the quick brown fox {'jumps ' * (i % 5)}over dog {i}."
    for i in range(40)
]


@pytest.fixture
def corpus(tmp_path) -> Path:
    """A folder of .txt, .md (one document per paragraph) and .jsonl (one per row) files."""
    folder = tmp_path / "corpus"
    (folder / "nested").mkdir(parents=True)
    (folder / "a.txt").write_text("\n\n".join(PARAGRAPHS[:20]) + "\n")
    (folder / "nested" / "b.md").write_text("\n\n".join(PARAGRAPHS[20:30]))
    rows = [{"body": p, "id": i} for i, p in enumerate(PARAGRAPHS[30:])]
    (folder / "nested" / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "ignored.csv").write_text("not,read\n")
    return folder


def prepared(**options) -> LMDataModule:
    module = LMDataModule(block_size=8, batch_size=4, **options)
    module.prepare_data()
    module.setup()
    return module


def split_text(module: LMDataModule, split: str) -> str:
    return module.tokenizer.decode(np.asarray(module._split(split)).tolist())


def test_text_files_folder_documents_and_split(corpus, tmp_path):
    module = prepared(
        source="text_files", paths=[str(corpus)], text_column="body", cache_dir=tmp_path
    )
    # Files in sorted order (a.txt, nested/b.md, nested/c.jsonl), one in ten documents to val.
    val = [p for i, p in enumerate(PARAGRAPHS) if i % 10 == 9]
    train = [p for i, p in enumerate(PARAGRAPHS) if i % 10 != 9]
    assert split_text(module, "val") == "\n\n".join(val)
    assert split_text(module, "train") == "\n\n".join(train)
    meta = json.loads((module.cache_entry / "meta.json").read_text())
    assert meta["val_chars"] == len("\n\n".join(val))
    assert [Path(f).name for f, *_ in meta["key"]["files"]] == ["a.txt", "b.md", "c.jsonl"]


def test_a_folder_named_like_a_text_file_is_searched_not_read(corpus, tmp_path):
    """A folder inside data.paths' folder whose name ends in .txt is searched for files like any
    other (it was opened as a file: IsADirectoryError in a traceback)."""
    (corpus / "notes.txt").mkdir()
    (corpus / "notes.txt" / "d.md").write_text("\n\n".join(PARAGRAPHS[:10]))
    files = expand_paths([str(corpus)], list(TEXT_BUILDERS))
    names = ["a.txt", "nested/b.md", "nested/c.jsonl", "notes.txt/d.md"]
    assert files == [corpus / name for name in names]
    module = prepared(
        source="text_files", paths=[str(corpus)], text_column="body", cache_dir=tmp_path
    )
    assert split_text(module, "train").count(PARAGRAPHS[0]) == 2  # a.txt's and d.md's


def test_a_file_or_folder_whose_name_holds_glob_characters_is_read_by_its_name(tmp_path):
    """ "notes[1].txt" as a glob matches "notes1.txt" only: a file or folder of that name is
    taken as named (the file was refused: no file matches), and a glob still matches."""
    (tmp_path / "run[1]").mkdir()
    (tmp_path / "run[1]" / "notes[1].txt").write_text("\n\n".join(PARAGRAPHS[:10]))
    (tmp_path / "notes1.txt").write_text(PARAGRAPHS[10])
    named = [str(tmp_path / "run[1]" / "notes[1].txt"), str(tmp_path / "run[1]")]
    assert expand_paths(named, list(TEXT_BUILDERS)) == [tmp_path / "run[1]" / "notes[1].txt"]
    glob = str(tmp_path / "notes[0-9].txt")
    assert expand_paths([glob], list(TEXT_BUILDERS)) == [tmp_path / "notes1.txt"]
    for streaming in (False, True):  # `datasets` given it, which reads names as globs too
        module = prepared(source="text_files", paths=named, cache_dir=tmp_path, streaming=streaming)
        assert PARAGRAPHS[9] == split_text(module, "val")


def test_a_file_named_twice_is_read_once(corpus, tmp_path):
    """A folder and a glob inside it, or a link to a file of it, name its files twice: each is
    read once, where first named (read twice, its documents trained twice, and a document that
    one copy gave to validation the other trained on)."""
    (tmp_path / "link.txt").symlink_to(corpus / "a.txt")
    once = prepared(
        source="text_files", paths=[str(corpus)], text_column="body", cache_dir=tmp_path / "once"
    )
    twice = prepared(
        source="text_files",
        paths=[
            str(corpus),
            str(corpus / "*.txt"),
            str(corpus / "**" / "*.md"),
            str(tmp_path / "link.txt"),
        ],
        text_column="body",
        cache_dir=tmp_path / "twice",
    )
    for split in ("train", "val"):
        assert split_text(twice, split) == split_text(once, split)


@pytest.mark.parametrize("streaming", [False, True])
def test_a_byte_order_mark_is_not_text(tmp_path, streaming):
    """Windows editors start a UTF-8 file with a byte-order mark: it is not read as a character
    of the first document and the vocabulary (nor, for BPE, as three bytes), in any file of a
    read, streamed or not; the files read as those without it."""
    for folder, encoding in (("plain", "utf-8"), ("marked", "utf-8-sig")):
        (tmp_path / folder).mkdir()
        for name, part in (("a.txt", PARAGRAPHS[:20]), ("b.md", PARAGRAPHS[20:])):
            (tmp_path / folder / name).write_text("\n\n".join(part), encoding=encoding)
    modules = {
        folder: prepared(
            source="text_files",
            paths=[str(tmp_path / folder)],
            cache_dir=tmp_path / f"{folder}_cache",
            streaming=streaming,
        )
        for folder in ("plain", "marked")
    }
    assert "\ufeff" not in modules["marked"].tokenizer.chars
    for split in ("train", "val"):
        assert split_text(modules["marked"], split) == split_text(modules["plain"], split)


@pytest.mark.parametrize("streaming", [False, True])
def test_val_paths_name_the_validation_text(corpus, tmp_path, streaming):
    """data.paths is then all training text and data.val_paths all validation text, whole: a
    corpus's train.txt + valid.txt, or nanoGPT's split of tiny-shakespeare."""
    valid, train = tmp_path / "valid.txt", tmp_path / "train.txt"
    valid.write_text("\n\n".join(PARAGRAPHS[5:8]) + "\n")
    # More documents than a `datasets.map` batch holds: batches with no validation text.
    many = [f"{i}: {PARAGRAPHS[i % 40]}" for i in range(2500)]
    train.write_text("\n\n".join(many))
    module = prepared(
        source="text_files", paths=[str(train)], val_paths=[str(valid)], cache_dir=tmp_path,
        streaming=streaming,
    )  # fmt: skip
    assert split_text(module, "train") == "\n\n".join(many)
    assert split_text(module, "val") == "\n\n".join(PARAGRAPHS[5:8])
    options = dict(source="text_files", paths=[str(corpus / "a.txt")], cache_dir=tmp_path)
    # Other validation files are another cache entry, and the split by fraction a third.
    valid.write_text(PARAGRAPHS[9])
    assert split_text(prepared(**options, val_paths=[str(valid)]), "val") == PARAGRAPHS[9]
    by_fraction = prepared(**options)
    assert split_text(by_fraction, "val") == "\n\n".join(PARAGRAPHS[9:20:10])


def test_val_paths_errors_name_the_key(corpus, tmp_path):
    options = dict(source="text_files", paths=[str(corpus / "a.txt")], cache_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match=r"data.val_paths: no file at .*nope.txt"):
        prepared(**options, val_paths=[str(tmp_path / "nope.txt")])
    with pytest.raises(ValueError, match="data.val_paths is only read by source=text_files"):
        LMDataModule(val_paths=[str(corpus / "a.txt")])
    with pytest.raises(ValueError, match=r"data.val_paths: .*a.txt is also in data.paths"):
        prepared(
            source="text_files", paths=[str(corpus)], val_paths=[str(corpus / "a.txt")],
            text_column="body",  # c.jsonl's, which the config checks first
        )  # fmt: skip
    unknown = tmp_path / "unknown.txt"
    unknown.write_text("\u2603\u2603\u2603")  # characters the training text lacks
    with pytest.raises(ValueError, match="the val split is empty: data.val_paths holds no text"):
        prepared(**options, val_paths=[str(unknown)])


@pytest.mark.parametrize("source", ["text_files", "text_files streamed", "shakespeare"])
def test_local_files_are_read_without_a_network_request(corpus, tmp_path, monkeypatch, source):
    """`datasets` counts a download of its packaged builders (text, json) with a request to S3
    at each load_dataset call, and text_files made one call a file (a .jsonl file's still is):
    a corpus of 200 small files waited half a minute on it, as long as the DNS took to fail
    offline. Files on this machine are read with no request, and the switch that `datasets`
    reads is set back after."""
    hosts = []

    def no_network(host, *args, **kwargs):
        hosts.append(host)
        raise OSError("this test has no network")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    # as `datasets` has them where HF_HUB_OFFLINE and HF_UPDATE_DOWNLOAD_COUNTS are unset
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_UPDATE_DOWNLOAD_COUNTS", True)
    options = dict(source=source.split()[0], streaming=source.endswith("streamed"))
    if options["source"] == "text_files":
        options |= dict(paths=[str(corpus)], text_column="body")
    assert prepared(cache_dir=tmp_path, **options).tokenizer.vocab_size > 0
    assert hosts == []
    assert datasets.config.HF_UPDATE_DOWNLOAD_COUNTS is True


def test_text_files_globs_and_edits_make_a_new_entry(corpus, tmp_path):
    options = dict(source="text_files", paths=[str(corpus / "*.txt")], cache_dir=tmp_path)
    first = prepared(**options).cache_entry
    assert prepared(**options).cache_hit
    with open(corpus / "a.txt", "a") as f:
        f.write("\nA new paragraph, appended.\n")
    edited = prepared(**options)
    assert not edited.cache_hit and edited.cache_entry != first
    assert "appended" in split_text(edited, "train") + split_text(edited, "val")


@pytest.mark.parametrize(
    ("paths", "error", "message"),
    [
        (
            ["missing.txt"],
            FileNotFoundError,
            "data.paths: no file at .*missing.txt; check the path",
        ),
        (["*.rst"], FileNotFoundError, r"data.paths: no file matches '.*\*.rst'; check the glob"),
        (["ignored.csv"], ValueError, r"ignored.csv has an unsupported extension; use one of .txt"),
        (
            ["nested/c.jsonl"],
            ValueError,
            r"data.text_column='text' is not a column of .*c.jsonl; "
            r"available columns: \['body', 'id'\]",
        ),
    ],
)
def test_text_files_errors_name_the_value_and_the_fix(corpus, tmp_path, paths, error, message):
    paths = [str(corpus / p) for p in paths]
    with pytest.raises(error, match=message):
        prepared(source="text_files", paths=paths, cache_dir=tmp_path)
    assert not list(tmp_path.glob("lm/*/meta.json"))  # nothing half-built is left as an entry


def test_empty_and_broken_files(corpus, tmp_path, caplog):
    (corpus / "empty.txt").write_text("\n\n")
    with pytest.raises(ValueError, match=r"data.paths: every file is empty \(.*empty.txt\)"):
        prepared(source="text_files", paths=[str(corpus / "empty.txt")], cache_dir=tmp_path)
    # Empty files beside real ones are skipped: they hold no document.
    module = prepared(source="text_files", paths=[str(corpus / "*.txt")], cache_dir=tmp_path)
    assert "Paragraph 0 " in split_text(module, "train")
    broken = corpus / "broken.jsonl"
    broken.write_text('{"text": "fine"}\nnot json at all\n')
    message = (
        f"data.paths: cannot read {broken} (line 2 is not JSON: Expecting value at column 1); "
        "check that it is JSON Lines, one object per line, or a JSON array of objects"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        prepared(source="text_files", paths=[str(broken)], cache_dir=tmp_path)
    assert "Failed to load JSON" not in caplog.text  # `datasets`' own log line: ours says it


JSON_FIX = "check that it is JSON Lines, one object per line, or a JSON array of objects"
ROWS = b'{"text": "some words"}\n' * 100


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize(
    ("name", "content", "why", "fix"),
    [
        ("not_utf8.txt", b"some words\n\n" * 100 + b"\xff\xfe\n",
         "'utf-8' codec can't decode byte 0xff in position 1200: invalid start byte",
         "check that it is UTF-8 text"),
        ("cut_off.jsonl", ROWS + b'{"text": "cut\n',
         "line 101 is not JSON: Unterminated string starting at column 10", JSON_FIX),
        ("not_an_object.jsonl", ROWS + b"[1, 2]\n", "line 101 is not a JSON object: [1, 2]",
         JSON_FIX),
        ("json_not_utf8.jsonl", ROWS + b'{"text": "\xff\xfe"}\n', "line 101 is not UTF-8",
         JSON_FIX),
    ],
    ids=["text_not_utf8", "cut_off_line", "not_an_object", "json_not_utf8"],
)  # fmt: skip
def test_a_file_datasets_cannot_read_is_named_streamed_or_not(
    corpus, tmp_path, streaming, name, content, why, fix
):
    """A stream reads its files only as it is iterated, long after `datasets` made it: a file
    it could not read failed there (training the tokenizer) in a line naming no file. A JSON
    string that is not UTF-8 is read as it is, and failed only once decoded, streamed or not."""
    bad = tmp_path / name
    bad.write_bytes(content)
    options = dict(source="text_files", cache_dir=tmp_path / "cache", streaming=streaming)
    for key, paths, val_paths in [
        ("data.paths", [corpus / "a.txt", bad], []),
        ("data.val_paths", [corpus / "a.txt"], [bad]),
    ]:
        message = f"{key}: cannot read {bad} ({why}); {fix}"
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            prepared(**options, paths=paths, val_paths=val_paths)
    assert not list((tmp_path / "cache").glob("lm/*/meta.json"))


@pytest.mark.parametrize("streaming", [False, True])
def test_a_damaged_file_of_a_hub_directory_is_named_streamed_or_not(tmp_path, streaming):
    """A Parquet file whose footer reads well but whose pages are damaged: pyarrow fails on its
    rows with an OSError, which `datasets` reading the directory whole wraps; the file was
    looked for among the directory's by reading each alone, which let that OSError out in a
    traceback. A stream let it out as its rows were read, naming no file."""
    folder = write_hub_dataset(
        tmp_path / "hub", {"train": PARAGRAPHS * 3, "validation": PARAGRAPHS[:5]}
    )
    damaged = folder / "data" / "validation-00000-of-00001.parquet"
    data = bytearray(damaged.read_bytes())
    data[8:40] = b"\xff" * 32  # the first page's header, just after the magic bytes
    damaged.write_bytes(bytes(data))
    fix = "check that it is a whole Parquet file"
    message = rf"^data.name: cannot read {re.escape(str(damaged))} \(.+\); {fix}$"
    with pytest.raises(ValueError, match=message):
        prepared(source="hub", name=str(folder), cache_dir=tmp_path, streaming=streaming)
    assert not list(tmp_path.glob("lm/*/meta.json"))


@pytest.mark.parametrize("first_row_has_text", [False, True])
def test_jsonl_rows_without_the_text_column_hold_no_document(tmp_path, first_row_has_text):
    """`datasets` reads a JSON Lines file's columns from all of its first rows, null where a row
    lacks a key: a file whose first row lacks data.text_column reads well (the config refused
    it by that row), and a row without it is no document (it failed in a traceback)."""
    rows = [{"id": i, "text": p} for i, p in enumerate(PARAGRAPHS[:20])]
    rows[0 if not first_row_has_text else 5] = {"id": "no text"}
    path = tmp_path / "sparse.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    module = prepared(source="text_files", paths=[str(path)], cache_dir=tmp_path)
    texts = [row.get("text") for row in rows]  # one in ten rows to val, by its place
    assert split_text(module, "val") == "\n\n".join(t for i, t in enumerate(texts) if i % 10 == 9)
    train = [t for i, t in enumerate(texts) if i % 10 != 9 and t is not None]
    assert split_text(module, "train") == "\n\n".join(train)


def test_a_jsonl_file_whose_rows_lack_the_text_column_is_refused_before_it_is_read(tmp_path):
    """Refused with the config, by the rows that `datasets` takes the columns from, its first
    10 MiB: past them, a row with the column fails `datasets`' read as a column too many."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"body": "a row"}\n' * 300)
    message = (
        f"data.text_column='text' is not a column of {rows}; available columns: ['body']; set "
        "data.text_column"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        LMDataConfig(source="text_files", paths=[str(rows)])
    late = tmp_path / "late.jsonl"
    body = '{"body": "' + "a row " * 100 + '"}\n'
    late.write_text(body * ((10 << 20) // len(body) + 1) + '{"body": "", "text": "too late"}\n')
    message = (
        f"data.text_column='text' is first met in a row of {late} past its first 10 MiB, where "
        "`datasets` has taken the columns of JSON Lines to be ['body'] and refuses a row with "
        "another; give the rows before it the key 'text' too (null where they have none), or "
        "put a row that holds it first"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        LMDataConfig(source="text_files", paths=[str(late)])
    never = tmp_path / "never.jsonl"  # as large, and no row holds the column: the option's fault
    never.write_text(body * ((10 << 20) // len(body) + 2))
    message = (
        f"data.text_column='text' is not a column of the rows of {never} in its first 10 MiB, "
        "where `datasets` finds the columns of JSON Lines; available columns: ['body']; set "
        "data.text_column"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        LMDataConfig(source="text_files", paths=[str(never)])
    # as `datasets` would have refused it once read
    with pytest.raises(ValueError, match=r"^data.paths: cannot read .*column names don't match"):
        read_files("json", [late], tmp_path / "cache", "data.paths")


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize(
    ("values", "held"),
    [
        ([1000 * i for i in range(40)], "Value('int64')"),
        ([p.split() for p in PARAGRAPHS], "List(Value('string'))"),
        ([p if i % 2 else i for i, p in enumerate(PARAGRAPHS)], "Json(decode=True)"),
    ],
    ids=["numbers", "lists_of_words", "mixed"],
)
def test_a_text_column_that_is_not_text_is_refused_in_one_line(tmp_path, streaming, values, held):
    """A column of numbers, of lists or of JSON values of several types is no text: refused
    naming the column, its type and the file or dataset (it failed in a traceback as its bytes
    were counted, or as a stream's rows were split)."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": value}) + "\n" for value in values))
    message = (
        f"data.text_column='text' of {rows} holds {held}, not text; set data.text_column to a "
        "column of strings, or make every value of it a string"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        prepared(source="text_files", paths=[str(rows)], cache_dir=tmp_path, streaming=streaming)
    folder = write_hub_dataset(tmp_path / "hub", {"train": list(range(40))})
    message = rf"^data.text_column='text' of the Hub dataset {re.escape(str(folder))} holds Value"
    with pytest.raises(ValueError, match=message):
        prepared(source="hub", name=str(folder), cache_dir=tmp_path, streaming=streaming)


@pytest.mark.parametrize("streaming", [False, True])
def test_text_files_read_together_give_the_documents_of_each_read_alone(tmp_path, streaming):
    """Text files that follow one another are read in one `datasets` read, not one a file: each
    still ends its own last paragraph, an empty one holds none, and .jsonl files between them
    are each read alone, so that their columns may differ."""
    files = {
        "1.txt": "one\n\ntwo",  # no line break after its last paragraph
        "2.md": "three\n\n\n\nfour\n",
        "3.txt": " \n",
        "4.txt": "five",
        "5.jsonl": '{"text": "six"}\n',
        "6.jsonl": '{"text": "seven", "id": 7}\n',  # a column more than 5.jsonl
        "7.txt": "eight\n\nnine\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    paths = [tmp_path / name for name in files]
    cache = tmp_path / "cache"

    def documents(paths: list[Path]) -> list[str]:
        return [row["text"] for row in load_text_files(paths, "text", cache, streaming)]

    together = documents(paths)
    assert [text.strip("\n") for text in together] == [
        "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"
    ]  # fmt: skip
    alone = [text for path in paths if path.name != "3.txt" for text in documents([path])]
    assert together == alone


def test_a_file_is_told_empty_from_its_first_bytes_not_read_whole(tmp_path, monkeypatch):
    """Empty is nothing but ASCII whitespace, as ever; a file of text says it is not in its first
    bytes, so a large one is no longer read into memory whole only to be told apart."""
    big = tmp_path / "big.txt"
    big.write_bytes(b"x" * (32 << 20))
    one_row = datasets.Dataset.from_dict({"text": ["x"]})
    monkeypatch.setattr("data.local_files.read_files", lambda *args, **kwargs: one_row)
    tracemalloc.start()
    try:
        load_text_files([big], "text", tmp_path / "cache")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak} bytes held to tell whether a 32 MiB file is empty"
    # Text after more whitespace than the first bytes read is found; whitespace alone is empty.
    blank, late = tmp_path / "blank.txt", tmp_path / "late.txt"
    blank.write_bytes(b" \n\t\r\x0b\x0c" * 50_000)
    late.write_bytes(b" \n" * 100_000 + b"x")
    assert load_text_files([blank, late], "text", tmp_path / "cache")["text"] == ["x"]
    with pytest.raises(ValueError, match=r"data.paths: every file is empty \(.*blank.txt\)"):
        load_text_files([blank], "text", tmp_path / "cache")


@pytest.mark.parametrize("tokenizer", ["char", "bpe"])
def test_streaming_and_parallel_tokenisation_build_the_same_entry(corpus, tmp_path, tokenizer):
    """The cache key ignores streaming and num_proc because they don't change the tokens."""
    options = dict(source="text_files", paths=[str(corpus)], text_column="body")
    options |= dict(tokenizer=tokenizer, bpe_vocab_size=300)
    built = {
        name: prepared(cache_dir=tmp_path / name, **options, **extra)
        for name, extra in [
            ("plain", {}),
            ("stream", {"streaming": True}),
            ("procs", {"num_proc": 2}),
        ]
    }
    entries = {name: module.cache_entry for name, module in built.items()}
    assert len({entry.name for entry in entries.values()}) == 1
    for name in ("stream", "procs"):
        for file in ("train.bin", "val.bin", "tokenizer.json", "tinyformer_tokenizer.json"):
            assert (entries[name] / file).read_bytes() == (entries["plain"] / file).read_bytes()


def test_streaming_shakespeare_matches_the_in_memory_build(tmp_path):
    plain = prepared(cache_dir=tmp_path / "plain")
    stream = prepared(cache_dir=tmp_path / "stream", streaming=True)
    for file in ("train.bin", "val.bin"):
        assert (plain.cache_entry / file).read_bytes() == (stream.cache_entry / file).read_bytes()


def test_hub_source_offline_points_to_text_files(tmp_path, monkeypatch):
    # Offline mode, as HF_HUB_OFFLINE=1 sets it at import time: the user's way to ask for it,
    # and one that keeps the test off the network wherever it runs.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    module = LMDataModule(
        source="hub", name="wikitext", config="wikitext-2-raw-v1", cache_dir=tmp_path
    )
    message = (
        r"data.name: cannot download wikitext \(wikitext-2-raw-v1\): the Hugging Face Hub is "
        r"unreachable \(offline\); use local files instead: data=text_files 'data.paths=\["
    )
    with pytest.raises(ValueError, match=message):
        module.prepare_data()


@pytest.fixture
def hub_on_this_machine(monkeypatch):
    """hub_at(sock): the Hub's endpoint (HF_ENDPOINT, as `datasets` and huggingface_hub read it)
    made a socket on 127.0.0.1, with no proxy in the way; it returns the endpoint. A socket
    bound but not listening refuses connections: a Hub that cannot be reached, at once and on
    any machine, online or not."""
    for variable in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(variable, raising=False)
        monkeypatch.delenv(variable.upper(), raising=False)

    def hub_at(sock: socket.socket) -> str:
        endpoint = f"http://127.0.0.1:{sock.getsockname()[1]}"
        monkeypatch.setattr(datasets.config, "HF_ENDPOINT", endpoint)
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", endpoint)
        # and the URLs the libraries made of HF_ENDPOINT as they were imported, so that their
        # requests go to the socket too, and not to the real Hub on a machine that has one
        files = "/{repo_id}/resolve/{revision}/{filename}"
        monkeypatch.setattr(
            huggingface_hub.constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + files
        )
        files = "/datasets/{repo_id}/resolve/{revision}/{path}"
        monkeypatch.setattr(datasets.config, "HUB_DATASETS_URL", endpoint + files)
        return endpoint

    return hub_at


@pytest.fixture
def refusing():
    """A socket on 127.0.0.1 that refuses connections (bound, not listening)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock


@pytest.fixture
def listening():
    """A socket on 127.0.0.1 that accepts connections (the kernel completes the handshake)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock


@pytest.fixture
def stalled():
    """A socket on 127.0.0.1 that answers no further connection: listening, with its queue of
    one filled (Linux drops the handshakes that would overflow it, so a connection times out)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(0)
        with socket.create_connection(sock.getsockname()):
            yield sock


@pytest.fixture
def retries(caplog):
    """retries(): the retries huggingface_hub logged ("Retrying in 8s [Retry 5/5]."), logged
    whatever the verbosity set in the environment."""
    caplog.set_level(logging.WARNING, logger="huggingface_hub")
    return lambda: [r.getMessage() for r in caplog.records if "Retry" in r.getMessage()]


def test_an_unreachable_hub_is_explained_at_once(tmp_path, hub_on_this_machine, refusing, retries):
    """huggingface_hub retried a Hub that could not be reached five times, 1 + 2 + 4 + 8 + 8 s,
    before `datasets` gave up: the one line saying so came after about 24 s. Found unreachable
    by one connection, `datasets` is sent offline and fails at once, without a retry."""
    hub_on_this_machine(refusing)
    module = LMDataModule(
        source="hub", name="wikitext", config="wikitext-2-raw-v1", cache_dir=tmp_path
    )
    with pytest.raises(ValueError, match=r"unreachable \(offline\); use local files instead"):
        module.prepare_data()
    assert not retries()  # the ~24 s of waiting were those retries' sleeps
    assert not datasets.config.HF_HUB_OFFLINE  # offline only for that load
    assert not huggingface_hub.constants.HF_HUB_OFFLINE


@pytest.mark.parametrize("streaming", [False, True])
def test_a_cached_hub_dataset_loads_with_the_hub_unreachable(
    tmp_path, monkeypatch, hub_on_this_machine, refusing, retries, streaming
):
    """A Hub dataset that `datasets` has cached loads from its cache when the Hub cannot be
    reached (`datasets` takes its latest cached version), as it did after the retries, and now
    at once. The cache entry is one `datasets` wrote: that of a directory laid out as a Hub
    dataset repository, loaded by its path, is the one the Hub dataset of its name would have."""
    hub_on_this_machine(refusing)
    folder = write_hub_dataset(
        tmp_path / "stories", {"train": PARAGRAPHS * 3, "validation": PARAGRAPHS[:5]}
    )
    from_folder = prepared(source="hub", name=str(folder), cache_dir=tmp_path)
    monkeypatch.chdir(tmp_path / "stories" / "data")  # "stories" names no directory here
    from_cache = prepared(source="hub", name="stories", cache_dir=tmp_path, streaming=streaming)
    assert from_cache.cache_entry != from_folder.cache_entry  # read again, not reused
    for split in ("train", "val"):
        assert split_text(from_cache, split) == split_text(from_folder, split)
    assert not retries()


def test_a_hub_dataset_cached_in_another_config_is_explained_in_one_line(
    tmp_path, monkeypatch, hub_on_this_machine, refusing
):
    """Offline, with the dataset cached in another config only, the error names the option, the
    unreachable Hub and the configs the cache holds, in one line (`datasets` says only the last,
    in two lines)."""
    hub_on_this_machine(refusing)
    folder = write_hub_dataset(tmp_path / "stories", {"train": PARAGRAPHS * 3})
    prepared(source="hub", name=str(folder), cache_dir=tmp_path)  # cached as config 'default'
    monkeypatch.chdir(tmp_path / "stories" / "data")
    with pytest.raises(ValueError) as raised:
        prepared(source="hub", name="stories", config="other", cache_dir=tmp_path)
    message = str(raised.value)
    assert message.startswith("data.name: cannot download stories (other): the Hugging Face Hub")
    assert "unreachable (offline)" in message and "'default'" in message
    assert "set data.config to one of those" in message
    assert "data=text_files" in message and "\n" not in message


def test_a_hub_directory_loads_without_connecting(tmp_path, hub_on_this_machine, listening):
    """A directory laid out as a Hub dataset repository needs no network: the Hub is not even
    probed, so nothing connects to it."""
    hub_on_this_machine(listening)
    folder = write_hub_dataset(tmp_path / "hub", {"train": PARAGRAPHS * 3})
    prepared(source="hub", name=str(folder), cache_dir=tmp_path)
    listening.setblocking(False)
    with pytest.raises(BlockingIOError):  # no connection waits to be accepted
        listening.accept()


def test_the_hub_is_reachable_through_a_proxy(
    monkeypatch, hub_on_this_machine, refusing, listening, stalled
):
    """The Hub counts as unreachable only when no route to it answers: through the proxy the
    environment names for its scheme (huggingface_hub's client takes it), or straight."""
    endpoint = hub_on_this_machine(refusing)
    assert not hub_reachable(endpoint)
    assert hub_reachable(hub_on_this_machine(listening))
    monkeypatch.setenv("http_proxy", f"127.0.0.1:{listening.getsockname()[1]}")
    assert hub_reachable(endpoint)
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{refusing.getsockname()[1]}")
    assert not hub_reachable(endpoint)
    # a route that does not answer in time is left to huggingface_hub's retries
    assert hub_reachable(hub_on_this_machine(stalled), timeout=0.2)


@pytest.mark.parametrize("no_proxy", ["127.0.0.1", "localhost, 127.0.0.1", "*"])
def test_no_proxy_sends_the_hub_check_past_the_proxy(
    monkeypatch, hub_on_this_machine, refusing, listening, no_proxy
):
    """A host that NO_PROXY names (or a domain it ends in) is reached straight, not through the
    proxy: a proxy that answers says nothing about a Hub that refuses."""
    endpoint = hub_on_this_machine(refusing)
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{listening.getsockname()[1]}")
    assert hub_reachable(endpoint)
    monkeypatch.setenv("no_proxy", no_proxy)
    assert not hub_reachable(endpoint)
    monkeypatch.setenv("no_proxy", "example.org")  # another host's exception
    assert hub_reachable(endpoint)


def test_a_given_tokenizer_is_reused_not_retrained(corpus, tmp_path, monkeypatch):
    options = dict(source="text_files", paths=[str(corpus / "a.txt")], cache_dir=tmp_path)
    trained = prepared(tokenizer="bpe", bpe_vocab_size=300, **options)
    saved = tmp_path / "run" / "tokenizer.json"
    saved.parent.mkdir()
    trained.tokenizer.save(saved)

    def no_training(*args, **kwargs):
        raise AssertionError("the tokenizer was retrained")

    monkeypatch.setattr(BPETokenizer, "train", no_training)
    monkeypatch.setattr(CharTokenizer, "__init__", no_training)
    reused = prepared(tokenizer_file=str(saved), **options)
    assert reused.cache_entry != trained.cache_entry  # keyed on the tokenizer itself
    assert reused.tokenizer.to_dict() == trained.tokenizer.to_dict()
    assert np.array_equal(reused._split("train"), trained._split("train"))


def test_missing_tokenizer_file_is_explained(tmp_path):
    with pytest.raises(
        FileNotFoundError, match=r"data.tokenizer_file: no tokenizer at .*nope.json"
    ):
        LMDataModule(tokenizer_file=str(tmp_path / "nope.json"))


# --- Concurrency: one writer, the others wait and reuse ----------------------------------------

PREPARE = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from data.lm import LMDataModule

    corpus, cache, name = sys.argv[1:]
    real_build = LMDataModule._build

    def slow_build(self, out):
        Path(cache, f"built-by-{name}").touch()
        deadline = time.monotonic() + 120
        while len(list(Path(cache).glob("ready-*"))) < 2:  # the other process is on its way
            assert time.monotonic() < deadline, "the other process never started"
            time.sleep(0.05)
        time.sleep(1)  # and now inside prepare_data, while this one builds
        real_build(self, out)

    LMDataModule._build = slow_build
    module = LMDataModule(source="text_files", paths=[corpus], tokenizer="bpe",
                          bpe_vocab_size=300, block_size=8, cache_dir=cache)
    Path(cache, f"ready-{name}").touch()
    module.prepare_data()
    module.setup()
    print(json.dumps({"hit": module.cache_hit, "entry": str(module.cache_entry),
                      "train": module._split("train").tolist()}))
    """
)


@pytest.mark.slow
def test_two_processes_preparing_one_entry_build_it_once(corpus, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    env = clean_env(cache, PYTHONPATH=str(ROOT))

    def start(name: str) -> subprocess.Popen:
        command = [sys.executable, "-c", PREPARE, str(corpus / "a.txt"), str(cache), name]
        return subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True)

    processes = [start("first"), start("second")]
    try:
        outputs = [p.communicate(timeout=300)[0] for p in processes]
    finally:
        for process in processes:
            process.kill()  # a no-op for one that ended; never an orphan holding the lock
    assert [p.returncode for p in processes] == [0, 0]
    results = [json.loads(output.splitlines()[-1]) for output in outputs]
    assert sorted(r["hit"] for r in results) == [False, True]
    assert len(list(cache.glob("built-by-*"))) == 1  # one writer; the other waited and reused
    assert results[0]["entry"] == results[1]["entry"]
    assert results[0]["train"] == results[1]["train"]
    entry = Path(results[0]["entry"])
    assert sorted(p.name for p in entry.parent.iterdir() if not p.name.startswith(".")) == [
        entry.name
    ]
    assert not list(entry.parent.glob(".tmp-*"))
    assert load_tokenizer(entry / "tokenizer.json").vocab_size == 300
