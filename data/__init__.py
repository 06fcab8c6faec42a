"""Corpora, tokenizers and the Lightning data module that feeds token blocks to the models."""

from data.lm import LMDataConfig, LMDataModule
from data.sources import load_shakespeare, normalise_play, shakespeare_files, train_val_split
from data.tokenizer import CharTokenizer, load_tokenizer, tokenizer_from_dict

__all__ = [
    "CharTokenizer",
    "LMDataConfig",
    "LMDataModule",
    "load_shakespeare",
    "load_tokenizer",
    "normalise_play",
    "shakespeare_files",
    "tokenizer_from_dict",
    "train_val_split",
]
