import csv
import functools
import json
import random
import re

import datasets
import huggingface_hub
import numpy as np
import pytest
import torch

from data.metrics import character_error_rate, levenshtein
from data.pairs import next_line_pairs, passages
from data.seq2seq import SPECIALS, Seq2SeqDataConfig, Seq2SeqDataModule, collate_pairs
from data.seq2seq_text import IGNORE_INDEX
from data.sources import load_shakespeare, train_val_split
from data.tokenizer import load_tokenizer

BATCH = 16
ARRAYS = [
    f"{s}_{side}_{kind}.npy"
    for s in ("train", "val")
    for side in ("source", "target")
    for kind in ("ids", "offsets")
]


def prepared(**kwargs) -> Seq2SeqDataModule:
    module = Seq2SeqDataModule(**kwargs)
    module.prepare_data()
    module.setup()
    return module


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def char_dm(cache_dir):
    """The default denoising data: the only cold build of that entry, shared by all tests."""
    return prepared(batch_size=BATCH, cache_dir=cache_dir)


@pytest.fixture(scope="session")
def span_dm(cache_dir):
    return prepared(corruption="span", batch_size=BATCH, cache_dir=cache_dir)


@pytest.fixture(scope="session")
def speech_bodies(cache_dir):
    """The train script with each `NAME:` line dropped and speeches joined by "\\0": a span of
    lines from one speech is a substring of it, framed by "\\n" or "\\0"; nothing else is."""
    train, _ = train_val_split(load_shakespeare(cache_dir)["text"], 0.1)
    speeches = train.strip("\n").split("\n\n")
    return "\0" + "\0".join(s.split("\n", 1)[1] for s in speeches) + "\0"


def texts(module: Seq2SeqDataModule, split: str) -> list[tuple[str, str]]:
    decode = module.tokenizer.decode
    sources, targets = module._split(split)
    return [
        (decode(sources[i].tolist(), skip_special=False), decode(targets[i].tolist()))
        for i in range(len(sources))
    ]


def within_one_speech(text: str, bodies: str) -> bool:
    return re.search(f"[\n\0]{re.escape(text)}[\n\0]", bodies) is not None


def test_passages_of_a_tiny_script():
    script = "A:\nshort one\nsecond line here\n\nB:\nthis is a very long line that must be cut\nx\n"
    # "short one" can't join the next line within 20 characters and alone is under 16.
    assert passages(script, 20) == ["second line here", "this is a very long", "line that must be"]


def test_denoise_passages_stay_in_one_speech_and_fit(char_dm, speech_bodies):
    pairs = texts(char_dm, "train")
    assert all(16 <= len(target) <= 95 for _, target in pairs)
    for _, target in random.Random(0).sample(pairs, 100):
        assert within_one_speech(target, speech_bodies), target


def test_char_corruption_substitutes_letters_at_the_noise_rate(char_dm):
    sources, targets = zip(*texts(char_dm, "train"), strict=True)
    source, target = "".join(sources), "".join(targets)
    assert [len(s) for s in sources] == [len(t) for t in targets]
    changed = [(s, t) for s, t in zip(source, target, strict=True) if s != t]
    print(f"char corruption changed {len(changed) / len(target):.4f} of the characters")
    assert 0.145 < len(changed) / len(target) < 0.155
    assert all(s.isascii() and s.isalpha() for s, _ in changed)
    assert all(s.isupper() == t.isupper() for s, t in changed if t.isalpha())


def test_span_corruption_masks_spans_at_the_noise_rate(span_dm):
    tok = span_dm.tokenizer
    sources, targets = span_dm._split("train")
    masks = int((np.asarray(sources.flat) == tok.mask_id).sum())
    removed = len(targets.flat) - (len(sources.flat) - masks)
    print(f"span corruption removed {removed / len(targets.flat):.4f}, {removed / masks:.2f}/span")
    assert 0.14 < removed / len(targets.flat) < 0.16
    assert 2 < removed / masks < 4
    for source, target in texts(span_dm, "train")[:300]:
        # Each <mask> stands for a non-empty span; the rest of the source is the target's text.
        pattern = ".+".join(map(re.escape, source.split("<mask>")))
        assert re.fullmatch(pattern, target, flags=re.DOTALL), (source, target)


@pytest.mark.parametrize("corruption", ["char", "span"])
def test_denoise_build_is_deterministic(corruption, cache_dir, tmp_path, char_dm, span_dm):
    first = {"char": char_dm, "span": span_dm}[corruption]
    again = prepared(corruption=corruption, cache_dir=str(tmp_path))
    assert again.cache_entry.name == first.cache_entry.name and not again.cache_hit
    for name in ARRAYS:
        assert np.array_equal(np.load(first.cache_entry / name), np.load(again.cache_entry / name))
    assert again.tokenizer.to_dict() == first.tokenizer.to_dict()


def test_cached_tokenizer_has_the_specials(char_dm, span_dm):
    tok = load_tokenizer(char_dm.cache_entry / "tokenizer.json")
    assert tok.to_dict() == char_dm.tokenizer.to_dict()
    assert tok.specials == list(SPECIALS) and tok.pad_id == char_dm.pad_id == 0
    assert (char_dm.bos_id, char_dm.eos_id, tok.mask_id) == (1, 2, 3)
    meta = json.loads((char_dm.cache_entry / "meta.json").read_text())
    assert meta["vocab_size"] == char_dm.vocab_size == tok.vocab_size
    assert meta["val_chars_dropped"] == 0
    print(
        f"denoise: {meta['train_pairs']} train / {meta['val_pairs']} val pairs, "
        f"vocab {meta['vocab_size']}"
    )
    source, _ = span_dm.val_texts(1)[0]
    assert "<mask>" in source


def test_collate_pads_and_masks():
    items = [(np.array([5, 6, 7]), np.array([8])), (np.array([9]), np.array([10, 11, 12]))]
    batch = collate_pairs(items, pad_id=0, bos_id=1, eos_id=2)
    expected = {
        "source": [[5, 6, 7], [9, 0, 0]],
        "source_mask": [[True, True, True], [True, False, False]],
        "target_in": [[1, 8, 0, 0], [1, 10, 11, 12]],
        "target_out": [[8, 2, IGNORE_INDEX, IGNORE_INDEX], [10, 11, 12, 2]],
        "target_mask": [[True, True, False, False], [True] * 4],
    }
    assert {k: v.tolist() for k, v in batch.items()} == expected
    assert all(v.dtype == (torch.bool if "mask" in k else torch.long) for k, v in batch.items())


@pytest.mark.parametrize("which", ["char", "span"])
def test_train_batches(which, char_dm, span_dm):
    dm = {"char": char_dm, "span": span_dm}[which]
    batch = next(iter(dm.train_dataloader()))
    source, target_in, target_out = batch["source"], batch["target_in"], batch["target_out"]
    assert source.shape[0] == target_in.shape[0] == BATCH
    assert source.shape[1] <= 96 and target_in.shape[1] <= 96
    assert target_in.shape == target_out.shape == batch["target_mask"].shape
    assert source.shape == batch["source_mask"].shape
    assert (target_in[:, 0] == dm.bos_id).all()
    for row in range(BATCH):
        n = int(batch["target_mask"][row].sum())
        assert target_out[row, n - 1] == dm.eos_id
        assert torch.equal(target_out[row, : n - 1], target_in[row, 1:n])
        assert (target_out[row, n:] == IGNORE_INDEX).all() and (target_out[row, :n] >= 0).all()
        assert (target_in[row, n:] == dm.pad_id).all()
    real = batch["source_mask"]
    assert (source[~real] == dm.pad_id).all() and (source[real] != dm.pad_id).all()
    assert real[:, 0].all() and (real.long().diff(dim=1) <= 0).all()  # real tokens come first


def test_val_loader_and_val_pairs_sample_the_whole_split_alike(char_dm):
    """The loader's first batch is val_pairs' first pairs (loss and decodes score the same
    pairs) and those come from all over the split, not from its beginning."""
    loader = char_dm.val_dataloader()
    order = list(loader.sampler)  # every pair once, in evaluation's fixed order
    assert sorted(order) == list(range(len(char_dm._split("val")[0])))
    assert {4 * i // len(order) for i in order[: len(order) // 4]} == {0, 1, 2, 3}
    batch = next(iter(loader))
    pairs = char_dm.val_pairs(BATCH)
    for row, (source, target) in enumerate(pairs):
        assert batch["source"][row, : len(source)].tolist() == source
        assert batch["target_in"][row, 1 : len(target) + 1].tolist() == target
    assert char_dm.val_pairs(10**9) == char_dm.val_pairs(len(char_dm._split("val")[0]))


def test_next_line_pairs():
    script = "A:\none\ntwo\nthree\n\nB:\nfour\n\nA:\nfive\nsix is long\n"
    assert next_line_pairs(script, 4, 3) == (["one", "two", "five"], ["two", "thr", "six"])


def test_next_line_task_pairs_consecutive_lines(cache_dir, speech_bodies):
    dm = prepared(task="next_line", batch_size=BATCH, cache_dir=cache_dir)
    pairs = texts(dm, "train")
    for source, target in random.Random(0).sample(pairs, 100):
        assert within_one_speech(f"{source}\n{target}", speech_bodies), (source, target)
    batch = next(iter(dm.train_dataloader()))
    assert batch["source"].shape[0] == BATCH


@pytest.fixture
def pair_files(tmp_path):
    rows = [{"source": f"line {i}", "target": f"{i} enil", "id": i} for i in range(40)]
    with open(tmp_path / "pairs.jsonl", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    with open(tmp_path / "pairs.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["de", "en"])
        writer.writerows([row["source"], row["target"]] for row in rows)
    return tmp_path


@pytest.mark.parametrize(
    ("name", "columns"),
    [("*.jsonl", {}), ("pairs.csv", {"source_column": "de", "target_column": "en"})],
)
def test_pairs_from_local_files(name, columns, pair_files, cache_dir):
    kwargs = dict(task="pairs", paths=[str(pair_files / name)], batch_size=4, cache_dir=cache_dir)
    dm = prepared(**kwargs, **columns)
    train, val = texts(dm, "train"), texts(dm, "val")
    assert (len(train), len(val)) == (36, 4)
    assert sorted(train + val) == sorted((f"line {i}", f"{i} enil") for i in range(40))
    again = prepared(**kwargs, **columns)
    assert again.cache_hit and texts(again, "val") == val
    batch = next(iter(dm.train_dataloader()))
    assert batch["source"].shape[0] == 4


def test_the_cells_of_a_csv_file_are_read_as_text(tmp_path, cache_dir):
    """pandas reads a column of numbers as numbers ("007" as 7.0 where a cell of it is empty)
    and "NA", "None" or "null" as missing: pairs are text, and only an empty cell is missing."""
    rows = [(f"{i:03d}", str(2 * i)) for i in range(36)] + [("NA", "None"), ("null", "nan")]
    with open(tmp_path / "numbers.csv", "w", newline="") as f:
        csv.writer(f).writerows([("source", "target"), *rows, ("7", ""), ("", "8")])
    path = str(tmp_path / "numbers.csv")
    dm = prepared(task="pairs", paths=[path], batch_size=4, cache_dir=cache_dir)
    assert sorted(texts(dm, "train") + texts(dm, "val")) == sorted(rows)


def test_a_pairs_file_edited_between_prepare_and_setup_is_read_as_prepared(pair_files, cache_dir):
    """The cache entry is fixed when prepare_data first asks for it: an edit before setup (which
    moves the file's change time, part of the key) does not send setup to an entry nobody
    built; the next run's prepare_data sees the edit."""
    kwargs = dict(task="pairs", paths=[str(pair_files / "pairs.jsonl")], batch_size=4)
    module = Seq2SeqDataModule(**kwargs, cache_dir=cache_dir)
    module.prepare_data()
    with open(pair_files / "pairs.jsonl", "a") as f:
        f.write(json.dumps({"source": "added", "target": "dedda"}) + "\n")
    module.setup()
    assert len(texts(module, "train")) + len(texts(module, "val")) == 40
    again = prepared(**kwargs, cache_dir=cache_dir)
    assert not again.cache_hit and again.cache_entry != module.cache_entry
    assert ("added", "dedda") in texts(again, "train") + texts(again, "val")


def test_path_options_given_as_paths_are_kept_as_strings(pair_files, tmp_path):
    module = Seq2SeqDataModule(
        task="pairs", paths=pair_files / "pairs.jsonl", cache_dir=tmp_path / "cache"
    )
    assert module.hparams["paths"] == [str(pair_files / "pairs.jsonl")]
    assert module.hparams["cache_dir"] == str(tmp_path / "cache")


def test_pairs_errors(pair_files, cache_dir):
    def prepare(*names: str, **kwargs) -> None:
        paths = [str(pair_files / name) for name in names]
        Seq2SeqDataModule(task="pairs", paths=paths, cache_dir=cache_dir, **kwargs).prepare_data()

    with pytest.raises(ValueError, match=r"data.target_column='en' .*\['source', 'target', 'id'\]"):
        prepare("pairs.jsonl", target_column="en")
    with pytest.raises(FileNotFoundError, match="no file at .*nope.jsonl; check the path"):
        prepare("pairs.jsonl", "nope.jsonl")
    with pytest.raises(FileNotFoundError, match=r"no file matches .*\*.parquet"):
        prepare("*.parquet")
    with pytest.raises(ValueError, match=r"data.paths mixes \['csv', 'json'\] files"):
        prepare("pairs.jsonl", "pairs.csv")
    (pair_files / "pairs.txt").touch()
    with pytest.raises(ValueError, match=r"pairs.txt has an unsupported extension; use one of"):
        prepare("pairs.txt")
    with pytest.raises(ValueError, match=r"data.batch_size=64 is more than the 36 training pairs"):
        prepared(task="pairs", paths=[str(pair_files / "pairs.jsonl")], cache_dir=cache_dir)


@pytest.mark.parametrize(
    ("name", "where", "columns"),
    [
        ("pairs.jsonl", "{}", ["source", "target", "id"]),  # the keys of its rows
        ("pairs.csv", "{}", ["de", "en"]),  # its header
        ("pairs.parquet", "{}", ["source", "target"]),  # its schema
    ],
)
def test_a_file_without_a_column_is_refused_before_it_is_read(name, where, columns, pair_files):
    """Each file's first rows tell its columns, so a wrong column fails with the config, before
    `datasets` reads a row under its progress bars."""
    rows = {"source": ["line 0", "line 1"], "target": ["0 enil", "1 enil"]}
    datasets.Dataset.from_dict(rows).to_parquet(str(pair_files / "pairs.parquet"))
    path = pair_files / name
    message = (
        f"data.target_column='fr' is not a column of {where.format(path)}; available columns: "
        f"{columns}; set data.target_column"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        Seq2SeqDataConfig(
            task="pairs", paths=[str(path)], source_column=columns[0], target_column="fr"
        )


def test_pairs_files_of_other_columns_are_refused_naming_both(pair_files, tmp_path):
    """`datasets` reads the files as one dataset, with the columns of the first: a later file
    with a column more failed in a traceback once read. It is refused with the config (before
    the rows are read), naming both files; one with a column fewer is filled with nulls by
    `datasets`, and passes."""
    with_id = pair_files / "with_id.csv"
    with_id.write_text("de,en,id\n" + "line,enil,0\n" * 40)
    plain = pair_files / "pairs.csv"  # the fixture's: de, en
    names = {"source_column": "de", "target_column": "en"}
    Seq2SeqDataConfig(task="pairs", paths=[str(with_id), str(plain)], **names)
    message = (
        f"data.paths: {with_id} has the columns ['de', 'en', 'id'] and {plain} has ['de', 'en'], "
        "but the files of a dataset must share their columns (`datasets` gives them all the "
        "first file's); give every file the same columns"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        Seq2SeqDataConfig(task="pairs", paths=[str(plain), str(with_id)], **names)
    # A JSON file's first row does not tell all of its columns: `datasets` finds "note" in the
    # first file's second row, so a file whose first row has it reads well; one with a column
    # that no row of the first file has is found once read.
    row = '{"source": "a", "target": "b"}\n'
    noted = '{"source": "a", "target": "b", "note": "n"}\n'
    (pair_files / "sparse.jsonl").write_text(row + noted * 40)
    (pair_files / "noted.jsonl").write_text(noted * 40)
    paths = [str(pair_files / name) for name in ("sparse.jsonl", "noted.jsonl", "pairs.jsonl")]
    module = prepared(task="pairs", paths=paths[:2], batch_size=4, cache_dir=tmp_path / "cache")
    assert len(texts(module, "train")) + len(texts(module, "val")) == 81
    message = f"data.paths: cannot read {', '.join(paths)} as one dataset (Couldn't cast "
    fix = (
        "because column names don't match); the files of a dataset must share their columns: "
        "give every file the same columns"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}.* {re.escape(fix)}$"):
        prepared(task="pairs", paths=paths, cache_dir=tmp_path / "cache")


def test_a_hub_directory_whose_splits_differ_in_columns_is_refused_naming_both(tmp_path):
    """Its test split, which data=pairs does not read, is generated all the same: a column more
    there failed in a traceback, and is refused before a split is generated."""
    folder = tmp_path / "hub" / "data"
    folder.mkdir(parents=True)
    rows = {"source": ["line 0", "line 1"], "target": ["0 enil", "1 enil"]}
    datasets.Dataset.from_dict(rows).to_parquet(str(folder / "train-00000-of-00001.parquet"))
    test = folder / "test-00000-of-00001.parquet"
    datasets.Dataset.from_dict({**rows, "id": [0, 1]}).to_parquet(str(test))
    module = Seq2SeqDataModule(task="pairs", hub_name=str(folder.parent), cache_dir=tmp_path)
    message = f"data.hub_name: {test} has the columns ['source', 'target', 'id'] and "
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        module.prepare_data()
    assert not list(tmp_path.rglob("*.arrow")), "a split was generated before the check"


JSON_FIX = "check that it is JSON Lines, one object per line, or a JSON array of objects"


@pytest.mark.parametrize(
    ("name", "rows", "fault", "why", "fix"),
    [
        ("cut_off.jsonl", 40, '{"source": "line 40", "tar',
         "line 41 is not JSON: Unterminated string starting at column 23", JSON_FIX),
        ("not_an_object.jsonl", 40, '["line 40", "40 enil"]',
         'line 41 is not a JSON object: ["line 40", "40 enil"]', JSON_FIX),
        # past `datasets`' first 10 MB chunk, from whose start its own message counts rows
        ("long.jsonl", 300_000, '{"source": "line", "target": }',
         "line 300001 is not JSON: Expecting value at column 30", JSON_FIX),
        ("extra_field.csv", 1, "line,enil,3",
         "Error tokenizing data. C error: Expected 2 fields in line 3, saw 3",
         "check that no line has more fields than the header and every quote is closed"),
        ("not_parquet.parquet", 0, "PAR1 and no more",
         "Parquet magic bytes not found in footer. Either the file is corrupted or this is not a "
         "parquet file.", "check that it is a whole Parquet file"),
    ],
    ids=["cut_off_line", "not_an_object", "past_10_MB", "csv_line_too_long", "not_parquet"],
)  # fmt: skip
def test_a_file_datasets_cannot_read_is_named_with_its_fault(
    name, rows, fault, why, fix, pair_files
):
    """`datasets` fails in a traceback that names neither the file nor, past its first 10 MB,
    the line: the message names both, after a file of the same format that reads well."""
    columns = {"source": ["line 0", "line 1"], "target": ["0 enil", "1 enil"]}
    datasets.Dataset.from_dict(columns).to_parquet(str(pair_files / "pairs.parquet"))
    bad = pair_files / name
    suffix = bad.suffix
    good_row = {".jsonl": '{"source": "line", "target": "enil"}\n', ".csv": "line,enil\n"}
    header = "de,en\n" if suffix == ".csv" else ""
    bad.write_text(header + good_row.get(suffix, "") * rows + fault + "\n")
    paths = [str(pair_files / f"pairs{suffix}"), str(bad)]
    names = {"source_column": "de", "target_column": "en"} if suffix == ".csv" else {}
    module = Seq2SeqDataModule(task="pairs", paths=paths, cache_dir=pair_files / "cache", **names)
    message = f"data.paths: cannot read {bad} ({why}); {fix}"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        module.prepare_data()


def test_a_hub_directory_file_datasets_cannot_read_is_named_with_its_fault(tmp_path):
    """A directory given as data.hub_name is read by its `datasets` builder, not by read_files:
    a file it cannot read is named all the same, with the line."""
    folder = tmp_path / "hub" / "data"
    folder.mkdir(parents=True)
    (folder / "test-00000-of-00001.jsonl").write_text('{"source": "a", "target": "b"}\n' * 3)
    train = folder / "train-00000-of-00001.jsonl"
    train.write_text('{"source": "a", "target": "b"}\n' * 40 + '{"source": "a", "tar\n')
    module = Seq2SeqDataModule(task="pairs", hub_name=str(folder.parent), cache_dir=tmp_path)
    message = (
        f"data.hub_name: cannot read {train} (line 41 is not JSON: Unterminated string starting "
        f"at column 17); {JSON_FIX}"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        module.prepare_data()


def test_hub_dataset_offline_is_explained(cache_dir, monkeypatch):
    # Offline mode, as HF_HUB_OFFLINE=1 sets it at import time: the user's way to ask for it,
    # and one that keeps the test off the network wherever it runs.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    dm = Seq2SeqDataModule(task="pairs", hub_name="wmt16", hub_config="de-en", cache_dir=cache_dir)
    message = r"cannot download wmt16 \(de-en\): .*unreachable \(offline\).*data.paths=\["
    with pytest.raises(ValueError, match=message):
        dm.prepare_data()


def brute_levenshtein(a, b) -> int:
    @functools.cache
    def d(i: int, j: int) -> int:
        if not i or not j:
            return i + j
        return min(d(i - 1, j) + 1, d(i, j - 1) + 1, d(i - 1, j - 1) + (a[i - 1] != b[j - 1]))

    return d(len(a), len(b))


def test_levenshtein():
    known = [("kitten", "sitting", 3), ("flaw", "lawn", 2), ("", "abc", 3), ("abc", "abc", 0)]
    for a, b, distance in known:
        assert levenshtein(a, b) == levenshtein(b, a) == distance
    assert levenshtein([1, 2, 3], [2, 3, 4]) == 2
    rng = random.Random(0)
    for _ in range(200):
        a, b = ("".join(rng.choices("abc", k=rng.randint(0, 7))) for _ in range(2))
        assert levenshtein(a, b) == brute_levenshtein(a, b), (a, b)
    assert character_error_rate(["kitten", "abc"], ["sitting", "abc"]) == 3 / 10


@pytest.mark.parametrize("which", ["char", "span"])
def test_copy_baseline_matches_brute_force(which, cache_dir, char_dm, span_dm):
    full = {"char": char_dm, "span": span_dm}[which]
    dm = prepared(corruption=which, val_subset=6, cache_dir=cache_dir)
    assert dm.cache_hit  # val_subset doesn't change the data
    pairs = [(s.replace("<mask>", ""), t) for s, t in dm.val_texts(6)]
    expected_cer = sum(brute_levenshtein(s, t) for s, t in pairs) / sum(len(t) for _, t in pairs)
    baseline = dm.copy_baseline()
    assert baseline["cer"] == pytest.approx(expected_cer)
    assert baseline["exact_match"] == sum(s == t for s, t in pairs) / 6
    print(f"{which} copy baseline over {full.config.val_subset}: {full.copy_baseline()}")


def test_second_prepare_is_a_cache_hit(char_dm, cache_dir):
    assert char_dm.cache_hit is False
    again = prepared(batch_size=8, num_workers=0, cache_dir=cache_dir)
    assert again.cache_hit is True
    assert again.val_pairs(5) == char_dm.val_pairs(5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"task": "translate"}, "data.task must be one of ['denoise', 'next_line', 'pairs']"),
        ({"corruption": "word"}, "data.corruption must be one of ['char', 'span'], got 'word'"),
        ({"noise_rate": 1.0}, "data.noise_rate must be a number between 0 and 1, got 1.0"),
        ({"mean_span": 0.5}, "data.mean_span must be a number >= 1, got 0.5"),
        ({"max_source_len": 8}, "data.max_source_len must be an integer >= 16 for denoise, got 8"),
        ({"max_target_len": 16}, "data.max_target_len must be an integer >= 17 for denoise"),
        ({"task": "next_line", "max_target_len": 1}, "data.max_target_len must be an integer >= 2"),
        ({"batch_size": 0}, "data.batch_size must be a positive integer, got 0"),
        ({"val_subset": -1}, "data.val_subset must be a positive integer, got -1"),
        ({"seed": -1}, "data.seed must be a non-negative integer, got -1"),
        ({"val_fraction": 0}, "data.val_fraction must be a number between 0 and 1, got 0"),
        ({"paths": ["a.jsonl"]}, "data.paths and data.hub_name are only read by task=pairs"),
        ({"task": "pairs"}, "task=pairs needs exactly one of data.paths"),
        ({"task": "pairs", "paths": "a.jsonl", "hub_name": "x"}, "needs exactly one of"),
        ({"hub_config": "de-en"}, "data.hub_config must be null without hub_name"),
        ({"cache_dir": ""}, "data.cache_dir must be a directory path, got ''"),
        (
            {"task": "pairs", "hub_name": 5},
            "data.hub_name=5 is not text: Hydra reads numbers and true/false as such; quote it, "
            "e.g. 'data.hub_name=\"5\"'",
        ),
        ({"noise_rate": "a"}, "data.noise_rate must be a finite number, got 'a'"),
        ({"max_source_len": 20.5}, "data.max_source_len must be an integer, got 20.5"),
    ],
)
def test_config_validation_names_the_key(kwargs, message):
    for build in (Seq2SeqDataConfig, Seq2SeqDataModule):
        with pytest.raises(ValueError, match=re.escape(message)):
            build(**kwargs)


def test_use_before_setup_is_explained(tmp_path):
    with pytest.raises(RuntimeError, match="setup"):
        _ = Seq2SeqDataModule(cache_dir=str(tmp_path)).tokenizer
    with pytest.raises(FileNotFoundError, match="prepare_data"):
        Seq2SeqDataModule(cache_dir=str(tmp_path)).setup()
