"""Shared test set-up: the same state for every test, whatever ran before it, on whichever
machine, in whichever order or worker (pytest-xdist)."""

import os
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from filelock import FileLock

# Also puts the project's root on sys.path: tests import its modules by plain name.
from helpers import CACHE_VARIABLES, TINY, is_foreign, train_run

# Nothing a test does may read or write the user's own caches and settings (Hugging Face
# datasets, W&B, matplotlib), or find what another machine left there. Set before any of those
# libraries is imported, for this process and every command a test starts; the shell's settings
# that would change what they do (HF_HUB_OFFLINE, WANDB_MODE, ...) go.
for variable in [variable for variable in os.environ if is_foreign(variable)]:
    del os.environ[variable]
_HOME = Path(tempfile.mkdtemp(prefix="tinyformer-tests-"))
for variable, folder in CACHE_VARIABLES.items():
    os.environ[variable] = str(_HOME / folder)

# One thread: tiny tensors run faster, two test workers on two cores do not fight over them,
# and float results do not depend on the machine's core count (batch-1 decoding splits its
# products over the threads: the tests of that path set two threads themselves).
torch.set_num_threads(1)


@pytest.fixture
def two_threads():
    """Two intra-op threads (this file runs the tests on one), restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def cpu_flags(monkeypatch):
    """use(flags): the project reads `flags` (names of torch.cpu.get_capabilities' features) as
    this CPU's, through training.precision.cpu_capabilities, the one place it asks; so a test
    checks the choices made for every kind of CPU that CI runs on (AVX2 only, AVX512-BF16, AMX),
    not only for the one it runs on. multiplies_bf16's cached answer is dropped on the way in
    and on the way out."""
    from training import precision

    def use(flags) -> None:
        capabilities = {flag: True for flag in flags}
        monkeypatch.setattr(precision, "cpu_capabilities", lambda: capabilities)
        precision.multiplies_bf16.cache_clear()

    yield use
    precision.multiplies_bf16.cache_clear()


@pytest.fixture(autouse=True)
def same_random_state():
    """Every test starts from seed 0, so none depends on what an earlier one drew."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Remove this process's private caches: in every process that made them (xdist's
    controller and --collect-only too, where no session fixture runs)."""
    shutil.rmtree(_HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory) -> Path:
    """A folder for this test session's shared products: under pytest-xdist, the one all
    workers of this run see (each worker's base temp is a subfolder of it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def shared_cache(shared_dir) -> Path:
    """One prepared-data cache for the session: its entries are built once, under the cache's
    own lock, whichever test or worker asks first."""
    return shared_dir / "cache"


@pytest.fixture(scope="session")
def trained_run(shared_dir, shared_cache) -> Path:
    """A tiny GPT trained once per session (W&B offline, attention maps, checkpoints), for the
    tests that only need *a* trained run and do not change it."""
    run_dir = shared_dir / "trained_run"
    with FileLock(str(shared_dir / "trained_run.lock")):
        if not (run_dir / "stdout.txt").is_file():  # written last, once the run succeeded
            train_run(run_dir, *TINY, cache_dir=shared_cache)
    return run_dir
