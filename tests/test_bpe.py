"""Byte-level BPE: trained on the training split, any Unicode round-trips, carried as JSON."""

import json
import pickle

import numpy as np
import pytest

from data.lm import LMDataConfig, LMDataModule
from data.tokenizer import BPETokenizer, load_tokenizer, tokenizer_from_dict

SPECIALS = ("<pad>", "<bos>", "<eos>")
TEXTS = [
    "ROMEO:\nBut, soft! what light through yonder window breaks?",
    "naïve café, Æsop's œuvre — «quoted» ‘curly’",
    "日本語のテキスト and 한국어 and Ελληνικά",
    "emoji 🙂🎭 and a combining e\u0301 and a zero-width\u200bjoiner",
    "  leading, trailing and\t\ttabs \n\n\n newlines  ",
    "",
]


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    text = "\n\n".join(["ROMEO:\nWhat light through yonder window breaks?"] * 50 + TEXTS[:3])
    return BPETokenizer.train(text, vocab_size=300, specials=SPECIALS)


@pytest.mark.parametrize("text", TEXTS)
def test_bpe_round_trips_any_unicode(bpe, text):
    ids = bpe.encode(text)
    assert all(i not in bpe.special_ids for i in ids)
    assert bpe.decode(ids) == text


def test_bpe_round_trips_text_it_never_saw(bpe):
    unseen = "Zebras quiz: ¿Qué tal? ∑ ∫ 𝔉𝔯𝔞𝔨𝔱𝔲𝔯 \x00 \x7f"
    assert bpe.decode(bpe.encode(unseen)) == unseen


def test_bpe_merges_frequent_text_into_fewer_tokens(bpe):
    frequent = "What light through yonder window breaks?"
    assert len(bpe.encode(frequent)) < len(frequent.encode("utf-8")) / 3


def test_bpe_specials_come_first_and_render_by_name(bpe):
    assert (bpe.pad_id, bpe.bos_id, bpe.eos_id, bpe.mask_id) == (0, 1, 2, None)
    assert bpe.vocab_size == 300
    ids = [bpe.bos_id, *bpe.encode("light"), bpe.eos_id]
    assert bpe.decode(ids) == "light"
    assert bpe.decode(ids, skip_special=False) == "<bos>light<eos>"


def test_bpe_save_load_and_dict_round_trip(bpe, tmp_path):
    bpe.save(tmp_path / "tokenizer.json")
    for loaded in (load_tokenizer(tmp_path / "tokenizer.json"), tokenizer_from_dict(bpe.to_dict())):
        assert isinstance(loaded, BPETokenizer)
        assert loaded.specials == list(SPECIALS)
        for text in [*TEXTS, SPECIALS_IN_TEXT]:
            assert loaded.encode(text) == bpe.encode(text)
            assert not set(loaded.encode(text)) & loaded.special_ids


SPECIALS_IN_TEXT = "a text saying <eos> and <pad><bos> is text, as the char tokenizer reads it"


def test_bpe_encodes_a_specials_name_in_text_as_text(bpe):
    ids = bpe.encode(SPECIALS_IN_TEXT)
    assert not set(ids) & bpe.special_ids
    assert bpe.decode(ids) == SPECIALS_IN_TEXT
    assert bpe.encode_batch([SPECIALS_IN_TEXT]) == [ids]
    assert pickle.loads(pickle.dumps(bpe)).encode(SPECIALS_IN_TEXT) == ids


def test_bpe_training_tokens_hold_no_special_spelled_in_the_corpus(tmp_path):
    """Tokenized in 2 worker processes, which get the tokenizer pickled."""
    rows = [f"{SPECIALS_IN_TEXT} {i}" for i in range(40)]
    corpus = tmp_path / "rows.jsonl"
    corpus.write_text("".join(json.dumps({"text": row}) + "\n" for row in rows))
    module = LMDataModule(
        source="text_files",
        paths=[str(corpus)],
        tokenizer="bpe",
        bpe_vocab_size=300,
        block_size=8,
        num_proc=2,
        cache_dir=tmp_path / "cache",
    )
    module.prepare_data()
    module.setup()
    for split in ("train", "val"):
        tokens = np.asarray(module._split(split))
        assert not set(tokens.tolist()) & module.tokenizer.special_ids, split
        assert SPECIALS_IN_TEXT in module.tokenizer.decode(tokens.tolist()), split


def test_bpe_vocab_too_small_names_the_key():
    with pytest.raises(ValueError, match="data.bpe_vocab_size=100 is too small for byte-level BPE"):
        BPETokenizer.train("some text", vocab_size=100)


def test_bpe_vocab_too_small_is_a_config_mistake(tmp_path):
    """Refused with the config's checks, before the corpus is read under progress bars to train
    the tokenizer; a tokenizer given by data.tokenizer_file uses no data.bpe_vocab_size."""
    message = r"^data.bpe_vocab_size=260 is too small for byte-level BPE: it needs at least 261 "
    with pytest.raises(ValueError, match=message):
        LMDataConfig(tokenizer="bpe", bpe_vocab_size=260)
    saved = tmp_path / "tokenizer.json"
    BPETokenizer.train("some text", vocab_size=300).save(saved)
    LMDataConfig(tokenizer="bpe", bpe_vocab_size=260, tokenizer_file=str(saved))


def test_bpe_config_validation():
    with pytest.raises(ValueError, match="data.bpe_vocab_size must be a positive integer"):
        LMDataConfig(tokenizer="bpe", bpe_vocab_size=0)
    with pytest.raises(ValueError, match=r"data.tokenizer must be one of \['char', 'bpe'\]"):
        LMDataConfig(tokenizer="wordpiece")


def test_shakespeare_bpe_data_module(tmp_path):
    """Trained on train text only, cached per vocabulary size, and the token arrays decode back
    to the corpus."""
    dm = LMDataModule(tokenizer="bpe", bpe_vocab_size=400, block_size=16, cache_dir=tmp_path)
    dm.prepare_data()
    dm.setup()
    assert not dm.cache_hit and dm.vocab_size == 400
    assert dm.tokenizer.specials == ["<pad>", "<bos>", "<eos>", "<unk>"]
    assert dm.tokenizer.unk_id == 3
    text = dm.tokenizer.decode(dm._split("val")[:2000].tolist())
    assert text.startswith(dm.tokenizer.decode(dm.val_sample(50).tolist()))
    assert "\n\n" in text and text.isascii()
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (32, 16) and (x[:, 1:] == y[:, :-1]).all() and int(x.max()) < 400

    again = LMDataModule(tokenizer="bpe", bpe_vocab_size=400, block_size=16, cache_dir=tmp_path)
    again.prepare_data()
    assert again.cache_hit
    bigger = LMDataModule(tokenizer="bpe", bpe_vocab_size=500, block_size=16, cache_dir=tmp_path)
    assert bigger.cache_entry != dm.cache_entry


@pytest.mark.parametrize("text", TEXTS + ["𝔉𝔯𝔞𝔨𝔱𝔲𝔯 ¿Qué? 日本語"])
def test_bpe_token_char_counts_sum_to_the_text_length(bpe, text):
    # Tokens may split a multi-byte character; counting lead bytes still adds up exactly.
    counts = bpe.token_char_counts()
    assert len(counts) == bpe.vocab_size and counts[: len(SPECIALS)] == [0] * len(SPECIALS)
    assert sum(counts[i] for i in bpe.encode(text)) == len(text)
