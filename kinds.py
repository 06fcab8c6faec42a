"""The one table of model kinds: for each, its network and config (model/checkpoint.py's
MODELS, which generate.py reads without data/ or the training stack), the LightningModule that
trains it, the DataModule that feeds it, the lengths the model and its data share, the data
choices that fit it, and what evaluate.py scores it on by default where a checkpoint does not
record its run's data. A new kind of model is a row here and a row in MODELS.

Plain Python, beside errors.py, because both sides read it: train.py (through training/) and
evaluate.py, which runs without Lightning. So the LightningModule and the DataModule are named
by their import paths (the DataModule's as configs/data/*.yaml name it in `_target_`), not
imported."""

from dataclasses import dataclass

from hydra.utils import get_class
from omegaconf import DictConfig

from data.lm_text import LMDataConfig
from data.seq2seq_text import Seq2SeqDataConfig
from model.checkpoint import MODELS


@dataclass(frozen=True)
class ModelKind:
    name: str  # what a checkpoint records as its "kind"
    label: str  # in messages: "a GPT"
    module: str  # the LightningModule's import path
    datamodule: str  # the DataModule's import path, as data configs' _target_ give it
    data_options: type  # the DataModule's options, a plain dataclass: what evaluate.py checks
    data_choices: str  # the data= choices it trains on, in messages
    eval_data_choices: str  # the data= choices evaluate.py scores it on, in messages
    lengths: tuple[str, ...]  # the model's length limits, which its data shares
    # The data evaluate.py scores when no data= is chosen and the checkpoint does not record its
    # run's (which it scores otherwise)
    eval_default: dict

    @property
    def config(self) -> type:
        """The model's config class."""
        return MODELS[self.name][0]

    @property
    def module_class(self) -> type:
        """The LightningModule class, imported only here, on the training side's first use."""
        return get_class(self.module)


KINDS = {
    kind.name: kind
    for kind in (
        ModelKind(
            name="gpt",
            label="a GPT",
            module="training.module.LanguageModelModule",
            datamodule="data.lm.LMDataModule",
            data_options=LMDataConfig,
            data_choices="data=shakespeare_char, data=shakespeare_bpe, data=text_files or data=hub",
            eval_data_choices="data=text_files or data=hub",
            lengths=("block_size",),
            eval_default={"source": "shakespeare"},
        ),
        ModelKind(
            name="encdec",
            label="an encoder-decoder",
            module="training.module.Seq2SeqModule",
            datamodule="data.seq2seq.Seq2SeqDataModule",
            data_options=Seq2SeqDataConfig,
            data_choices="data=shakespeare_denoise, data=shakespeare_next_line or data=pairs",
            eval_data_choices="data=pairs",
            lengths=("max_source_len", "max_target_len"),
            eval_default={"task": "denoise"},
        ),
    )
}


def import_path(cls: type) -> str:
    """How a config's `_target_` names `cls`."""
    return f"{cls.__module__}.{cls.__qualname__}"


def kind_of(model: DictConfig) -> ModelKind:
    """The kind whose config `model` (a `model` config node) instantiates, read from its target
    without instantiating it."""
    for kind in KINDS.values():
        if model.get("_target_") == import_path(kind.config):
            return kind
    raise ValueError(f"model._target_={model.get('_target_')!r} is not one of the model configs")
