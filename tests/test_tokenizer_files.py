"""Saved tokenizers are the `tokenizers` library's tokenizer.json, which the library and
`transformers` load and which give our ids, plus tinyformer_tokenizer.json beside it; a
tokenizer.json of older versions (our dict alone) still loads."""

import json
import re

import pytest
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from data.lm import BPE_SPECIALS
from data.seq2seq import SPECIALS
from data.tokenizer import BPETokenizer, CharTokenizer, load_tokenizer

# Spaces before punctuation too, which a decoder that "cleans up" spaces would drop.
TEXT = 'ROMEO:\nBut , soft! what light (through) yonder\n\n  window breaks ?\t"\'Tis" 3-4 ; é .\n'


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    corpus = "\n\n".join([TEXT] * 20 + ["naïve café, Æsop's œuvre — «quoted»"])
    return BPETokenizer.train(corpus, vocab_size=300, specials=BPE_SPECIALS)


@pytest.fixture
def char() -> CharTokenizer:
    return CharTokenizer.from_text(TEXT, SPECIALS)


def library_loads(path) -> dict:
    """The tokenizer.json at `path` as each library loads it, by name."""
    return {
        "tokenizers": Tokenizer.from_file(str(path)),
        "transformers": PreTrainedTokenizerFast(tokenizer_file=str(path)),
    }


def library_encode(tokenizer, text: str) -> list[int]:
    if isinstance(tokenizer, Tokenizer):
        return tokenizer.encode(text).ids
    return tokenizer.encode(text)


def test_the_char_tokenizer_json_gives_our_ids(char, tmp_path):
    path = tmp_path / "tokenizer.json"
    char.save(path)
    ours = char.encode(TEXT)
    framed = [char.bos_id, *ours[:5], char.mask_id, *ours[5:], char.eos_id, char.pad_id]
    for name, loaded in library_loads(path).items():
        assert library_encode(loaded, TEXT) == ours, name
        assert loaded.decode(ours) == TEXT, name
        assert loaded.decode(framed, skip_special_tokens=True) == char.decode(framed) == TEXT
        shown = loaded.decode(framed, skip_special_tokens=False)
        assert shown == char.decode(framed, skip_special=False), name
        assert shown.startswith("<bos>ROMEO<mask>:\n") and shown.endswith("\n<eos><pad>")


def test_the_char_tokenizer_json_refuses_unknown_characters_as_ours_does(char, tmp_path):
    char.save(tmp_path / "tokenizer.json")
    with pytest.raises(ValueError, match="not in the vocabulary: 'z'"):
        char.encode("zebra")
    for loaded in library_loads(tmp_path / "tokenizer.json").values():
        with pytest.raises(Exception, match="Missing .* token"):
            library_encode(loaded, "zebra")


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_a_specials_name_in_text_is_the_files_one_difference(kind, tmp_path):
    # Documented in CharTokenizer._library_tokenizer and BPETokenizer.__init__: ours encodes the
    # name's characters, the library matches the special token (its switch against that is not
    # saved in the file).
    text = "<mask> me" if kind == "char" else "<eos> me"
    tokenizer = (
        CharTokenizer.from_text(text, SPECIALS)
        if kind == "char"
        else BPETokenizer.train(text * 20, vocab_size=300, specials=BPE_SPECIALS)
    )
    special = tokenizer.mask_id if kind == "char" else tokenizer.eos_id
    tokenizer.save(tmp_path / "tokenizer.json")
    loaded = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    name = text.split(" ")[0]
    spelled = tokenizer.encode(name)
    assert len(spelled) > 1 and not set(spelled) & tokenizer.special_ids
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert loaded.encode(text).ids == [special, *tokenizer.encode(" me")]


def test_the_bpe_tokenizer_json_gives_our_ids(bpe, tmp_path):
    path = tmp_path / "tokenizer.json"
    bpe.save(path)
    ours = bpe.encode(TEXT)
    assert len(ours) < len(TEXT) / 2  # merges were learned and are used
    framed = [bpe.bos_id, *ours, bpe.eos_id, bpe.pad_id]
    for name, loaded in library_loads(path).items():
        assert library_encode(loaded, TEXT) == ours, name
        assert loaded.decode(framed, skip_special_tokens=True) == bpe.decode(framed) == TEXT, name
        shown = loaded.decode(framed, skip_special_tokens=False)
        assert shown == bpe.decode(framed, skip_special=False) == f"<bos>{TEXT}<eos><pad>", name


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_load_tokenizer_reads_back_an_equal_tokenizer(kind, char, bpe, tmp_path):
    tokenizer = {"char": char, "bpe": bpe}[kind]
    tokenizer.save(tmp_path / "tokenizer.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "tinyformer_tokenizer.json",
        "tokenizer.json",
    ]
    extras = json.loads((tmp_path / "tinyformer_tokenizer.json").read_text())
    assert extras == {"type": kind, "specials": tokenizer.specials}
    loaded = load_tokenizer(tmp_path / "tokenizer.json")
    assert type(loaded) is type(tokenizer) and loaded.to_dict() == tokenizer.to_dict()
    assert loaded.encode(TEXT) == tokenizer.encode(TEXT)
    assert loaded.token_char_counts() == tokenizer.token_char_counts()


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_a_tokenizer_json_of_the_old_format_still_loads(kind, char, bpe, tmp_path):
    tokenizer = {"char": char, "bpe": bpe}[kind]
    old = tmp_path / "tokenizer.json"
    old.write_text(json.dumps(tokenizer.to_dict()))  # what versions before wrote, alone
    loaded = load_tokenizer(old)
    assert type(loaded) is type(tokenizer) and loaded.to_dict() == tokenizer.to_dict()
    assert loaded.encode(TEXT) == tokenizer.encode(TEXT)


def test_a_tokenizer_json_without_its_extras_is_explained(char, tmp_path):
    char.save(tmp_path / "tokenizer.json")
    (tmp_path / "tinyformer_tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json has no tinyformer_tokenizer.json"):
        load_tokenizer(tmp_path / "tokenizer.json")


def test_files_of_two_tokenizers_are_not_paired(char, bpe, tmp_path):
    char.save(tmp_path / "tokenizer.json")
    bpe.save(tmp_path / "other.json")
    (tmp_path / "tinyformer_other.json").replace(tmp_path / "tinyformer_tokenizer.json")
    with pytest.raises(ValueError, match="do not belong together: .* a bpe tokenizer"):
        load_tokenizer(tmp_path / "tokenizer.json")


@pytest.mark.parametrize("name", ["tokenizer.json", "tinyformer_tokenizer.json"])
def test_a_truncated_file_is_named(name, char, tmp_path):
    char.save(tmp_path / "tokenizer.json")
    damaged = tmp_path / name
    damaged.write_bytes(damaged.read_bytes()[:-10])
    with pytest.raises(
        ValueError, match=f"{re.escape(str(damaged))} cannot be read as a tokenizer file"
    ):
        load_tokenizer(tmp_path / "tokenizer.json")
