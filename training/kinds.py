"""The one table of model kinds: for each, its config (from model/checkpoint.py's MODELS, which
also holds its network, for generate.py to read without the training stack), the
LightningModule that trains it, the DataModule that feeds it, and the data choices that provide
that DataModule. A new kind of model is a row here, a row in MODELS, and a row in evaluate.py's
KINDS (what it scores a checkpoint of that kind on: evaluate.py runs without Lightning, so it
cannot read this table)."""

from dataclasses import dataclass

from omegaconf import DictConfig

from data.lm import LMDataModule
from data.seq2seq import Seq2SeqDataModule
from model.checkpoint import MODELS
from training.module import LanguageModelModule, Seq2SeqModule, TrainingModule


@dataclass(frozen=True)
class ModelKind:
    name: str
    config: type
    module: type[TrainingModule]
    datamodule: type
    data_choices: str


def _target(cls: type) -> str:
    """How a config's `_target_` names `cls`."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _kind(name: str, module: type[TrainingModule], datamodule: type, choices: str) -> ModelKind:
    config, _network = MODELS[name]
    return ModelKind(name, config, module, datamodule, choices)


KINDS = {
    kind.name: kind
    for kind in (
        _kind(
            "gpt",
            LanguageModelModule,
            LMDataModule,
            "data=shakespeare_char, data=shakespeare_bpe, data=text_files or data=hub",
        ),
        _kind(
            "encdec",
            Seq2SeqModule,
            Seq2SeqDataModule,
            "data=shakespeare_denoise, data=shakespeare_next_line or data=pairs",
        ),
    )
}


def kind_of(model: DictConfig) -> ModelKind:
    """The kind whose config `model` (a `model` config node) instantiates, read from its target
    without instantiating it."""
    for kind in KINDS.values():
        if model.get("_target_") == _target(kind.config):
            return kind
    raise ValueError(f"model._target_={model.get('_target_')!r} is not one of the model configs")


def check_fits_data(kind: ModelKind, data: DictConfig, choices: dict) -> None:
    """Before the data config is instantiated: its interpolations may name keys that only the
    fitting model has (a character GPT's data reads model.block_size). `choices` are Hydra's
    runtime choices, for the message."""
    if data.get("_target_") != _target(kind.datamodule):
        raise ValueError(
            f"model={choices.get('model')} cannot train on data={choices.get('data')}: use "
            f"{kind.data_choices}"
        )
