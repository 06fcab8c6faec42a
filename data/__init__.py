"""Corpora, tokenizers and the Lightning data modules that feed token blocks (language model)
and padded (source, target) pairs (encoder-decoder) to the models."""

from data.lm import LMDataConfig, LMDataModule
from data.metrics import character_error_rate, levenshtein
from data.seq2seq import Seq2SeqDataConfig, Seq2SeqDataModule
from data.sources import load_shakespeare, normalise_play, shakespeare_files, train_val_split
from data.tokenizer import CharTokenizer, load_tokenizer, tokenizer_from_dict

__all__ = [
    "CharTokenizer",
    "LMDataConfig",
    "LMDataModule",
    "Seq2SeqDataConfig",
    "Seq2SeqDataModule",
    "character_error_rate",
    "levenshtein",
    "load_shakespeare",
    "load_tokenizer",
    "normalise_play",
    "shakespeare_files",
    "tokenizer_from_dict",
    "train_val_split",
]
