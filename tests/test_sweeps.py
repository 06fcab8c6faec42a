"""Sweeps: multirun grids, the Optuna search, the ablation experiments, the W&B Sweeps file and
report.py, run through the real command line."""

import json
import math
import signal
import subprocess
from pathlib import Path

import optuna
import pytest
import torch
import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.utils import instantiate

import report
from helpers import ROOT, SMALLEST_BASE, composed, read_only, run_script, run_unread, small_disk
from hydra_plugins.tinyformer_optuna import OptunaSweeper, dimension, resumed_sampler_seed
from model.checkpoint import find_checkpoint
from wandb_offline import history, run_info

# A sweep's job: the smallest run, whose heads and logger the tests choose, for 12 steps.
JOB = [*SMALLEST_BASE, "trainer.max_steps=12", "trainer.val_check_interval=6"]
EXPERIMENTS = ["ablation_scale", "ablation_heads", "ablation_position", "ablation_window"]
EXPERIMENTS.append("ablation_kv_heads")


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
    # val/best_loss: a run's best val loss as a plain number, which W&B Sweeps can optimise (it
    # cannot read val/loss's summary, a {"min": ...} dict).
    assert sweep["metric"] == {"name": "val/best_loss", "goal": "minimize"}
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
    assert "Traceback" not in result.stderr
    failed = json.loads((sweep / "1" / "summary.json").read_text())
    assert failed["status"] == "failed" and message in failed["error"]
    for job, n_head in ((0, 2), (2, 4)):  # ...after the others ran to the end
        summary = json.loads((sweep / str(job) / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["steps"] == 12
        assert f"model.attention.n_head={n_head}" in summary["overrides"]
        assert (sweep / str(job) / "checkpoints" / "last.ckpt").is_file()
        if job > 0:  # Hydra runs the jobs in one process: a later one's start-up is its own
            assert summary["seconds_to_first_step"] < summary["wall_seconds"]
        # One offline W&B run per job, grouped by the sweep and tagged with its overrides.
        info = run_info(sweep / str(job))
        assert info["group"] == str(sweep.resolve())
        assert f"model.attention.n_head={n_head}" in info["tags"]
        assert info["name"] == f"n_head={n_head}-gpt-1x32-shakespeare_char"  # swept value first
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
def test_a_sweep_run_again_into_its_directory_leaves_no_earlier_checkpoint(tmp_path, cache):
    """The same sweep directory, a shorter run: each job's directory is written anew, and its
    best checkpoint is the new job's, not the earlier one's of a later step."""
    sweep = tmp_path / "again"
    for steps in (4, 2):
        command = ["-m", "model.attention.n_head=1,2", *SMALLEST_BASE, "logger=none"]
        command += [f"trainer.max_steps={steps}", "trainer.val_check_interval=2"]
        command += [f"callbacks.attention_maps.every_n_steps={steps}", f"hydra.sweep.dir={sweep}"]
        result = run_script("train.py", *command, cache_dir=cache)
        assert result.returncode == 0, result.stderr[-3000:]
    for job in ("0", "1"):
        best = find_checkpoint(sweep / job, "best", "ckpt")
        assert torch.load(best, weights_only=True)["global_step"] == 2
        saved = sorted(p.name for p in (sweep / job / "checkpoints").iterdir())
        assert saved == ["best-step2.ckpt", "last.ckpt"]
        maps = sorted(p.name for p in (sweep / job / "attention_maps").iterdir())
        assert maps == ["layer0_attn_step000002.png"]


def test_optuna_space_draws_n_kv_head_among_the_divisors_of_n_head():
    sweeper_cfg = composed("hparams_search=attention").hydra.sweeper
    sweeper = OptunaSweeper(
        "minimize", 1, None, None, params=sweeper_cfg.params, divides=sweeper_cfg.divides
    )
    parser = OverridesParser.create()
    fixed, space = (
        [],
        [
            dimension(o)
            for o in parser.parse_overrides([f"{k}={v}" for k, v in sweeper_cfg.params.items()])
        ],
    )
    space.sort(key=lambda d: d.key in sweeper.divides)  # as OptunaSweeper.space orders them
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    pairs = set()
    for _ in range(60):
        values = sweeper.suggest(study.ask(), fixed, space)
        pairs.add((int(values["model.attention.n_head"]), int(values["model.attention.n_kv_head"])))
    valid = {(h, kv) for h in (1, 2, 4, 8) for kv in (1, 2, 4, 8) if h % kv == 0}
    assert pairs == valid


def test_optuna_interval_tagged_int_draws_integers():
    (override,) = OverridesParser.create().parse_overrides(
        ["model.n_layer=tag(int, interval(1, 8))"]
    )
    drawn = dimension(override)
    assert drawn.integer and (drawn.low, drawn.high) == (1, 8)
    trial = optuna.create_study().ask()
    values = OptunaSweeper("minimize", 1, None, None).suggest(trial, [], [drawn])
    assert values["model.n_layer"] in {str(n) for n in range(1, 9)}


# Each trial: no attention search but dropout (1.5 is invalid) and the learning rate (1e-9 does not
# learn, and a threshold pruner stops it at its first validation).
TRIAL = [*JOB, "optim.warmup_steps=0", "logger=csv", "model.attention.n_head=1"]
TRIAL += ["model.position=learned", "model.attention.scale=1/sqrt_dk", "model.attention.window=128"]
TRIAL += ["model.attention.dropout=choice(0.0,1.5)", "optim.lr=choice(0.01,1e-09)"]
TRIAL += ["hydra.sweeper.pruner._target_=optuna.pruners.ThresholdPruner"]
TRIAL += ["~hydra.sweeper.pruner.n_startup_trials", "hydra.sweeper.pruner.n_warmup_steps=0"]
TRIAL += ["+hydra.sweeper.pruner.upper=4.0"]
GOOD, HOPELESS, INVALID = ("0.0", "0.01"), ("0.0", "1e-09"), ("1.5", "0.01")


def test_a_resumed_searchs_sampler_seed_is_no_other_searchs():
    # Seeded with seed + trials, search 1234 resumed after a trial drew what search 1235 draws.
    seeds = [resumed_sampler_seed(seed, trials) for seed in range(1234, 1239) for trials in (1, 2)]
    assert len(set(seeds)) == len(seeds) and not set(seeds) & set(range(1234, 1250))
    assert all(0 <= seed < 2**32 for seed in seeds)  # what numpy's RandomState takes


@pytest.mark.slow
def test_a_resumed_optuna_search_draws_new_values(tmp_path, cache):
    # The sampler is seeded (hparams_search/attention.yaml): a search started again from that
    # seed would spend its first trials on the values of the ones already run.
    search = ["hparams_search=attention", *JOB, "logger=csv", f"hydra.sweep.dir={tmp_path}"]
    for trials in (1, 2):
        result = run_script(
            "train.py", *search, f"hydra.sweeper.n_trials={trials}", cache_dir=cache
        )
        assert result.returncode == 0, result.stderr[-3000:]
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    first, resumed = optuna.load_study(study_name="attention", storage=storage).trials
    assert resumed.params["optim.lr"] != first.params["optim.lr"]


@pytest.mark.slow
def test_optuna_search_prunes_records_failures_and_resumes(tmp_path, cache):
    sweep = tmp_path / "search"
    sweep.mkdir()
    storage = f"sqlite:///{sweep / 'optuna.db'}"
    study = optuna.create_study(study_name="attention", storage=storage)
    for dropout, lr in (GOOD, HOPELESS, INVALID):  # these values first, in this order
        study.enqueue_trial({"model.attention.dropout": dropout, "optim.lr": lr})
    search = ["hparams_search=attention", *TRIAL, f"hydra.sweep.dir={sweep}"]
    result = run_script("train.py", *search, "hydra.sweeper.n_trials=3", cache_dir=cache)
    assert result.returncode == 0, result.stderr[-3000:]
    study = optuna.load_study(study_name="attention", storage=storage)
    assert [t.state.name for t in study.trials] == ["COMPLETE", "PRUNED", "FAIL"]
    summaries = [json.loads((sweep / str(i) / "summary.json").read_text()) for i in range(3)]
    assert [s["status"] for s in summaries] == ["completed", "pruned", "failed"]
    assert summaries[1]["steps"] == 6 < summaries[0]["steps"] == 12  # stopped at its first val
    assert study.trials[1].intermediate_values == {6: pytest.approx(summaries[1]["val/loss"])}
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert best["best_trial"] == 0 and best["best_value"] == pytest.approx(
        summaries[0]["best_val_loss"]
    )
    # As the config reads them: numbers as numbers, names as text
    assert best["best_params"] == {
        "model.attention.n_kv_head": 1,  # the one divisor of n_head=1 among the config's choices
        "model.attention.dropout": 0.0,
        "optim.lr": 0.01,
    }
    assert "Best trial (Optuna): val loss " in report.report(sweep)
    # in the order they are drawn: a divisor (n_kv_head) after what it divides
    assert "with model.attention.dropout=0.0, optim.lr=0.01, model.attention.n_kv_head=1\n" in (
        report.report(sweep)
    )

    # A search killed during a trial leaves it RUNNING: resuming closes it as failed and runs its
    # values again, in a new trial and directory, and only as many trials as are missing.
    study.enqueue_trial({"model.attention.dropout": GOOD[0], "optim.lr": GOOD[1]})
    killed = study.ask()
    killed.suggest_categorical("model.attention.dropout", ["0.0", "1.5"])
    killed.suggest_categorical("optim.lr", ["0.01", "1e-09"])
    result = run_script("train.py", *search, "hydra.sweeper.n_trials=4", cache_dir=cache)
    assert result.returncode == 0, result.stderr[-3000:]
    trials = optuna.load_study(study_name="attention", storage=storage).trials
    assert [t.state.name for t in trials] == ["COMPLETE", "PRUNED", "FAIL", "FAIL", "COMPLETE"]
    assert trials[4].user_attrs["retry_of"] == 3
    assert {k: trials[4].params[k] for k in killed.params} == killed.params
    assert json.loads((sweep / "4" / "summary.json").read_text())["status"] == "completed"
    assert not (sweep / "3").exists()
    assert json.loads((sweep / "1" / "summary.json").read_text())["status"] == "pruned"


def sweep_of(folder: Path, jobs: int) -> Path:
    """A sweep over n_head = 1, 2, 4... as train.py -m leaves it: each job's Hydra record and
    the summary.json of a completed job."""
    for job in range(jobs):
        overrides = [f"model.attention.n_head={2**job}", "trainer.max_steps=12"]
        (folder / str(job) / ".hydra").mkdir(parents=True)
        (folder / str(job) / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
        history = [{"step": 6, "time": 1.0, "val/loss": 4.0 - job}, {"step": 12, "train/loss": 3.0}]
        summary = {"overrides": overrides, "job": job, "status": "completed"}
        summary |= {"steps": 12, "best_val_loss": 4.0 - job, "history": history}
        (folder / str(job) / "summary.json").write_text(json.dumps(summary))
    return folder


def report_command(sweep: Path, cache: Path) -> subprocess.CompletedProcess:
    return run_script("report.py", str(sweep), cache_dir=cache, env={"WANDB_MODE": "offline"})


@pytest.mark.parametrize("buffered", [True, False], ids=["block-buffered", "unbuffered"])
def test_a_report_whose_reader_stops_early_is_written_with_no_traceback(tmp_path, buffered):
    # `report.py sweep | head`: the report's files are written, and the command ends as a
    # pipeline's tools do when their reader goes
    sweep = sweep_of(tmp_path / "sweep", 2)
    result = run_unread("report.py", str(sweep), cache_dir=tmp_path / "cache", buffered=buffered)
    assert result.returncode == 128 + signal.SIGPIPE, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "| 1 | 2 | completed |" in (sweep / "report.md").read_text()


def test_report_lists_a_job_whose_summary_cannot_be_read_and_reports_the_others(tmp_path):
    sweep = sweep_of(tmp_path / "sweep", 4)
    (sweep / "1" / "summary.json").write_text('{"status": ')  # cut short: a full disk, a kill
    (sweep / "2" / "summary.json").write_text("[1, 2]")  # JSON, but no job's summary
    result = report_command(sweep, tmp_path / "cache")
    assert result.returncode == 0 and result.stderr == "", result.stderr[-3000:]
    text = (sweep / "report.md").read_text()
    assert text.strip() in result.stdout
    rows = [line for line in text.splitlines() if line.startswith("| ") and "job" not in line]
    assert rows == [
        "| 0 | 1 | completed | – | – | 4.000 | – | – | – | – | – |",
        "| 1 | 2 | unreadable summary.json (JSONDecodeError: Expecting value: line 1 column 12 "
        "(char 11)) | – | – | – | – | – | – | – | – |",
        "| 2 | 4 | unreadable summary.json (a JSON list without a status) | – | – | – | – | – | – "
        "| – | – |",
        "| 3 | 8 | completed | – | – | 1.000 | – | – | – | – | – |",
    ]
    for plot in ("val_loss.png", "loss_curves.png"):
        assert (sweep / plot).stat().st_size > 10_000


def test_an_optuna_best_trial_is_reported_as_a_command_line_gives_its_values(tmp_path):
    sweep = sweep_of(tmp_path / "sweep", 2)
    best = (
        "best_value: 1.5\nbest_params: {model.position: rope, optim.lr: 0.002, a: null, b: true}\n"
    )
    (sweep / "optimization_results.yaml").write_text(best)
    result = report_command(sweep, tmp_path / "cache")
    assert result.returncode == 0, result.stderr[-3000:]
    shown = "val loss 1.5000 with model.position=rope, optim.lr=0.002, a=null, b=true\n"
    assert f"Best trial (Optuna): {shown}" in result.stdout


@pytest.mark.parametrize(
    ("written", "why"),
    [
        ("best_value: low\nbest_params: {}\n", "no best_value number and best_params mapping"),
        ("best_value: 3.9\nbest_params: [1]\n", "no best_value number and best_params mapping"),
        ("best_value: [3.9\n", "ParserError: while parsing a flow sequence"),
    ],
    ids=["string_value", "list_params", "cut_off"],
)
def test_an_optuna_result_that_cannot_be_read_is_said_and_the_jobs_are_reported(
    tmp_path, written, why
):
    sweep = sweep_of(tmp_path / "sweep", 2)
    (sweep / "optimization_results.yaml").write_text(written)
    result = report_command(sweep, tmp_path / "cache")
    assert result.returncode == 0 and result.stderr == "", result.stderr[-3000:]
    assert "| 1 | 2 | completed |" in result.stdout
    assert f"Best trial (Optuna): optimization_results.yaml cannot be read ({why}" in result.stdout


# Fields of a summary.json of the wrong type for the report, and why its row says it is unreadable.
WRONG_FIELDS = {
    "string_loss": ({"best_val_loss": "4.1"}, "best_val_loss is '4.1', not a finite number"),
    "nan_best": ({"best_val_loss": math.nan}, "best_val_loss is nan, not a finite number"),
    "null_history": ({"history": None}, "history is None, not a list of rows"),
    "list_metric": ({"val/loss": [3.9, 3.8]}, "val/loss is [3.9, 3.8], not a number"),
    "bool_metric": ({"wall_seconds": True}, "wall_seconds is True, not a number"),
    "string_row": ({"history": [{"step": "6"}]}, "history row 0: step is '6', not a number"),
    "row_not_object": ({"history": [[6, 4.0]]}, "history is [[6, 4.0]], not a list of rows"),
    "job_name": ({"job": "one"}, "job is 'one', not a job number"),
    "error_object": ({"error": {"why": 1}}, "error is {'why': 1}, not a message"),
}


@pytest.mark.parametrize(("fields", "why"), WRONG_FIELDS.values(), ids=WRONG_FIELDS.keys())
def test_a_summary_with_a_field_of_the_wrong_type_is_listed_unreadable(tmp_path, fields, why):
    sweep = sweep_of(tmp_path / "sweep", 3)
    summary = json.loads((sweep / "1" / "summary.json").read_text())
    (sweep / "1" / "summary.json").write_text(json.dumps(summary | fields))
    # A diverged run's NaN losses are numbers: its summary is read.
    summary = json.loads((sweep / "2" / "summary.json").read_text())
    nan = {
        "val/loss": math.nan,
        "history": [*summary["history"], {"step": 18, "val/loss": math.nan}],
    }
    (sweep / "2" / "summary.json").write_text(json.dumps(summary | nan))
    assert report.read_summary(sweep / "1" / "summary.json") == f"unreadable summary.json ({why})"
    result = report_command(sweep, tmp_path / "cache")
    assert result.returncode == 0 and result.stderr == "", result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith(("| 0", "| 1", "| 2"))]
    assert rows == [
        "| 0 | 1 | completed | – | – | 4.000 | – | – | – | – | – |",
        f"| 1 | 2 | unreadable summary.json ({why}) | – | – | – | – | – | – | – | – |",
        "| 2 | 4 | completed | – | nan | 2.000 | – | – | – | – | – |",
    ]
    for plot in ("val_loss.png", "loss_curves.png"):
        assert (sweep / plot).stat().st_size > 10_000


def test_report_plots_the_best_losses_there_are(tmp_path):
    """A completed job that never validated (trainer.limit_val_batches=0) has no best loss: its
    row says so, and the plot of best losses shows the other jobs, or is not made at all."""
    sweep = sweep_of(tmp_path / "sweep", 3)
    for job in ("1", "2"):
        summary = json.loads((sweep / job / "summary.json").read_text())
        (sweep / job / "summary.json").write_text(json.dumps(summary | {"best_val_loss": None}))
    result = report_command(sweep, tmp_path / "cache")
    assert result.returncode == 0 and result.stderr == "", result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| 1 |")]
    assert rows == ["| 1 | 2 | completed | – | – | – | – | – | – | – | – |"]
    assert (sweep / "val_loss.png").stat().st_size > 10_000
    summary = json.loads((sweep / "0" / "summary.json").read_text())
    (sweep / "0" / "summary.json").write_text(json.dumps(summary | {"best_val_loss": None}))
    (sweep / "val_loss.png").unlink()
    result = report_command(sweep, tmp_path / "cache")
    assert result.returncode == 0 and result.stderr == "", result.stderr[-3000:]
    assert not (sweep / "val_loss.png").exists() and "val_loss" not in result.stdout
    assert (sweep / "loss_curves.png").stat().st_size > 10_000


def test_report_on_a_read_only_sweep_is_one_line(tmp_path):
    sweep = sweep_of(tmp_path / "sweep", 2)
    with read_only(sweep):
        result = report_command(sweep, tmp_path / "cache")
    assert result.returncode == 1 and result.stdout == "", result.stderr[-3000:]
    assert result.stderr.splitlines() == [
        f"error: the sweep directory {sweep} cannot be written (Read-only file system in "
        f"{sweep}): report.py writes report.md and its plots there: copy the sweep to a disk you "
        "can write to and report on the copy"
    ]


def test_report_on_a_full_disk_is_one_line_and_keeps_the_earlier_report(tmp_path):
    with small_disk(tmp_path / "disk", "256k") as disk:
        sweep = sweep_of(disk / "sweep", 3)
        assert report_command(sweep, tmp_path / "cache").returncode == 0
        earlier = {p.name: p.read_bytes() for p in sweep.iterdir() if p.is_file()}
        assert sorted(earlier) == ["loss_curves.png", "report.md", "val_loss.png"]
        (sweep / "2" / "summary.json").unlink()  # the next report differs: job 2 unfinished
        with open(disk / "filler", "wb") as filler:  # every page the disk has left
            with pytest.raises(OSError, match="No space left"):
                filler.write(b"x" * 256 * 1024)
        result = report_command(sweep, tmp_path / "cache")
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
        assert result.stderr.splitlines() == [
            f"error: no space left on the disk of {sweep} to write the report (an earlier "
            "report there is intact): free some space, and run report.py again"
        ]
        assert {p.name: p.read_bytes() for p in sweep.iterdir() if p.is_file()} == earlier
