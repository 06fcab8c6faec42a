"""Shared test set-up: the same state for every test, whatever ran before it, on whichever
machine, in whichever order or worker (pytest-xdist)."""

import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import CACHE_VARIABLES

# Tests import the project's packages and helpers (tests/helpers.py) by plain name.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Nothing a test does may read or write the user's own caches and settings (Hugging Face
# datasets, W&B, matplotlib), or find what another machine left there. Set before any of those
# libraries is imported, for this process and every command a test starts.
_HOME = Path(tempfile.mkdtemp(prefix="tinyformer-tests-"))
for variable, folder in CACHE_VARIABLES.items():
    os.environ[variable] = str(_HOME / folder)

# One thread: tiny tensors run faster, two test workers on two cores do not fight over them,
# and float results do not depend on the machine's core count.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def same_random_state():
    """Every test starts from seed 0, so none depends on what an earlier one drew."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="session")
def remove_private_caches():
    yield
    shutil.rmtree(_HOME, ignore_errors=True)
