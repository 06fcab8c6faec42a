"""The house's doors run one way: train.py -> training/ -> model/ and data/; generate.py and
export.py -> model/ and the tokenizer; evaluate.py -> model/ and data/'s plain modules. model/
is plain PyTorch, model/ and data/ never import each other, and no room imports an entry point.
Checked in a fresh interpreter, where nothing else has imported anything yet. (Two plain Python
modules sit beside the rooms: errors.py, which every room shares, and kinds.py, the table of
model kinds that training/ and evaluate.py share.)"""

import subprocess
import sys

import pytest

from helpers import ROOT

# What only the training side (training/, train.py) and data/ may load.
TRAINING_STACK = (
    "lightning",
    "pytorch_lightning",
    "hydra",
    "wandb",
    "datasets",
    "data",
    "training",
)


ENTRY_POINTS = {"train", "generate", "export", "evaluate", "report"}


def room_modules(room: str) -> list[str]:
    return sorted(f"{room}.{p.stem}" for p in (ROOT / room).glob("*.py") if p.stem != "__init__")


def loaded_after(code: str) -> set[str]:
    """The names of the modules in sys.modules after running `code` afresh, and of their
    top-level packages."""
    probe = f"{code}\nimport sys\nprint(' '.join(sys.modules))"
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    names = set(result.stdout.split())
    return names | {name.split(".")[0] for name in names}


@pytest.mark.parametrize("module", room_modules("model"))
def test_every_model_module_imports_no_training_stack(module):
    assert not loaded_after(f"import {module}") & {*TRAINING_STACK, *ENTRY_POINTS}


def test_data_imports_neither_model_nor_training_nor_an_entry_point():
    code = "\n".join(f"import {module}" for module in room_modules("data"))
    assert not loaded_after(code) & {"model", "training", *ENTRY_POINTS}


def test_training_imports_no_entry_point():
    code = "\n".join(f"import {module}" for module in room_modules("training"))
    assert not loaded_after(code) & ENTRY_POINTS


@pytest.mark.parametrize("entry_point", ["generate", "export"])
def test_generate_and_export_load_the_model_and_tokenizer_only(entry_point):
    loaded = loaded_after(f"import {entry_point}")
    assert not loaded & {"lightning", "pytorch_lightning", "wandb", "datasets", "training"}
    # the tokenizer, and the plain module it saves its files with
    assert {name for name in loaded if name.startswith("data.")} == {"data.tokenizer", "data.files"}


def test_evaluate_loads_neither_lightning_nor_wandb():
    """It scores a checkpoint with plain PyTorch and data's plain modules, not the DataModules;
    `datasets` loads only when it reads text."""
    loaded = loaded_after("import evaluate")
    assert not loaded & {"lightning", "pytorch_lightning", "wandb", "datasets", "training"}
    assert not loaded & {"data.lm", "data.seq2seq", "data.cache"}


def test_the_table_of_kinds_names_every_model_and_data_config():
    """kinds.py names its LightningModules and DataModules by import path (evaluate.py reads it
    without Lightning): each path is a real class of the right kind, every model kind has a row,
    and every data config feeds one of them."""
    from hydra.utils import get_class
    from lightning import LightningDataModule
    from omegaconf import OmegaConf

    from kinds import KINDS
    from model.checkpoint import MODELS
    from training.module import TrainingModule

    assert set(KINDS) == set(MODELS)
    for kind in KINDS.values():
        module = kind.module_class
        assert issubclass(module, TrainingModule) and module.kind == kind.name
        datamodule = get_class(kind.datamodule)
        assert issubclass(datamodule, LightningDataModule)
        assert all(key in kind.data_options.__dataclass_fields__ for key in kind.lengths)
    targets = {OmegaConf.load(p)["_target_"] for p in (ROOT / "configs" / "data").glob("*.yaml")}
    assert targets == {kind.datamodule for kind in KINDS.values()}
