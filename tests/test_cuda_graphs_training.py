"""compile_mode=reduce-overhead on a GPU: each training step's forward and backward replay as
CUDA graphs, through a run that also validates, records attention maps, drops out and writes
checkpoints; and it trains the model to the losses compile=true's default mode reaches, up to
the order of the attention kernel's sums."""

import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from helpers import TINY, run_script

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")

RUN = [
    *TINY,
    "trainer=gpu",
    "trainer.max_steps=60",
    "callbacks.attention_maps.every_n_steps=20",
    "compile=true",
    "logger=csv",
]


# Any graph that torch.compile would run without CUDA graphs is an error.
GRAPHS_OR_ERROR = {"TORCHINDUCTOR_CUDAGRAPH_OR_ERROR": "1"}


def val_losses(run_dir: Path) -> list[float]:
    history = json.loads((run_dir / "summary.json").read_text())["history"]
    return [row["val/loss"] for row in history if "val/loss" in row]


def train(run_dir: Path, cache: Path, *overrides: str, env: dict | None = None) -> str:
    result = run_script(
        "train.py", *RUN, *overrides, f"hydra.run.dir={run_dir}", cache_dir=cache, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


def test_steps_replay_as_cuda_graphs(tmp_path, shared_cache):
    # the graph trees log each graph they record
    logged = {**GRAPHS_OR_ERROR, "TORCH_LOGS": "+cudagraphs"}
    dropout = ["model.dropout=0.1", "model.attention.dropout=0.1"]
    log = train(tmp_path, shared_cache, "compile_mode=reduce-overhead", *dropout, env=logged)
    # at least the training step's forward and backward, and validation's forward
    assert sum("Recording function" in line for line in log.splitlines()) >= 3, log[-3000:]
    losses = val_losses(tmp_path)
    assert len(losses) == 3 and all(map(math.isfinite, losses)) and losses[-1] < losses[0]
    assert (tmp_path / "checkpoints" / "last.ckpt").exists()


def test_replayed_steps_train_as_the_default_mode_does(tmp_path, shared_cache):
    # Without dropout the two modes run the same kernels on the same batches: replaying them
    # as graphs changes nothing but the launches. The attention kernel's backward sums in no
    # fixed order, which moves the losses in the third digit at most; a graph replaying stale
    # inputs (one batch over and over) would move them by a tenth. The two runs share the GPU.
    modes = {"default": ([], None), "graphs": (["compile_mode=reduce-overhead"], GRAPHS_OR_ERROR)}
    same = ["model.dropout=0.0", "model.attention.dropout=0.0"]
    with ThreadPoolExecutor(2) as pool:
        runs = [
            pool.submit(train, tmp_path / name, shared_cache, *mode, *same, env=env)
            for name, (mode, env) in modes.items()
        ]
        for run in runs:
            run.result()
    assert val_losses(tmp_path / "graphs") == pytest.approx(
        val_losses(tmp_path / "default"), abs=1e-2
    )
