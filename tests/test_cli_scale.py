"""End to end through train.py: a user's own text files, and data-parallel training with two real
processes (trainer=ddp_cpu, gloo) sharing one run directory, one W&B run and one set of
checkpoints while each trains on its own shard of the data."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers import TINY, run_script, train_run
from wandb_offline import config, history

# One worker runs this file (pytest-xdist --dist loadgroup), so its module fixtures train once.
pytestmark = pytest.mark.xdist_group("ddp_run")

SPEECH = "{name}:\nWhat light through yonder window breaks? It is the east, number {i}.\n"


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("scale_cache")


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, cache) -> Path:
    overrides = [*TINY, "trainer=ddp_cpu", "callbacks=batch_log", "data.batch_size=8"]
    overrides += ["callbacks.progress_bar.every_seconds=1e9"]  # a line at each validation only
    return train_run(tmp_path_factory.mktemp("run_ddp"), *overrides, cache_dir=cache)


@pytest.mark.slow
def test_ddp_cpu_run_has_one_set_of_checkpoints_and_one_wandb_run(ddp_run):
    checkpoints = sorted(p.name for p in (ddp_run / "checkpoints").iterdir())
    assert len(checkpoints) == 2 and checkpoints[0].startswith("best-step"), checkpoints
    assert checkpoints[1] == "last.ckpt"
    assert len(list(ddp_run.glob("wandb/offline-run-*"))) == 1
    assert config(ddp_run)["trainer"]["devices"] == 2
    rows = history(ddp_run)
    assert [r["trainer/global_step"] for r in rows if "val/loss" in r] == [19, 39, 59, 79]
    # Printed once (by rank zero), not once per process.
    stdout = (ddp_run / "stdout.txt").read_text()
    assert stdout.count("best checkpoint:") == 1 and stdout.count("parameters;") == 1
    assert stdout.count("step 80/80 (100%)") == 1  # the progress line of the last validation
    # and no advice to sync validation metrics, which are reduced over the ranks already
    assert "sync_dist" not in (ddp_run / "stderr.txt").read_text()
    saved = torch.load(ddp_run / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 80


@pytest.mark.slow
def test_ddp_cpu_ranks_train_on_disjoint_batches(ddp_run):
    logs = {}
    for rank in (0, 1):
        lines = (ddp_run / "batches" / f"rank{rank}.jsonl").read_text().splitlines()
        logs[rank] = [json.loads(line) for line in lines]
    for rank, records in logs.items():
        assert [r["step"] for r in records] == list(range(80))
        assert {r["rank"] for r in records} == {rank}
        assert all(len(r["examples"]) == 8 for r in records)  # data.batch_size per process
    for step in range(80):
        assert not set(logs[0][step]["examples"]) & set(logs[1][step]["examples"])
    seen = [{e for r in logs[rank] for e in r["examples"]} for rank in (0, 1)]
    assert not seen[0] & seen[1]  # over the whole run, not just within each step
    assert len(seen[0]) == len(seen[1]) == 80 * 8


@pytest.mark.slow
def test_text_files_run_trains_and_generates(tmp_path):
    cache = tmp_path / "cache"  # its own: the test deletes an entry
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    names = ["ROMEO", "JULIET", "NURSE"]
    for part in range(3):
        speeches = [
            SPEECH.format(name=names[i % 3], i=i) for i in range(part * 100, part * 100 + 100)
        ]
        (corpus / f"part{part}.txt").write_text("\n".join(speeches))
    overrides = [*TINY, "data=text_files", f"data.paths=[{corpus}/*.txt]", "data.tokenizer=bpe"]
    overrides += ["data.bpe_vocab_size=300", "logger=csv"]
    run_dir = train_run(tmp_path / "run", *overrides, cache_dir=cache)
    (metrics,) = run_dir.glob("csv/**/metrics.csv")
    lines = metrics.read_text().splitlines()
    header = lines[0].split(",")
    column = header.index("val/loss")
    val = [float(row.split(",")[column]) for row in lines[1:] if row.split(",")[column]]
    assert len(val) == 4 and val[-1] < 0.5 * val[0], val
    assert (run_dir / "tokenizer.json").is_file()

    # Resuming rebuilds the data with the checkpoint's tokenizer, never a retrained one, even
    # when the cache is gone.
    shutil.rmtree(cache / "lm")
    overrides = [o for o in overrides if not o.startswith("trainer.max_steps")]
    overrides += ["trainer.max_steps=100", f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}"]
    resumed_dir = train_run(tmp_path / "resumed", *overrides, cache_dir=cache)
    tokenizer = (run_dir / "tokenizer.json").read_text()
    assert (resumed_dir / "tokenizer.json").read_text() == tokenizer
    (meta,) = [json.loads(m.read_text()) for m in (cache / "lm").glob("*/meta.json")]
    assert meta["tokenizer"] == "given"
    assert torch.load(resumed_dir / "checkpoints" / "last.ckpt")["global_step"] == 100

    sample = run_script(
        "generate.py", f"ckpt={run_dir}", "prompt=ROMEO:", "max_new_tokens=30", cache_dir=cache
    )
    assert sample.returncode == 0, sample.stderr[-2000:]
    assert sample.stdout.startswith("ROMEO:")


@pytest.mark.slow
def test_ddp_inside_a_sweep_is_refused(tmp_path):
    overrides = ["-m", "trainer=ddp_cpu", "logger=none", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    cache = tmp_path / "cache"
    result = run_script("train.py", *overrides, cache_dir=cache)
    assert result.returncode == 1
    message = "a multi-process trainer (world size 2) cannot run inside a --multirun sweep"
    assert f"error: job 0 (logger=none,trainer=ddp_cpu): {message}" in result.stderr
    assert not cache.exists()  # refused before any data was prepared
