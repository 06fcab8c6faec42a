"""Sweeps: multirun grids, the Optuna search, the ablation experiments, the W&B Sweeps file and
report.py, run through the real command line."""

import json
from pathlib import Path

import optuna
import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

import report
from helpers import ROOT, SMALLEST_BASE, run_script
from wandb_offline import history, run_info

# A sweep's job: the smallest run, whose heads and logger the tests choose, for 12 steps.
JOB = [*SMALLEST_BASE, "trainer.max_steps=12", "trainer.val_check_interval=6"]
EXPERIMENTS = ["ablation_scale", "ablation_heads", "ablation_position", "ablation_window"]
EXPERIMENTS.append("ablation_kv_heads")


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose("train", overrides=list(overrides), return_hydra_config=True)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_ablation_is_a_small_multirun_of_valid_models(experiment):
    cfg = composed(f"experiment={experiment}")
    assert cfg.hydra.mode.name == "MULTIRUN"
    assert cfg.hydra.sweep.dir.startswith(f"multirun/{experiment}/")
    ((key, values),) = cfg.hydra.sweeper.params.items()
    values = str(values).split(",")
    assert 3 <= len(values) <= 5
    assert len(values) * cfg.trainer.max_steps <= 3600  # about 10 minutes on 2 cores
    for value in values:
        job = composed(f"experiment={experiment}", f"{key}={value}")
        instantiate(job.model)  # validates: a bad combination would raise here
    assert len({composed(f"experiment={experiment}", f"{key}={v}").model for v in values}) == len(
        values
    )


def test_wandb_sweep_file_drives_train_py_with_hydra_overrides():
    sweep = yaml.safe_load((ROOT / "configs" / "wandb_sweep" / "attention.yaml").read_text())
    assert (ROOT / sweep["program"]).is_file()
    assert "${args_no_hyphens}" in sweep["command"] and "${args}" not in sweep["command"]
    assert sweep["metric"] == {"name": "val/loss", "goal": "minimize"}
    for key, spec in sweep["parameters"].items():
        for value in spec.get("values", [spec.get("min"), spec.get("max")]):
            cfg = composed(f"{key}={value}", *sweep["command"][4:])
            instantiate(cfg.model)
            assert cfg.logger.wandb.offline is False


def test_report_on_a_directory_without_jobs_is_explained(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no \*/summary.json under .*train.py -m"):
        report.report(tmp_path)
    assert report.main([str(tmp_path)]) == 1


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sweep_cache")


@pytest.mark.slow
def test_grid_runs_every_job_an_invalid_one_fails_alone_and_report_lists_them(tmp_path, cache):
    sweep = tmp_path / "grid"
    overrides = ["-m", "model.attention.n_head=2,3,4", *JOB, f"hydra.sweep.dir={sweep}"]
    result = run_script("train.py", *overrides, cache_dir=cache, env={"WANDB_MODE": "offline"})
    assert result.returncode == 1  # the sweep reports that a job failed...
    message = "model.n_embd=32 is not divisible by model.attention.n_head=3"
    assert "error: job 1 (" in result.stderr and message in result.stderr
    failed = json.loads((sweep / "1" / "summary.json").read_text())
    assert failed["status"] == "failed" and message in failed["error"]
    for job, n_head in ((0, 2), (2, 4)):  # ...after the others ran to the end
        summary = json.loads((sweep / str(job) / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["steps"] == 12
        assert f"model.attention.n_head={n_head}" in summary["overrides"]
        assert (sweep / str(job) / "checkpoints" / "last.ckpt").is_file()
        # One offline W&B run per job, grouped by the sweep and tagged with its overrides.
        info = run_info(sweep / str(job))
        assert info["group"] == str(sweep)
        assert f"model.attention.n_head={n_head}" in info["tags"]
        assert info["name"].startswith(f"{job}: ")
        assert [r["trainer/global_step"] for r in history(sweep / str(job)) if "val/loss" in r]

    # report.py in its own process, as a user runs it: W&B state stays out of this one.
    reported = run_script(
        "report.py", str(sweep), "--wandb", cache_dir=cache, env={"WANDB_MODE": "offline"}
    )
    assert reported.returncode == 0, reported.stderr[-3000:]
    text = (sweep / "report.md").read_text()
    assert text.strip() in reported.stdout
    assert f"| 1 | 3 | failed: {message}" in text
    assert "| 0 | 2 | completed |" in text and "| 2 | 4 | completed |" in text
    for plot in ("val_loss.png", "loss_curves.png"):
        assert (sweep / plot).stat().st_size > 10_000
    (summary_run,) = [p for p in sweep.glob("wandb/offline-run-*") if p.is_dir()]
    logged = {k for row in history(summary_run.parents[1]) for k in row}
    for name in ("sweep/table", "sweep/val_loss", "sweep/loss_curves"):
        assert any(key.startswith(name) for key in logged), (name, logged)
    assert list(summary_run.glob("files/media/table/sweep/table_*.table.json"))

    # A job killed before its end leaves its Hydra record and no summary: listed as such.
    (sweep / "2" / "summary.json").unlink()
    text = report.report(sweep)
    assert f"| 2 | 4 | {report.UNFINISHED} |" in text and "| 0 | 2 | completed |" in text


@pytest.mark.slow
def test_optuna_search_records_failed_and_best_trials(tmp_path, cache):
    sweep = tmp_path / "search"
    overrides = ["hparams_search=attention", "hydra.sweeper.n_trials=3", *JOB, "logger=csv"]
    # Half the space is invalid (8 key/value heads for 1 query head): those trials fail, and
    # the search goes on.
    overrides += ["model.attention.n_head=1", "model.attention.n_kv_head=choice(1,8)"]
    overrides += ["hydra.sweeper.sampler.seed=3", f"hydra.sweep.dir={sweep}"]
    result = run_script("train.py", *overrides, cache_dir=cache)
    assert result.returncode == 0, result.stderr[-3000:]
    study = optuna.load_study(study_name="attention", storage=f"sqlite:///{sweep / 'optuna.db'}")
    states = [trial.state.name for trial in study.trials]
    assert len(states) == 3 and {"COMPLETE", "FAIL"} <= set(states)
    summaries = [json.loads((sweep / str(i) / "summary.json").read_text()) for i in range(3)]
    for trial, summary in zip(study.trials, summaries, strict=True):
        assert (trial.state.name == "FAIL") == (summary["status"] == "failed")
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    completed = [s["best_val_loss"] for s in summaries if s["status"] == "completed"]
    assert best["best_value"] == pytest.approx(min(completed))
    assert study.best_value == pytest.approx(min(completed))
    assert "Best trial (Optuna)" in report.report(sweep)
