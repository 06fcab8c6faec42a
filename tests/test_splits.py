"""How a corpus is split into train and val text: the tail of each document for the plays and for
a corpus of few documents (one file of any shape), whole documents for a corpus of many, and a
Hub dataset's own validation split when it has one."""

import dataclasses
import json
import re

import numpy as np
import pytest

from data.cache import entry_problem
from data.lm import LMDataModule
from data.lm_text import LMDataConfig, eval_documents, token_stream
from data.sources import split_tail, splits_by_tail, tail_split
from helpers import run_script, write_hub_dataset

# Lines of one alphabet (no digits), so that the char tokenizer trained on any head has an id
# for every character of the tail.
WORDS = ["Hark", "Lo", "Fie", "Alas"]
LINES = [
    f"{WORDS[i % 4]}, the quick brown fox jumps over the lazy dog {WORDS[i // 10]}."
    for i in range(40)
]


# One short paragraph (55 characters) whose every character occurs early on, so the char
# tokenizer trained on its head keeps all of its tail.
SHORT = "one two three one two three one two three one two three"


def prepared(**options) -> LMDataModule:
    module = LMDataModule(**{"block_size": 8, "batch_size": 4, **options})
    module.prepare_data()
    module.setup()
    return module


def split_text(module: LMDataModule, split: str) -> str:
    return module.tokenizer.decode(np.asarray(module._split(split)).tolist())


@pytest.mark.parametrize(
    ("text", "head", "tail"),
    [
        ("One paragraph\n" * 5 + "\nEnd\n\n", "One paragraph\n" * 4 + "One paragraph", "End"),
        ("a\nb\nc\nd\ne\nf\ng\nh\ni\nj\nk\n", "a\nb\nc\nd\ne\nf\ng\nh\ni\nj", "k"),  # no blank line
        ("x" * 50, "x" * 45, "x" * 5),  # no line break at all: cut right at 90%
        ("ab", "a", "b"),
    ],
)
def test_split_tail_cuts_any_text_at_paragraph_then_line_then_anywhere(text, head, tail):
    assert split_tail(text, 0.1) == (head, tail)


def test_few_documents_are_split_at_their_tails_with_at_least_min_tail_characters():
    assert splits_by_tail(iter(["doc"] * 9), 0.1)  # one in ten to val: nine give val none
    assert not splits_by_tail(iter(["doc"] * 10), 0.1)
    texts = ["a" * 100, "b" * 300]
    assert tail_split(texts, 0.1) == [("a" * 90, "a" * 10), ("b" * 270, "b" * 30)]
    # Tails of 40 characters are fewer than 60: each document gives its share of 60 instead.
    assert tail_split(texts, 0.1, min_tail=60) == [("a" * 85, "a" * 15), ("b" * 255, "b" * 45)]


def test_one_file_of_lines_splits_at_its_tail(tmp_path):
    """One paragraph of single-newline lines is one document: it trains, its last lines validate."""
    path = tmp_path / "poem.txt"
    path.write_text("\n".join(LINES) + "\n")
    module = prepared(source="text_files", paths=[str(path)], cache_dir=tmp_path)
    val = split_text(module, "val")
    # Cut at the first line break after 90% of the text: its last 3 lines of 40.
    assert val == "\n".join(LINES[37:])
    assert split_text(module, "train") == "\n".join(LINES[:37])


def test_a_text_of_two_blocks_trains_and_a_shorter_one_says_so(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text(SHORT)
    options = dict(source="text_files", paths=[str(path)], cache_dir=tmp_path)
    module = prepared(**options)
    # A 10% tail would be 6 characters, fewer than one block and the token after it: val gets 9.
    assert split_text(module, "val") == "two three"
    assert split_text(module, "train") + split_text(module, "val") == SHORT
    # 55 characters hold two blocks of 26 and the token after each, not two of 27.
    halves = prepared(**options, block_size=26)
    assert (len(halves._split("train")), len(halves._split("val"))) == (28, 27)
    with pytest.raises(
        ValueError,
        match=r"^data.block_size=27 needs at least 28 tokens but the train split has 27 \(from "
        rf"data.paths: {re.escape(str(path))}\), and the whole text 55: it is shorter than two "
        r"blocks \(one to train on, one to validate\); add text or lower model.block_size$",
    ):
        prepared(**options, block_size=27)
    # A text of fewer characters than a block trains no tokenizer: its count is its characters.
    # Two bytes a character, its size cannot tell that it is short.
    accented = tmp_path / "accented.txt"
    accented.write_text("\u00e9" * 20)
    with pytest.raises(ValueError, match=r"the train split has 0 \(.*\), and the whole text 20: "):
        prepared(source="text_files", paths=[str(accented)], cache_dir=tmp_path, block_size=20)


@pytest.mark.parametrize("val_paths", [False, True])
def test_files_too_small_for_the_blocks_are_refused_before_they_are_read(tmp_path, val_paths):
    """No tokenizer makes more tokens than a text has bytes: the files' sizes tell that they
    cannot fill the blocks, before `datasets` reads them under its progress bars."""
    path, valid = tmp_path / "short.txt", tmp_path / "valid.txt"
    path.write_text(SHORT)
    valid.write_text(SHORT[:20])
    cache = tmp_path / "cache"
    options = dict(source="text_files", paths=[str(path)], cache_dir=cache, block_size=64)
    if val_paths:  # the training text holds a block; the validation text does not
        options |= dict(val_paths=[str(valid)], block_size=32)
        message = (
            f"data.val_paths holds 20 bytes of text ({valid}), so fewer than the 33 tokens that "
            "data.block_size=32 needs: a block and the token after it to validate on; add text "
            "or lower model.block_size"
        )
    else:
        message = (
            f"data.paths holds 55 bytes of text ({path}), so fewer than the 130 tokens that "
            "data.block_size=64 needs: a block and the token after it to train on and as many "
            "to validate on; add text or lower model.block_size"
        )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        prepared(**options)
    assert not (cache / "hf").exists(), "a file was read"
    assert not list(cache.glob("lm/*/meta.json"))


def never_trained(self, corpus):
    pytest.fail("the tokenizer was trained on a text too short for the block")


def test_a_jsonl_text_short_of_its_file_size_is_refused_once_read(tmp_path, monkeypatch):
    """A .jsonl file's size counts its keys, quotes and other columns: the bytes of its text,
    told by its rows once read, cannot hold the blocks, which is refused then, before the
    tokenizer is trained and the text tokenized under progress bars."""
    path = tmp_path / "rows.jsonl"
    row = json.dumps({"text": "ab", "note": "x" * 200}) + "\n"
    path.write_text(row * 10)
    monkeypatch.setattr(LMDataModule, "_train_tokenizer", never_trained)
    message = (
        f"data.paths holds 20 bytes of text ({path}), so fewer than the 130 tokens that "
        "data.block_size=64 needs: a block and the token after it to train on and as many to "
        "validate on; add text or lower model.block_size"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        prepared(source="text_files", paths=[str(path)], cache_dir=tmp_path, block_size=64)
    assert not list(tmp_path.glob("lm/*/meta.json"))


@pytest.mark.parametrize("own_validation", [True, False])
def test_a_cold_hub_dataset_too_short_for_the_block_is_refused_before_it_is_tokenized(
    tmp_path, monkeypatch, own_validation
):
    """A Hub dataset's splits tell the bytes of their text once read, before the tokenizer is
    trained and the text tokenized under progress bars: it was refused only by the token counts
    of the entry built. (Its card's split sizes, before the download, are no bound: `datasets`
    never checks them.)"""
    rows = ["some text " * 30] * 3
    splits = {"train": rows, "validation": ["more"] * 3} if own_validation else {"train": rows}
    folder = write_hub_dataset(tmp_path / "hub", splits)
    monkeypatch.setattr(LMDataModule, "_train_tokenizer", never_trained)
    if own_validation:  # the train split holds a block, the validation split does not
        message = (
            f"data.name holds 12 bytes of text (the 'validation' split of {folder}), so fewer "
            "than the 257 tokens that data.block_size=256 needs: a block and the token after it "
            "to validate on; add text or lower model.block_size"
        )
    else:
        message = (
            f"data.name holds 900 bytes of text (the train split of {folder}), so fewer than "
            "the 1026 tokens that data.block_size=512 needs: a block and the token after it to "
            "train on and as many to validate on; add text or lower model.block_size"
        )
    block = 256 if own_validation else 512
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        prepared(source="hub", name=str(folder), cache_dir=tmp_path / "cache", block_size=block)
    assert not list((tmp_path / "cache").glob("lm/*/meta.json"))


@pytest.mark.parametrize("val_paths", [False, True])
def test_text_short_of_tokens_is_refused_naming_its_files_and_the_cache_stays_whole(
    tmp_path, val_paths
):
    """BPE packs several bytes into a token, so neither the files' sizes nor their text's bytes
    tell that the text is short of tokens: the token counts do, once tokenized, in a message
    that names the files (it named the split alone). The entry built stays whole (and, asked for
    again, is refused at once by its counts); no build is left half-written."""
    path, valid = tmp_path / "short.txt", tmp_path / "valid.txt"
    path.write_text("\n".join([SHORT] * 8))
    valid.write_text(SHORT)
    cache = tmp_path / "cache"
    options = dict(source="text_files", paths=[str(path)], cache_dir=cache, tokenizer="bpe")
    if val_paths:
        options["val_paths"] = [str(valid)]
        message = (
            r"^data.block_size=32 needs at least 33 tokens but the val split has \d+ "
            rf"\(from data.val_paths: {re.escape(str(valid))}\); lower model.block_size$"
        )
    else:
        message = (
            r"^data.block_size=32 needs at least 33 tokens but the val split has \d+ "
            rf"\(from data.paths: {re.escape(str(path))}\); lower model.block_size or raise "
            r"data.val_fraction$"
        )
    for _ in range(2):  # built, then refused by the counts of the entry built
        with pytest.raises(ValueError, match=message):
            prepared(**options, block_size=32)
    entries = [p for p in (cache / "lm").iterdir() if p.is_dir()]
    assert [p.name for p in entries if p.name.startswith(".tmp")] == []
    (entry,) = entries
    assert entry_problem(entry) is None


def test_a_warm_entry_too_short_for_the_block_is_refused_from_its_counts(tmp_path, capsys):
    """A Hub dataset's entry serves every block size: a larger one is refused by the token
    counts of the entry, its files' lengths, at once, before the checksums of all of it are
    read, and the entry stays as it was, for a smaller one. The lengths never accept an entry:
    a damaged one (its bytes changed, its sizes not) is still found by its checksums, and built
    again, once a block fits."""
    folder = write_hub_dataset(
        tmp_path / "hub", {"train": HUB_ROWS[:200], "validation": HUB_ROWS[200:203]}
    )
    options = dict(source="hub", name=str(folder), cache_dir=tmp_path / "cache", tokenizer="char")
    entry = prepared(**options).cache_entry
    files = {f.name: f.read_bytes() for f in entry.iterdir()}
    too_short = (
        r"^data.block_size=512 needs at least 513 tokens but the val split has 1\d\d \(from "
        rf"data.name: the 'validation' split of {re.escape(str(folder))}\); lower "
        r"model.block_size$"
    )
    with pytest.raises(ValueError, match=too_short):
        LMDataModule(**options, block_size=512, batch_size=4).prepare_data()
    assert {f.name: f.read_bytes() for f in entry.iterdir()} == files
    train = entry / "train.bin"
    train.write_bytes(bytes(train.stat().st_size))  # zeroed, as by a crash
    damaged = {f.name: f.read_bytes() for f in entry.iterdir()}
    capsys.readouterr()
    with pytest.raises(ValueError, match=too_short):
        LMDataModule(**options, block_size=512, batch_size=4).prepare_data()
    assert "rebuilding" not in capsys.readouterr().err, "the checksums were read first"
    assert {f.name: f.read_bytes() for f in entry.iterdir()} == damaged
    module = prepared(**options)
    assert f"rebuilding the cache entry {entry}: train.bin does not match the checksum" in (
        capsys.readouterr().err
    )
    assert not module.cache_hit and split_text(module, "train") == "\n\n".join(HUB_ROWS[:200])


def test_the_block_size_keys_a_text_files_entry_whose_split_it_decides(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text(SHORT)
    options = dict(source="text_files", paths=[str(path)], cache_dir=tmp_path)
    small, large = prepared(**options, block_size=8), prepared(**options, block_size=16)
    assert small.cache_entry != large.cache_entry
    assert (len(small._split("val")), len(large._split("val"))) == (9, 17)


def test_few_paragraphs_give_each_ones_tail(tmp_path):
    paragraphs = ["\n".join(LINES[i : i + 10]) for i in range(0, 40, 10)]
    path = tmp_path / "four.md"
    path.write_text("\n\n".join(paragraphs) + "\n")
    module = prepared(source="text_files", paths=[str(path)], cache_dir=tmp_path)
    tails = [p.split("\n")[-1] for p in paragraphs]  # the last line of each is its last 10%
    assert split_text(module, "val") == "\n\n".join(tails)
    meta = json.loads((module.cache_entry / "meta.json").read_text())
    assert meta["val_carved"] is True


@pytest.mark.parametrize(
    "corpus",
    [
        "many documents",
        "many documents, streamed",
        "few documents",
        "shorter than its blocks' share",
        "val_paths",
        "jsonl",
        "hub dataset without a validation split",
    ],
)
def test_evaluate_py_reads_a_text_files_runs_validation_split_token_for_token(tmp_path, corpus):
    """Without data=, evaluate.py scores a text_files run on its own validation text: the same
    token stream as the one training validated on, however the corpus was split."""
    path, options = tmp_path / "corpus.txt", {}
    if corpus.startswith("many documents"):  # one whole paragraph in every ten to validation
        path.write_text("\n\n".join(f"{line}\n{line}" for line in LINES) + "\n")
        options["streaming"] = corpus.endswith("streamed")
    elif corpus == "few documents":  # the tail of each
        path.write_text("\n\n".join("\n".join(LINES[i : i + 10]) for i in range(0, 40, 10)))
    elif corpus == "shorter than its blocks' share":  # a tail of at least one block
        path.write_text(SHORT)
        options["block_size"] = 16
    elif corpus == "val_paths":  # the validation file whole
        path.write_text("\n".join(LINES[:30]))
        (tmp_path / "valid.txt").write_text("\n\n".join(LINES[30:]))
        options["val_paths"] = [str(tmp_path / "valid.txt")]
    elif corpus == "jsonl":
        path = tmp_path / "corpus.jsonl"
        path.write_text("".join(json.dumps({"body": line}) + "\n" for line in LINES))
        options["text_column"] = "body"
    if corpus.startswith("hub"):  # carved by val_fraction too, with no least tail
        hub = write_hub_dataset(tmp_path / "hub", {"train": HUB_ROWS[:200]})
        module = prepared(source="hub", name=str(hub), cache_dir=tmp_path)
    else:
        module = prepared(source="text_files", paths=[str(path)], cache_dir=tmp_path, **options)
    # Scored in blocks smaller than the run's: the text is the run's all the same
    scored_as = dataclasses.replace(module.config, block_size=4)
    documents, shown = eval_documents(scored_as, trained_block_size=module.config.block_size)
    tokens, dropped = token_stream(module.tokenizer, documents)
    assert tokens.tolist() == np.asarray(module._split("val")).tolist()
    assert dropped == 0 and len(tokens) > module.config.block_size
    if corpus.startswith("hub"):
        assert shown == f"data.val_fraction=0.1 of the train split of {hub}, which has no " + (
            "validation split"
        )
    elif "val_paths" in options:
        assert shown.startswith("all of data.val_paths")
    else:  # without the run's block size, all of data.paths, as data=text_files scores it
        assert shown.startswith("the validation split of data.paths")
        everything, _ = token_stream(module.tokenizer, eval_documents(module.config)[0])
        assert len(everything) > len(tokens)


def test_split_is_evaluate_py_s_option_and_training_says_so(tmp_path):
    with pytest.raises(ValueError, match=r"data.split=validation picks the split evaluate.py"):
        LMDataModule(cache_dir=str(tmp_path), split="validation")
    with pytest.raises(ValueError, match=r"data.split must be one of \['validation', 'test'\]"):
        LMDataConfig(split="dev")
    with pytest.raises(ValueError, match=r"data.split=test: the embedded plays have no test split"):
        LMDataConfig(split="test")
    with pytest.raises(ValueError, match=r"data.val_split is only read by source=hub"):
        LMDataModule(cache_dir=str(tmp_path), val_split="validation")


# --- A dataset in the Hub's layout, on disk -----------------------------------------------------


HUB_ROWS = [f"Row {i}: {LINES[i % 40]}" for i in range(300)]


@pytest.mark.parametrize("streaming", [False, True])
def test_hub_dataset_validates_on_its_own_validation_split(tmp_path, capsys, streaming):
    folder = write_hub_dataset(
        tmp_path / "hub", {"train": HUB_ROWS[:200], "validation": HUB_ROWS[200:230]}
    )
    module = prepared(source="hub", name=str(folder), cache_dir=tmp_path, streaming=streaming)
    assert f"data=hub: validating on the 'validation' split of {folder}" in capsys.readouterr().out
    assert split_text(module, "train") == "\n\n".join(HUB_ROWS[:200])
    assert split_text(module, "val") == "\n\n".join(HUB_ROWS[200:230])


def test_hub_dataset_without_one_is_carved_and_a_named_split_is_checked(tmp_path, capsys):
    folder = write_hub_dataset(tmp_path / "hub", {"train": HUB_ROWS[:200], "test": HUB_ROWS[200:]})
    module = prepared(source="hub", name=str(folder), cache_dir=tmp_path, val_fraction=0.1)
    out = capsys.readouterr().out
    assert f"validating on data.val_fraction=0.1 of the train split of {folder}" in out
    assert split_text(module, "val") == "\n\n".join(HUB_ROWS[9:200:10])  # one row in ten
    named = prepared(source="hub", name=str(folder), cache_dir=tmp_path, val_split="test")
    assert split_text(named, "val") == "\n\n".join(HUB_ROWS[200:])
    assert named.cache_entry != module.cache_entry
    with pytest.raises(
        ValueError,
        match=r"data.val_split: .* has no split named 'dev'; its splits are \['train', 'test'\]",
    ):
        prepared(source="hub", name=str(folder), cache_dir=tmp_path, val_split="dev")


def test_a_hub_dataset_without_a_card_has_its_columns_checked_before_a_row_is_read(tmp_path):
    """No card declares the columns: its files' own do, read from each split's first file
    before `datasets` generates any split (under its progress bars)."""
    folder = write_hub_dataset(tmp_path / "hub", {"train": HUB_ROWS[:200], "test": HUB_ROWS[200:]})
    cache = tmp_path / "cache"
    message = (
        f"data.text_column='body' is not a column of {folder}/data/train-00000-of-00001.parquet; "
        "available columns: ['text']; set data.text_column"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        prepared(source="hub", name=str(folder), cache_dir=cache, text_column="body")
    assert not list(cache.rglob("*.arrow")), "a split was generated before the check"


def test_a_hub_dataset_without_a_card_whose_splits_differ_in_columns_names_both(tmp_path):
    """`datasets` gives every split the columns of its first file: a split of other columns is
    files that disagree, named both before a row is read, not an option to set."""
    folder = write_hub_dataset(tmp_path / "hub", {"train": HUB_ROWS[:200]})
    write_hub_dataset(folder, {"validation": HUB_ROWS[200:]}, column="body")
    validation = folder / "data" / "validation-00000-of-00001.parquet"
    cache = tmp_path / "cache"
    message = (
        f"data.name: {validation} has the columns ['body'] and "
        f"{folder}/data/train-00000-of-00001.parquet has ['text'], but the files of a dataset "
        "must share their columns (`datasets` gives them all the first file's); give every file "
        "the same columns"
    )
    for column in ("text", "body"):  # whichever column is asked for
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            prepared(source="hub", name=str(folder), cache_dir=cache, text_column=column)
    assert not list(cache.rglob("*.arrow")), "a split was generated before the check"


@pytest.mark.slow
def test_train_py_with_data_split_is_one_line_not_a_type_error(tmp_path):
    for overrides in (["+data.split=validation"], ["data=hub", "data.name=x", "data.split=test"]):
        result = run_script("train.py", *overrides, f"hydra.run.dir={tmp_path}", cache_dir=tmp_path)
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
        assert result.stderr.strip().splitlines() == [
            f"error: {overrides[-1].lstrip('+')} picks the split evaluate.py scores; training "
            "trains on the train split and validates on data.val_split (data=hub: its own "
            "validation split by default), or on data.val_fraction of the text"
        ]
