"""The house's doors run one way: model/ is plain PyTorch, and generate.py loads no training
stack. Checked in a fresh interpreter, where nothing else has imported anything yet."""

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


@pytest.mark.parametrize(
    "module", sorted(p.stem for p in (ROOT / "model").glob("*.py") if p.stem != "__init__")
)
def test_every_model_module_imports_no_training_stack(module):
    assert not loaded_after(f"import model.{module}") & set(TRAINING_STACK)


def test_generate_loads_the_model_and_tokenizer_only():
    loaded = loaded_after("import generate")
    assert not loaded & {"lightning", "pytorch_lightning", "wandb", "datasets", "training"}
    assert {name for name in loaded if name.startswith("data.")} == {"data.tokenizer"}
