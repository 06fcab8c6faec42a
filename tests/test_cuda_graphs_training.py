"""compile_mode=reduce-overhead on a GPU: each training step's forward and backward replay as
CUDA graphs, through a run that also validates, records attention maps, drops out and writes
checkpoints; and it trains the model to the losses compile=true's default mode reaches, up to
the order of the attention kernel's sums."""

import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from helpers import TINY, train_run, val_losses

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


def test_steps_replay_as_cuda_graphs(tmp_path, shared_cache):
    # the graph trees log each graph they record
    logged = {**GRAPHS_OR_ERROR, "TORCH_LOGS": "+cudagraphs"}
    dropout = ["model.dropout=0.1", "model.attention.dropout=0.1"]
    train_run(
        tmp_path, *RUN, "compile_mode=reduce-overhead", *dropout, cache_dir=shared_cache, env=logged
    )
    log = (tmp_path / "stderr.txt").read_text()
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
            pool.submit(
                train_run, tmp_path / name, *RUN, *mode, *same, cache_dir=shared_cache, env=env
            )
            for name, (mode, env) in modes.items()
        ]
        for run in runs:
            run.result()
    assert val_losses(tmp_path / "graphs") == pytest.approx(
        val_losses(tmp_path / "default"), abs=1e-2
    )
