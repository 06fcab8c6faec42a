"""Tokenizers map text to integer ids and back. Each one serialises to a JSON dict with a "type"
key, so a checkpoint can carry its tokenizer and `tokenizer_from_dict` can rebuild it.

On disk a tokenizer is two files: `tokenizer.json`, in the Hugging Face `tokenizers` library's
own format, so `tokenizers.Tokenizer.from_file` and `transformers.PreTrainedTokenizerFast` load
it and give our ids, and beside it `tinyformer_tokenizer.json`, what only tinyformer reads (which
of our tokenizers it is and its special tokens). `load_tokenizer` reads both, and also the
single tokenizer.json of older versions, which held the JSON dict itself."""

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from data.files import write_text_atomic

# The mask token's name: what a span-corrupted source holds for each span it lost.
MASK_TOKEN = "<mask>"


class SpecialTokens:
    """Ids of the special tokens, which come first in every vocabulary (ids 0..n-1)."""

    specials: list[str]

    def _special(self, name: str) -> int | None:
        return self.specials.index(name) if name in self.specials else None

    @property
    def pad_id(self) -> int | None:
        return self._special("<pad>")

    @property
    def bos_id(self) -> int | None:
        return self._special("<bos>")

    @property
    def eos_id(self) -> int | None:
        return self._special("<eos>")

    @property
    def mask_id(self) -> int | None:
        return self._special(MASK_TOKEN)

    @property
    def unk_id(self) -> int | None:
        return self._special("<unk>")

    @property
    def special_ids(self) -> set[int]:
        return set(range(len(self.specials)))

    def encode_with_masks(self, text: str) -> list[int]:
        """`text` as ids, each "<mask>" in it as mask_id: a denoising encoder-decoder's source
        as a person types it, and as train.py prints one. `encode` spells the name out, as it
        must in training text; so does this for a tokenizer without a mask token."""
        mask = self.mask_id
        if mask is None:
            return self.encode(text)
        pieces = text.split(MASK_TOKEN)
        try:
            encoded = self.encode_batch(pieces)
        except ValueError:
            # A piece's error names that piece's unknown characters; the whole text's, all.
            self.encode("".join(pieces))
            raise
        ids = encoded[0]
        for piece in encoded[1:]:
            ids += [mask, *piece]
        return ids


class CharTokenizer(SpecialTokens):
    """One token per character; the vocabulary is the sorted set of characters it was built from.

    Optional special tokens (e.g. "<pad>", "<bos>", "<eos>", "<mask>") take ids 0..n-1 and the
    characters follow. Specials mark structure, not text: `encode` never produces them (but
    `encode_with_masks` reads "<mask>" as the mask, for sources people type), and `decode`
    leaves them out unless asked to render them by name.
    """

    def __init__(self, chars: Sequence[str], specials: Sequence[str] = ()):
        if any(len(c) != 1 for c in chars) or len(set(chars)) != len(chars):
            raise ValueError(f"CharTokenizer needs distinct single characters, got {chars!r}")
        if len(set(specials)) != len(specials) or set(specials) & set(chars) or "" in specials:
            raise ValueError(
                f"CharTokenizer specials must be distinct non-empty names that are not "
                f"characters of the vocabulary, got {specials!r}"
            )
        self.chars = list(chars)
        self.specials = list(specials)
        self._tokens = self.specials + self.chars
        self._ids = {c: i for i, c in enumerate(self.chars, start=len(self.specials))}

    @classmethod
    def from_text(cls, text: str, specials: Sequence[str] = ()) -> "CharTokenizer":
        return cls(sorted(set(text)), specials)

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def encode(self, text: str) -> list[int]:
        try:
            return [self._ids[c] for c in text]
        except KeyError:
            unknown = list(dict.fromkeys(c for c in text if c not in self._ids))
            shown = ", ".join(repr(c) for c in unknown[:5]) + (", ..." if len(unknown) > 5 else "")
            raise ValueError(
                f"text contains {len(unknown)} character(s) not in the vocabulary: {shown}; "
                "the char tokenizer's vocabulary was built from the training corpus, "
                "so use only characters that occur there"
            ) from None

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """Text for `ids`; with skip_special=False specials appear by name, e.g. "<mask>"."""
        n = len(self.specials)
        return "".join(self._tokens[i] for i in ids if not (skip_special and 0 <= i < n))

    def known(self, text: str) -> str:
        """`text` without the characters that have no id."""
        return "".join(c for c in text if c in self._ids) if set(text) - self._ids.keys() else text

    def token_char_counts(self) -> list[int]:
        """Characters each id stands for: 1, or 0 for a special."""
        return [0] * len(self.specials) + [1] * len(self.chars)

    def to_dict(self) -> dict:
        return {"type": "char", "chars": self.chars, "specials": self.specials}

    @classmethod
    def from_dict(cls, d: dict) -> "CharTokenizer":
        return cls(d["chars"], d.get("specials", ()))  # files saved before specials have none

    def save(self, path: str | os.PathLike) -> None:
        """Write `path` (a tokenizer.json) and its extras file beside it; see `load_tokenizer`."""
        _save(Path(path), self._library_tokenizer(), "char", self.specials)

    def _library_tokenizer(self) -> Tokenizer:
        """This tokenizer as a `tokenizers.Tokenizer` giving the same ids: a word-level model
        whose words are single characters, each character split off as its own word, and the
        tokens joined with nothing between them when decoding.

        Text that spells a special's name, e.g. "<mask>", is where the two differ: `encode`
        gives its characters' ids, while the library always matches added tokens in text and
        gives the special's id; its switch against that (`encode_special_tokens`) is not saved
        in its file. Both refuse a character outside the vocabulary: the model's unknown token
        is "", which no vocabulary holds (specials are non-empty, characters single)."""
        vocab = {token: i for i, token in enumerate(self._tokens)}
        tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=""))
        # [\s\S]: any one character, newlines included, which "." would not match
        tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        tokenizer.decoder = decoders.Fuse()
        # Registered as special, so decoding with skip_special_tokens leaves them out, as ours does
        tokenizer.add_special_tokens(self.specials)
        return tokenizer

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CharTokenizer":
        tokenizer = load_tokenizer(path)
        if not isinstance(tokenizer, cls):
            raise ValueError(f"{path} holds a {type(tokenizer).__name__}, not a {cls.__name__}")
        return tokenizer


class BPETokenizer(SpecialTokens):
    """Byte-level BPE (Hugging Face `tokenizers`): any Unicode text encodes, with no unknown
    token, since every byte has an id; merges learned from the training text make common
    character runs single tokens. Specials take ids 0..n-1, as in CharTokenizer.
    """

    def __init__(self, tokenizer: Tokenizer, specials: Sequence[str] = ()):
        self._tokenizer = tokenizer
        # Text that spells a special's name ("<eos>" in a document or a prompt) is encoded as
        # that text, as CharTokenizer does, not as the special: a corpus can't end documents or
        # pad on its own. The library's switch is not saved in its file, so it is set here (on
        # the tokenizer given, which every caller made for this one).
        tokenizer.encode_special_tokens = True
        self.specials = list(specials)

    def __reduce__(self) -> tuple:
        # Pickled (for datasets' worker processes, data.num_proc) by way of __init__, which sets
        # the switch above: the library pickles its tokenizer as its file, without the switch.
        return type(self).from_dict, (self.to_dict(),)

    @classmethod
    def train(
        cls, texts: str | Iterable[str], vocab_size: int, specials: Sequence[str] = ()
    ) -> "BPETokenizer":
        """Learn merges from `texts`, an iterable of training units (streamed, never held all at
        once) or one string, which is cut into paragraphs. Merges never cross a unit's end."""
        check_bpe_vocab_size(vocab_size, specials)
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(specials),
            initial_alphabet=alphabet,
            show_progress=False,
        )
        units = texts.split("\n\n") if isinstance(texts, str) else texts
        tokenizer.train_from_iterator(units, trainer=trainer)
        return cls(tokenizer, specials)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` of each text, in parallel threads."""
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [e.ids for e in encodings]

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special)

    def token_char_counts(self) -> list[int]:
        """Characters each id stands for, counted as the UTF-8 lead bytes among its bytes: a
        token may hold part of a character, but summing over any encoded text gives exactly its
        length. Specials count 0."""
        byte_of = _byte_level_bytes()
        counts = [0] * self.vocab_size
        for token, i in self._tokenizer.get_vocab().items():
            if i >= len(self.specials):
                counts[i] = sum(byte_of[ch] & 0xC0 != 0x80 for ch in token)
        return counts

    def to_dict(self) -> dict:
        return {"type": "bpe", "tokenizer": self._tokenizer.to_str(), "specials": self.specials}

    @classmethod
    def from_dict(cls, d: dict) -> "BPETokenizer":
        return cls(Tokenizer.from_str(d["tokenizer"]), d.get("specials", ()))

    def save(self, path: str | os.PathLike) -> None:
        """Write `path` (a tokenizer.json) and its extras file beside it; see `load_tokenizer`."""
        _save(Path(path), self._tokenizer, "bpe", self.specials)


def check_bpe_vocab_size(vocab_size: int, specials: Sequence[str]) -> None:
    """`vocab_size` holds a byte-level BPE's 256 bytes, `specials` and one merge, else an error
    naming data.bpe_vocab_size."""
    least = len(pre_tokenizers.ByteLevel.alphabet()) + len(specials) + 1
    if vocab_size < least:
        raise ValueError(
            f"data.bpe_vocab_size={vocab_size} is too small for byte-level BPE: it needs at "
            f"least {least} (256 bytes, the special tokens and one merge)"
        )


def _byte_level_bytes() -> dict[str, int]:
    """The byte each character of a byte-level BPE token stands for. Byte-level BPE spells bytes
    as printable characters: printable Latin-1 bytes as themselves, the other 68 bytes as
    U+0100 onwards, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    shifted = (b for b in range(256) if b not in printable)
    return {chr(b): b for b in printable} | {chr(0x100 + n): b for n, b in enumerate(shifted)}


TOKENIZERS = {"char": CharTokenizer, "bpe": BPETokenizer}
# The `tokenizers` model each of our tokenizers saves as.
LIBRARY_MODELS = {"char": models.WordLevel, "bpe": models.BPE}


def token_dtype(tokenizer: CharTokenizer | BPETokenizer) -> type:
    """The narrowest unsigned type that holds every id of `tokenizer`: what cached token arrays
    are stored in."""
    return np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32


def tokenizer_from_dict(d: dict) -> CharTokenizer | BPETokenizer:
    kind = d.get("type")
    if kind not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer type {kind!r}; known types: {sorted(TOKENIZERS)}")
    return TOKENIZERS[kind].from_dict(d)


def _extras_path(path: str | os.PathLike) -> Path:
    """The file of tinyformer's own fields saved beside the tokenizer file `path`:
    tinyformer_tokenizer.json beside tokenizer.json."""
    path = Path(path)
    return path.with_name(f"tinyformer_{path.name}")


def load_tokenizer(path: str | os.PathLike) -> CharTokenizer | BPETokenizer:
    """The tokenizer saved at `path`: a `tokenizers` tokenizer.json and its extras file beside
    it, or a tokenizer.json of older versions, which holds our JSON dict alone."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer file at {path}; check the path")
    saved = _read_json(path)
    if saved.keys() == {"type", "specials"}:  # the extras file itself
        partner = path.with_name(path.name.removeprefix("tinyformer_"))
        raise ValueError(
            f"{path} holds the type and special tokens that tinyformer saves beside a "
            f"tokenizer.json: give that file ({partner})"
        )
    if "type" in saved:  # our dict: the `tokenizers` format has no top-level "type"
        return tokenizer_from_dict(saved)
    if "model" not in saved:  # every `tokenizers` file has its model
        raise ValueError(
            f"{path} is JSON but no tokenizer file: give a tokenizer.json that tinyformer saved "
            "(a run's, or an export's)"
        )
    extras_file = _extras_path(path)
    if not extras_file.is_file():
        raise FileNotFoundError(
            f"{path} has no {extras_file.name} beside it, which tinyformer saves with it (the "
            "tokenizer's type and special tokens); copy the two files together"
        )
    extras = _read_json(extras_file)
    kind, specials = extras.get("type"), extras.get("specials", [])
    if kind not in TOKENIZERS:
        raise ValueError(
            f"{extras_file}: unknown tokenizer type {kind!r}; known: {sorted(TOKENIZERS)}"
        )
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as error:  # the library raises a bare Exception
        raise ValueError(f"{path} is not a readable tokenizers file ({error})") from None
    tokens = [tokenizer.id_to_token(i) for i in range(tokenizer.get_vocab_size())]
    # Two files can be paired wrongly (copied from different runs): say so rather than load a
    # tokenizer whose special ids mean something else.
    if not isinstance(tokenizer.model, LIBRARY_MODELS[kind]) or tokens[: len(specials)] != specials:
        raise ValueError(
            f"{path} and {extras_file.name} do not belong together: the latter describes a "
            f"{kind} tokenizer with specials {specials}; save the tokenizer again"
        )
    if kind == "char":
        return CharTokenizer(tokens[len(specials) :], specials)
    return BPETokenizer(tokenizer, specials)


def _read_json(path: Path) -> dict:
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as error:  # not UTF-8, or not JSON: e.g. a file cut short
        why = str(error)
    else:
        if isinstance(saved, dict):
            return saved
        why = "not a JSON object"
    raise ValueError(
        f"{path} cannot be read as a tokenizer file ({why}): give a tokenizer.json that "
        "tinyformer saved (a run's, or an export's)"
    )


def _save(path: Path, tokenizer: Tokenizer, kind: str, specials: list[str]) -> None:
    # The extras first: a save cut short between the two writes leaves the previous
    # tokenizer.json (which load_tokenizer checks against them) or none, never a new
    # tokenizer.json without its extras.
    write_text_atomic(_extras_path(path), json.dumps({"type": kind, "specials": specials}))
    write_text_atomic(path, tokenizer.to_str())
