"""Shared test set-up."""

import sys
from pathlib import Path

import pytest
import torch

# Tests import the project's packages and helpers (tests/wandb_offline.py) by plain name.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@pytest.fixture
def one_thread():
    """Seed 0 and one torch thread: tiny tensors run faster, and a busy machine cannot slow
    them by thread contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(threads)
