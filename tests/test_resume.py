"""Runs that die and continue, through the real command line: SIGKILL, SIGTERM and SIGINT in the
middle of training, a non-finite loss, and the resumed run's W&B record.

Faults come from tests/faults.py, added to a run with +callbacks.fault=... overrides.
"""

import csv
import json
import math
import shutil
import signal
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from data.sampler import SEED_STREAM
from helpers import (
    SMALLEST,
    checkpoint_before_the_join,
    composed,
    fault,
    run_script,
    run_training,
    stopped_status,
    val_losses,
)
from training.module import OptimConfig
from training.resume import read_as_the_run_did, resume_conflicts, resumed_overrides
from wandb_offline import config, history, run_files, run_info

# One worker runs this file (pytest-xdist --dist loadgroup), so its module fixtures train once.
pytestmark = pytest.mark.xdist_group("resume")

# A tiny model with dropout (so resuming must restore the random streams too), validated and
# checkpointed every 10 steps, deterministic kernels.
TINY = [
    *SMALLEST,
    "model.dropout=0.1",
    "trainer.max_steps=40",
    "trainer.val_check_interval=10",
    "trainer.deterministic=true",
    "optim.warmup_steps=5",
    "callbacks.attention_maps.every_n_steps=20",
]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]


def assert_same_weights(run_dir: Path, straight: Path) -> None:
    """The last checkpoints of the two runs hold the very same weights, bit for bit (under the
    same names: the straight run's layout)."""
    final, expected = weights(run_dir), weights(straight)
    assert final.keys() == expected.keys()
    for key in expected:
        assert torch.equal(final[key], expected[key]), key


def losses(run_dir: Path) -> list[tuple]:
    """(step, train/loss, val/loss) of every row of the run's history (summary.json)."""
    rows = json.loads((run_dir / "summary.json").read_text())["history"]
    return [(row["step"], row.get("train/loss"), row.get("val/loss")) for row in rows]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("resume_cache")


@pytest.fixture(scope="module")
def straight(tmp_path_factory, cache) -> Path:
    """40 steps in one go: what every interrupted and resumed run must reproduce."""
    run_dir = tmp_path_factory.mktemp("straight")
    result = run_training(cache, *TINY, f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signum", "step", "status"),
    [
        (signal.SIGTERM, 25, stopped_status(signal.SIGTERM)),  # between checkpoints
        (signal.SIGINT, 25, stopped_status(signal.SIGINT)),
    ],
    ids=["SIGTERM", "SIGINT"],
)
def test_killed_run_resumes_to_the_same_weights_and_history(
    tmp_path, cache, straight, signum, step, status
):
    run_dir = tmp_path / "run"
    killed = run_training(
        cache, *TINY, f"hydra.run.dir={run_dir}", *fault("SignalAt", step=step, signum=signum)
    )
    assert killed.returncode == status, killed.stderr[-3000:]
    saved = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    # A stop signal ends the step under way and checkpoints it, with no gradients: applied.
    assert saved["global_step"] == step + 1 and "partial_gradients" not in saved
    name = signal.Signals(signum).name
    assert (
        f"stopped by {name} after step {step + 1}; saved {run_dir}/checkpoints/last.ckpt; "
        f"continue with: python train.py ckpt_path={run_dir}"
    ) in killed.stderr
    assert json.loads((run_dir / "summary.json").read_text())["status"] == f"stopped by {name}"

    # The run's directory alone is enough: the resumed run composes its config from the
    # overrides the checkpoint recorded (the fault fires only in a run started afresh).
    resumed = run_training(cache, f"ckpt_path={run_dir}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {run_dir}/checkpoints/last.ckpt at step {saved['global_step']}" in (
        resumed.stdout
    )

    assert_same_weights(run_dir, straight)
    # The history has every step once, with the straight run's values: no gap, no repeat.
    assert losses(run_dir) == losses(straight)
    # The first start's record is kept; the resumed one is beside it.
    assert "SignalAt" in (run_dir / ".hydra" / "overrides.yaml").read_text()
    assert (run_dir / ".hydra" / "resume-1" / "overrides.yaml").is_file()


@pytest.mark.slow
def test_a_checkpoint_from_before_q_k_v_were_joined_resumes_to_the_same_weights(
    tmp_path, cache, straight
):
    run_dir = tmp_path / "run"
    stop = fault("SignalAt", step=25, signum=signal.SIGTERM)
    killed = run_training(cache, *TINY, f"hydra.run.dir={run_dir}", *stop)
    assert killed.returncode == 128 + signal.SIGTERM, killed.stderr[-3000:]
    last = run_dir / "checkpoints" / "last.ckpt"
    older = checkpoint_before_the_join(torch.load(last, weights_only=True))
    assert "model.blocks.0.attn.k_proj.weight" in older["state_dict"]  # the premise
    last.unlink()  # a file of its own, not the checkpoint it may be a hard link to
    torch.save(older, last)

    resumed = run_training(cache, f"ckpt_path={run_dir}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_weights(run_dir, straight)  # saved in today's layout


@pytest.fixture(scope="module")
def straight_ddp(tmp_path_factory, cache) -> Path:
    """The straight run on two processes (trainer=ddp_cpu)."""
    run_dir = tmp_path_factory.mktemp("straight_ddp")
    result = run_training(cache, *TINY, "trainer=ddp_cpu", f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.mark.slow
def test_two_process_ddp_run_resumes_exactly(tmp_path, cache, straight_ddp):
    """Each rank's share of the data order, and the random streams, continue too."""
    ddp = [*TINY, "trainer=ddp_cpu"]
    run_dir = tmp_path / "run"
    killed = run_training(
        cache, *ddp, f"hydra.run.dir={run_dir}", *fault("SignalAt", step=20, signum=9)
    )
    assert killed.returncode == -signal.SIGKILL
    resumed = run_training(cache, f"ckpt_path={run_dir}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stdout.count("resuming from") == 1  # rank zero speaks for both
    assert_same_weights(run_dir, straight_ddp)
    assert losses(run_dir) == losses(straight_ddp)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stop", "step", "signum"),
    [
        # a cluster pre-empting the job signals every process
        (fault("SignalAt", step=25, signum=signal.SIGTERM), 26, signal.SIGTERM),
        # a user signals the process they started (which started the other one) only
        (fault("SignalAt", step=25, signum=signal.SIGTERM, rank=0), 26, signal.SIGTERM),
        # a terminal's Ctrl-C reaches every process
        (fault("SignalAt", step=25, signum=signal.SIGINT), 26, signal.SIGINT),
        # the validation after step 20 finishes, and the run stops at that step
        (fault("SignalDuringValidation", step=20, signum=signal.SIGTERM), 20, signal.SIGTERM),
    ],
    ids=["SIGTERM_to_every_process", "SIGTERM_to_rank_zero", "SIGINT", "SIGTERM_in_validation"],
)
def test_a_two_process_ddp_run_stopped_by_a_signal_resumes_exactly(
    tmp_path, cache, straight_ddp, stop, step, signum
):
    # The ranks stop at the same step, and save there together (a collective), however many of
    # them the signal reached: until they agreed on it, the run failed (a rank's peer gone) or
    # hung, hence the timeouts.
    run_dir = tmp_path / "run"
    ddp = [*TINY, "trainer=ddp_cpu", f"hydra.run.dir={run_dir}"]
    stopped = run_training(cache, *ddp, *stop, timeout=300)
    assert stopped.returncode == stopped_status(signum), stopped.stderr[-3000:]
    saved = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == step and "partial_gradients" not in saved
    name = signal.Signals(signum).name
    said = f"stopped by {name} after step {step}; saved {run_dir}/checkpoints/last.ckpt"
    assert stopped.stderr.count(said) == 1, stopped.stderr[-3000:]  # rank zero's
    assert json.loads((run_dir / "summary.json").read_text())["status"] == f"stopped by {name}"

    resumed = run_training(cache, f"ckpt_path={run_dir}", timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_weights(run_dir, straight_ddp)
    assert losses(run_dir) == losses(straight_ddp)


@pytest.mark.slow
def test_sigkilled_job_repeating_its_command_with_ckpt_path_last_resumes_exactly(
    tmp_path, cache, straight
):
    """ckpt_path=last with a fixed run directory: one command a pre-empted job can repeat. The
    kill comes right after the step-20 checkpoint; the run logs to W&B offline."""
    run_dir = tmp_path / "run"
    command = [*TINY, "logger=wandb", f"hydra.run.dir={run_dir}", "ckpt_path=last"]
    killed = run_training(cache, *command, *fault("SignalAt", step=20, signum=signal.SIGKILL))
    assert killed.returncode == -signal.SIGKILL
    assert "no checkpoint in" in killed.stdout and "starts from scratch" in killed.stdout
    saved = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 20  # the last checkpoint before the kill

    resumed = run_training(cache, *command)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {run_dir}/checkpoints/last.ckpt at step 20" in resumed.stdout
    assert_same_weights(run_dir, straight)
    assert losses(run_dir) == losses(straight)
    assert "SignalAt" in (run_dir / ".hydra" / "overrides.yaml").read_text()
    assert (run_dir / ".hydra" / "resume-1" / "overrides.yaml").is_file()

    # Offline, the resumed W&B run is a new run in the killed one's group.
    first, second = run_files(run_dir)
    # W&B's writer process dies with a SIGKILLed run and may lose what it had not flushed (here:
    # everything but the header), so the killed run's id is read from its file's name.
    first_id = first.stem.removeprefix("run-")
    resumed_run = run_info(second)
    assert resumed_run["id"] != first_id
    assert resumed_run["group"] == str(run_dir.resolve())  # the W&B UI shows the two together
    assert config(second)["resumed_from"]["step"] == 20
    # The history goes on at the restored step.
    steps = [row["trainer/global_step"] for row in history(second) if "train/loss" in row]
    assert steps == [29, 39]  # Lightning logs the step before it counts it: 30 and 40


def batches_trained(run_dir: Path, rank: int = 0) -> list[tuple]:
    """(step, fingerprints of its examples) of every batch of process `rank`, in order
    (callbacks=batch_log)."""
    lines = (run_dir / "batches" / f"rank{rank}.jsonl").read_text().splitlines()
    return [(row["step"], tuple(row["examples"])) for row in map(json.loads, lines)]


def loader_states(run_dir: Path) -> list[dict]:
    """What the training loader saved in the run's last checkpoint: what its order is."""
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    return checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]


@pytest.mark.slow
def test_a_run_accumulating_over_shortened_epochs_resumes_on_the_same_batches(tmp_path, cache):
    # Epochs of 7 batches in steps of 2: Lightning steps on each epoch's last batch alone, so
    # 6 steps are 11 batches, not 12; the run stops in its second epoch and resumes, drawing
    # the first epoch's order again to reach the second's (a new run's draw, recorded).
    text = tmp_path / "words.txt"
    text.write_text(" ".join(f"word{i * 7 % 31}" for i in range(120)))
    run = [*SMALLEST, "data=text_files", f"data.paths=[{text}]", "callbacks=batch_log"]
    run += ["+trainer.accumulate_grad_batches=2", "+trainer.limit_train_batches=7"]
    run += ["trainer.val_check_interval=4", "trainer.deterministic=true"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    for run_dir, steps in ((straight, 14), (stopped, 6)):
        result = run_training(cache, *run, f"trainer.max_steps={steps}", f"hydra.run.dir={run_dir}")
        assert result.returncode == 0, result.stderr[-3000:]
    assert len(batches_trained(stopped)) == 11
    assert [state["draw"] for state in loader_states(stopped)] == [SEED_STREAM]
    resumed = run_training(cache, f"ckpt_path={stopped}", "trainer.max_steps=14")
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    assert batches_trained(stopped) == batches_trained(straight)
    assert_same_weights(stopped, straight)


LOSSES = ("train/loss", "val/loss")


def logged_steps(run_dir: Path, start: int = 0) -> list[tuple[int, str]]:
    """(Lightning's logging step, key) of every train/loss and val/loss the csv logger wrote, in
    order, over the run's starts (csv/version_N), from logging step `start` on."""
    logged = []
    for log in sorted((run_dir / "csv").glob("version_*/metrics.csv")):
        with open(log) as f:
            rows = [row for row in csv.DictReader(f) if int(row["step"]) >= start]
        logged += [(int(row["step"]), key) for row in rows for key in LOSSES if row.get(key)]
    return logged


@pytest.fixture(scope="module")
def epochs_of_7(tmp_path_factory, cache) -> tuple[list[str], Path]:
    """A run of epochs of 7 batches validated every 4 (never at an epoch's end, 7 steps in), and
    that run trained straight to step 10."""
    text = tmp_path_factory.mktemp("words") / "words.txt"
    text.write_text(" ".join(f"word{i * 7 % 31}" for i in range(120)))
    run = [*SMALLEST, "data=text_files", f"data.paths=[{text}]", "callbacks=batch_log"]
    run += ["+trainer.limit_train_batches=7", "trainer.val_check_interval=4"]
    run += ["trainer.log_every_n_steps=2", "trainer.deterministic=true"]
    straight = tmp_path_factory.mktemp("straight_epochs_of_7")
    result = run_training(cache, *run, "trainer.max_steps=10", f"hydra.run.dir={straight}")
    assert result.returncode == 0, result.stderr[-3000:]
    return run, straight


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stop", "step", "position"),
    [
        # the last step ends the epoch, validated off the grid of 4
        (["trainer.max_steps=7"], 7, {"epoch": 1, "batch": 0}),
        # a stop after step 7, once the epoch has ended
        (fault("SignalAt", step=6, signum=signal.SIGTERM), 7, {"epoch": 1, "batch": 0}),
        # a stop after step 8, once it was validated
        (fault("SignalAt", step=7, signum=signal.SIGTERM), 8, {"epoch": 1, "batch": 1}),
    ],
    ids=["max_steps_at_epoch_end", "SIGTERM_at_epoch_end", "SIGTERM_at_validated_step"],
)
def test_a_run_stopped_at_an_epochs_end_or_a_validated_step_resumes_exactly(
    tmp_path, cache, epochs_of_7, stop, step, position
):
    run, straight = epochs_of_7
    stopped = tmp_path / "stopped"
    first = run_training(cache, *run, "trainer.max_steps=10", *stop, f"hydra.run.dir={stopped}")
    assert first.returncode in (0, 128 + signal.SIGTERM), first.stderr[-3000:]
    saved = torch.load(stopped / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == step and saved["LMDataModule"] == position
    resumed = run_training(cache, f"ckpt_path={stopped}", "trainer.max_steps=10")
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    assert batches_trained(stopped) == batches_trained(straight)
    assert_same_weights(stopped, straight)
    # The loggers' steps go on as the straight run's (Lightning logs the values of a step
    # at the step before it counts it: step 8's at 7).
    assert logged_steps(stopped, start=step) == logged_steps(straight, start=step)


@pytest.mark.slow
def test_a_run_without_validation_resumed_twice_trains_on_the_same_batches(
    tmp_path, cache, epochs_of_7
):
    # Without validation, last.ckpt is written as training ends, after Lightning counted the
    # epoch under way complete: at step 5, in the first epoch; at step 8, in the second.
    run, straight = epochs_of_7
    stopped = tmp_path / "stopped"
    no_validation = ["trainer.limit_val_batches=0", f"hydra.run.dir={stopped}"]
    first = run_training(cache, *run, "trainer.max_steps=5", *no_validation)
    assert first.returncode == 0, first.stderr[-3000:]
    for steps in (8, 10):
        resumed = run_training(cache, f"ckpt_path={stopped}", f"trainer.max_steps={steps}")
        assert resumed.returncode == 0, resumed.stderr[-3000:]

    assert batches_trained(stopped) == batches_trained(straight)
    assert_same_weights(stopped, straight)


@pytest.fixture(scope="module")
def accumulating(tmp_path_factory, cache) -> tuple[list[str], Path]:
    """A run of epochs of 7 batches in steps of 3 (batches 1-3, 4-6, then 7 alone), validated
    every 4 batches, so each validation but the last step's is inside a step, and its
    checkpoint with it (all kept); and that run trained straight to step 6, 14 batches."""
    text = tmp_path_factory.mktemp("words") / "words.txt"
    text.write_text(" ".join(f"word{i * 7 % 31}" for i in range(120)))
    run = [*SMALLEST, "data=text_files", f"data.paths=[{text}]", "callbacks=batch_log"]
    run += ["+trainer.accumulate_grad_batches=3", "+trainer.limit_train_batches=7"]
    run += ["trainer.val_check_interval=4", "callbacks.model_checkpoint.save_top_k=-1"]
    run += ["trainer.log_every_n_steps=2", "trainer.deterministic=true"]
    straight = tmp_path_factory.mktemp("straight_accumulating")
    result = run_training(cache, *run, "trainer.max_steps=6", f"hydra.run.dir={straight}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(batches_trained(straight)) == 14
    last = torch.load(straight / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 6 and "partial_gradients" not in last  # at a step's end
    return run, straight


@pytest.mark.slow
@pytest.mark.parametrize(
    ("batch", "step", "position"),
    [
        (5, 1, {"epoch": 0, "batch": 5}),  # the second of step 2's three batches
        (12, 4, {"epoch": 1, "batch": 5}),  # the second of step 5's, and validated
    ],
    ids=["mid_step", "mid_step_validated"],
)
def test_a_run_stopped_inside_an_accumulated_step_resumes_exactly(
    tmp_path, cache, accumulating, batch, step, position
):
    run, straight = accumulating
    stopped = tmp_path / "stopped"
    stop = fault("SignalAtBatch", batch=batch - 1, signum=signal.SIGTERM)  # stops after `batch`
    first = run_training(cache, *run, "trainer.max_steps=6", *stop, f"hydra.run.dir={stopped}")
    assert first.returncode == 128 + signal.SIGTERM, first.stderr[-3000:]
    saved = torch.load(stopped / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == step and saved["LMDataModule"] == position
    assert "partial_gradients" in saved
    resumed = run_training(cache, f"ckpt_path={stopped}", "trainer.max_steps=6")
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    assert batches_trained(stopped) == batches_trained(straight)
    assert_same_weights(stopped, straight)
    assert logged_steps(stopped, start=step) == logged_steps(straight, start=step)


@pytest.fixture(scope="module")
def accumulating_ddp(tmp_path_factory, cache, accumulating) -> Path:
    """The accumulating run on two processes (trainer=ddp_cpu), trained straight to step 6."""
    run, _ = accumulating
    straight = tmp_path_factory.mktemp("straight_accumulating_ddp")
    ddp = [*run, "trainer=ddp_cpu", "trainer.max_steps=6", f"hydra.run.dir={straight}"]
    result = run_training(cache, *ddp)
    assert result.returncode == 0, result.stderr[-3000:]
    return straight


@pytest.mark.slow
def test_a_two_process_ddp_run_stopped_inside_an_accumulated_step_resumes_exactly(
    tmp_path, cache, accumulating, accumulating_ddp
):
    # SIGTERM to both processes after batch 5, the second of step 2's three: they stop there
    # together, and the checkpoint keeps each one's gradients so far (gathered: a collective).
    # Until the ranks agreed on the stop, the run hung.
    run, _ = accumulating
    stopped = tmp_path / "stopped"
    stop = fault("SignalAtBatch", batch=4, signum=signal.SIGTERM)
    ddp = [*run, "trainer=ddp_cpu", "trainer.max_steps=6", f"hydra.run.dir={stopped}"]
    first = run_training(cache, *ddp, *stop, timeout=300)
    assert first.returncode == 128 + signal.SIGTERM, first.stderr[-3000:]
    saved = torch.load(stopped / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 1 and saved["LMDataModule"] == {"epoch": 0, "batch": 5}
    assert {len(stacked) for stacked in saved["partial_gradients"].values()} == {2}
    resumed = run_training(cache, f"ckpt_path={stopped}", "trainer.max_steps=6", timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    for rank in range(2):
        assert batches_trained(stopped, rank) == batches_trained(accumulating_ddp, rank)
    assert_same_weights(stopped, accumulating_ddp)


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2], ids=["one_process", "ddp_two_processes"])
def test_a_checkpoint_validated_inside_an_accumulated_step_resumes_exactly(
    tmp_path, cache, accumulating, request, ranks
):
    # Step 3's validation, after batch 8: the first of step 4's three batches (the second epoch's
    # first), resumed from its file in a new run directory. Until the step all-reduces them, each
    # rank's gradients are its own: the checkpoint keeps every rank's.
    run, straight = accumulating
    if ranks == 2:
        straight = request.getfixturevalue("accumulating_ddp")
    inside = tmp_path / "inside_a_step.ckpt"
    shutil.copyfile(straight / "checkpoints" / "best-step3.ckpt", inside)
    gradients = torch.load(inside, weights_only=True)["partial_gradients"]
    assert {len(stacked) for stacked in gradients.values()} == {ranks}
    run_dir = tmp_path / "resumed"
    resumed = run_training(cache, f"ckpt_path={inside}", f"hydra.run.dir={run_dir}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    for rank in range(ranks):
        assert batches_trained(run_dir, rank) == batches_trained(straight, rank)[8:]
    assert_same_weights(run_dir, straight)


@pytest.mark.slow
def test_resume_trains_longer_at_a_new_learning_rate(tmp_path, cache, straight):
    run_dir = tmp_path / "run"
    shutil.copytree(straight, run_dir)
    result = run_training(cache, f"ckpt_path={run_dir}", "trainer.max_steps=60", "optim.lr=1e-3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Warning" not in result.stderr and "is not empty" not in result.stderr  # its own
    rows = json.loads((run_dir / "summary.json").read_text())["history"]
    lr = {row["step"]: row["train/lr"] for row in rows if "train/lr" in row}
    assert sorted(lr) == [10, 20, 30, 40, 50, 60]
    # The cosine now runs to step 60 from the new peak rate (schedule: optim.lr_factor).
    factor = OptimConfig(lr=1e-3, warmup_steps=5).lr_factor
    assert lr[50] == pytest.approx(1e-3 * factor(49, 60)) and lr[60] == pytest.approx(
        1e-3 * factor(59, 60)
    )
    assert weights(run_dir).keys() == weights(straight).keys()


@pytest.mark.slow
def test_resume_refuses_changed_model(tmp_path, cache, straight):
    result = run_training(
        cache, f"ckpt_path={straight}", "model.n_layer=2", f"hydra.run.dir={tmp_path}"
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: ckpt_path={straight}/checkpoints/last.ckpt cannot resume")
    assert "model.n_layer: 1 in the checkpoint, 2 now" in lines[0]


@pytest.mark.slow
def test_nan_gradient_stops_with_message_and_keeps_last_checkpoint(tmp_path, cache):
    run_dir = tmp_path / "run"
    result = run_training(
        cache, *TINY, f"hydra.run.dir={run_dir}", *fault("NaNGradientAt", step=24)
    )
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    last = run_dir / "checkpoints" / "last.ckpt"
    assert errors == [
        f"error: step 25: the loss is {errors[0].split('the loss is ')[1].split(' ')[0]} and the "
        f"gradient norm nan; training stopped before this update, and the last good checkpoint "
        f"is {last} (resume: python train.py ckpt_path={last}). Lower optim.lr, or set "
        "on_nonfinite=skip to drop such updates"
    ]
    saved = torch.load(last, weights_only=True)
    assert saved["global_step"] == 20
    assert all(value.isfinite().all() for value in saved["state_dict"].values())
    assert sorted(p.name for p in last.parent.iterdir()) == ["best-step20.ckpt", "last.ckpt"]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "diverged"


@pytest.mark.slow
def test_nan_gradient_is_skipped_when_asked(tmp_path, cache):
    run_dir = tmp_path / "run"
    overrides = [*TINY, f"hydra.run.dir={run_dir}", "on_nonfinite=skip"]
    result = run_training(cache, *overrides, *fault("NaNGradientAt", step=24))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "warning: step 25: the loss is" in result.stderr and "update skipped" in result.stderr
    saved = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 40 and saved["skipped_steps"] == 1
    assert all(value.isfinite().all() for value in saved["state_dict"].values())


@pytest.mark.slow
def test_a_run_whose_every_step_is_skipped_ends_diverged(tmp_path, cache):
    run_dir = tmp_path / "run"
    overrides = [*TINY, f"hydra.run.dir={run_dir}", "on_nonfinite=skip", "trainer.max_steps=10"]
    result = run_training(cache, *overrides, *fault("NaNGradientAt", step=0, count=10))
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: every one of the 10 steps had a non-finite loss or gradient norm and was "
        "skipped (on_nonfinite=skip): the model learned nothing. Lower optim.lr, or look for "
        "bad values in the data"
    ]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "diverged" and summary["steps"] == 10


@pytest.mark.slow
def test_a_non_finite_validation_loss_is_never_the_best_checkpoint(tmp_path, cache):
    run_dir = tmp_path / "run"
    overrides = [*TINY, f"hydra.run.dir={run_dir}", "on_nonfinite=skip", "trainer.max_steps=10"]
    overrides += ["trainer.val_check_interval=5"]
    result = run_training(cache, *overrides, *fault("NaNWeights"))
    assert result.returncode == 1  # every step skipped: diverged
    summary = json.loads((run_dir / "summary.json").read_text())
    losses = val_losses(run_dir)
    assert len(losses) == 2 and all(math.isnan(loss) for loss in losses)
    assert summary["best_val_loss"] is None
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["last.ckpt"]


@pytest.mark.slow
def test_sigterm_repeated_while_stopping_lets_the_stop_finish(tmp_path, cache):
    run_dir = tmp_path / "run"
    faults = fault("SignalAt", step=15, signum=signal.SIGTERM)
    faults += ["+callbacks.again._target_=faults.SignalAgainWhileStopping"]
    result = run_training(cache, *TINY, f"hydra.run.dir={run_dir}", *faults)
    assert result.returncode == 128 + signal.SIGTERM, result.stderr[-3000:]
    assert "SIGTERM: a stop is already under way (saving, then stopping)" in result.stderr
    assert f"stopped by SIGTERM after step 16; saved {run_dir}/checkpoints/last.ckpt" in (
        result.stderr
    )
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 16
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "stopped by SIGTERM"


@pytest.mark.slow
def test_a_sigterm_to_every_process_of_a_run_with_loader_workers_stops_it_whole(
    tmp_path, cache, straight
):
    """SIGTERM to the run's whole process group (SLURM's scancel signals every process of the
    job), its DataLoader workers too: the run stops at the step and saves, as on its own, and
    resumes to the weights of a run never stopped (whose batches came without workers: the
    workers change where batches are made, not which, nor the dropout)."""
    run_dir, workers = tmp_path / "run", "data.num_workers=2"
    stop = fault("SignalAt", step=12, signum=signal.SIGTERM, group=True)
    stopped = run_training(cache, *TINY, workers, f"hydra.run.dir={run_dir}", *stop)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr, stopped.stderr[-3000:]
    assert f"stopped by SIGTERM after step 13; saved {run_dir}/checkpoints/last.ckpt" in (
        stopped.stderr
    )
    resumed = run_training(cache, f"ckpt_path={run_dir}", workers)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_weights(run_dir, straight)
    assert losses(run_dir) == losses(straight)


@pytest.mark.slow
def test_a_muon_run_resumes_to_the_same_weights(tmp_path, cache):
    muon = [*TINY, "optim.name=muon", "trainer.max_steps=20"]
    straight, run_dir = tmp_path / "straight", tmp_path / "run"
    result = run_training(cache, *muon, f"hydra.run.dir={straight}")
    assert result.returncode == 0, result.stderr[-3000:]
    stop = fault("SignalAt", step=12, signum=signal.SIGTERM)
    killed = run_training(cache, *muon, f"hydra.run.dir={run_dir}", *stop)
    assert killed.returncode == 128 + signal.SIGTERM, killed.stderr[-3000:]
    resumed = run_training(cache, f"ckpt_path={run_dir}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_weights(run_dir, straight)
    assert losses(run_dir) == losses(straight)
    # Muon's matrices peak at optim.muon_lr (4e-3), the rest at optim.lr (2e-3).
    saved = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    groups = saved["optimizer_states"][0]["param_groups"]
    assert [group["initial_lr"] for group in groups] == [4e-3, 2e-3]
    assert saved["lr_schedulers"][0]["base_lrs"] == [4e-3, 2e-3]


@pytest.mark.slow
def test_resume_refuses_another_optimizer(tmp_path, cache, straight):
    result = run_training(
        cache, f"ckpt_path={straight}", "optim.name=muon", f"hydra.run.dir={tmp_path}"
    )
    assert result.returncode == 1
    assert "optim.name: 'adamw' in the checkpoint, 'muon' now" in result.stderr


def test_a_resume_launched_elsewhere_reads_the_files_the_run_read(tmp_path, monkeypatch, capsys):
    launched, here = tmp_path / "launched", tmp_path / "here"
    for folder in (launched / "hub_copy", here / "moved", here / "wikitext"):
        folder.mkdir(parents=True)
    for path in (launched / "corpus.txt", here / "corpus.txt", here / "moved" / "a.txt"):
        path.write_text("text")
    (launched / "tok.json").write_text("{}")
    monkeypatch.chdir(here)
    run = {
        "paths": ["corpus.txt", "/abs/other.txt"],
        "val_paths": ["valid.txt"],
        "name": "hub_copy",  # a directory laid out as a Hub dataset, where the run was launched
        "tokenizer_file": "tok.json",
        "block_size": 64,
    }

    def as_resumed(saved: dict, given: list[str], composed: dict | None = None) -> dict:
        data = OmegaConf.create(composed or saved)
        read_as_the_run_did(data, saved, launched, given)
        return OmegaConf.to_container(data)

    # The run's paths as it read them; one this command gives (valid.txt), from here
    assert as_resumed(run, ["data.val_paths=[valid.txt]", "trainer.max_steps=9"]) == {
        "paths": [str(launched / "corpus.txt"), "/abs/other.txt"],
        "val_paths": [str(here / "valid.txt")],
        "name": str(launched / "hub_copy"),
        "tokenizer_file": str(launched / "tok.json"),
        "block_size": 64,
    }
    assert capsys.readouterr().out == ""
    # What names nothing where the run was launched any more but does here (moved with the
    # project) is read from here, and the command says which; what names nothing in either
    # place stays where the run read it, for the error to name
    moved = as_resumed(run | {"val_paths": ["moved/*.txt", "moved", "corpus.txt", "gone.txt"]}, [])
    assert moved["val_paths"] == [
        str(here / "moved" / "*.txt"),
        str(here / "moved"),
        str(launched / "corpus.txt"),
        str(launched / "gone.txt"),
    ]
    assert capsys.readouterr().out == (
        f"data.val_paths: moved/*.txt, moved named nothing in {launched}, where the run was "
        f"launched, any more: read from here, {here}\n"
    )
    # A name that was no directory where the run was launched was the Hub's: not the
    # same-named directory here
    assert as_resumed(run | {"name": "wikitext"}, [])["name"] == "wikitext"
    # A run resumed before from another directory recorded the files absolute; its overrides,
    # which the command composes, hold them as first given
    earlier = run | {"paths": [str(here / "corpus.txt")]}
    assert as_resumed(earlier, [], composed=run)["paths"] == [str(here / "corpus.txt")]
    # Launched here: the paths stay as given
    monkeypatch.chdir(launched)
    assert as_resumed(run, ["data.val_paths=[valid.txt]"]) == run


def test_checkpoints_from_before_optim_name_ran_adamw():
    saved = {"optim": {"lr": 1e-3}}  # what a run config held before optim.name existed
    assert resume_conflicts(saved, {"optim": {"lr": 1e-3, "name": "adamw"}}) == []
    assert resume_conflicts(saved, {"optim": {"lr": 1e-3, "name": "muon"}}) == [
        "optim.name: 'adamw' in the checkpoint, 'muon' now"
    ]


def test_a_key_a_run_added_that_the_configs_have_gained_since_resumes_with_its_value():
    # Written before train.yaml held sample.top_p: the run added it, and Hydra refuses to add a
    # key that is there. Keys without a dot, or with a package or a path, may be config groups.
    saved = ["+sample.top_p=0.5", "+callbacks.fault.steps=3", "+extra=x", "+group@pkg.key=x"]
    saved += ["+group/option.key=x", "++data.seed=2", "model.n_layer=1"]
    assert resumed_overrides(saved, ["model.n_layer=2"]) == [
        "++sample.top_p=0.5",
        "++callbacks.fault.steps=3",
        "+extra=x",
        "+group@pkg.key=x",
        "+group/option.key=x",
        "++data.seed=2",
        "model.n_layer=2",
    ]
    cfg = composed(*resumed_overrides(["+sample.top_p=0.5"], ["trainer.max_steps=9"]))
    assert cfg.sample.top_p == 0.5 and cfg.trainer.max_steps == 9


@pytest.mark.slow
def test_a_run_recorded_with_beam_options_resumes(tmp_path):
    """Code before 2026-11-27 took +sample.beam_size (and ignored it: the end-of-run sample does
    not beam search); a run it recorded so still resumes, where a new run is refused the key."""
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    first = [*SMALLEST, "trainer.max_steps=2", "trainer.val_check_interval=2", "logger=none"]
    assert run_training(cache, *first, f"hydra.run.dir={run_dir}").returncode == 0
    last = run_dir / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(last, weights_only=True)
    checkpoint["hyper_parameters"]["run_config"]["overrides"].append("+sample.beam_size=4")
    torch.save(checkpoint, last)
    result = run_training(cache, f"ckpt_path={run_dir}", "trainer.max_steps=4")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "++sample.beam_size=4" in result.stdout
    new_run = f"hydra.run.dir={tmp_path / 'new'}"
    refused = run_training(cache, *first, "+sample.beam_size=4", new_run)
    assert refused.returncode == 1 and "error: sample.beam_size is not an option" in refused.stderr


@pytest.mark.slow
def test_a_run_resumed_from_another_directory_trains_on_the_files_it_was_launched_with(
    tmp_path, cache
):
    """data.paths=[corpus.txt] relative to where the run was launched; the resume launched in a
    directory with a corpus.txt of its own, of the same characters (so the same tokenizer),
    continues on the run's file, as the run would have without the stop."""
    launched, elsewhere = tmp_path / "launched", tmp_path / "elsewhere"
    launched.mkdir()
    elsewhere.mkdir()
    lines = [
        f"ROMEO:\nHow {n} nights of the moon, and {n % 7} days of the sun?" for n in range(300)
    ]
    text = "\n\n".join(lines) + "\n"
    (launched / "corpus.txt").write_text(text)
    (elsewhere / "corpus.txt").write_text(text[::-1])
    files = ["data=text_files", "data.paths=[corpus.txt]", "trainer.max_steps=20"]
    straight = tmp_path / "straight"
    result = run_training(cache, *TINY, *files, f"hydra.run.dir={straight}", cwd=launched)
    assert result.returncode == 0, result.stderr[-3000:]

    def stopped_run(name: str) -> Path:
        run_dir = tmp_path / name
        signal_at = fault("SignalAt", step=12, signum=signal.SIGTERM)
        stopped = run_training(
            cache, *TINY, *files, f"hydra.run.dir={run_dir}", *signal_at, cwd=launched
        )
        assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
        return run_dir

    run_dir = stopped_run("run")
    # This command's own data.paths=[corpus.txt] is the file here: another corpus, refused
    here = ["data=text_files", "data.paths=[corpus.txt]"]
    refused = run_training(cache, f"ckpt_path={run_dir}", *here, cwd=elsewhere)
    assert refused.returncode == 1, refused.stderr[-3000:]
    conflict = (
        f"data.paths: ['{launched}/corpus.txt'] in the checkpoint, ['{elsewhere}/corpus.txt'] now"
    )
    assert conflict in refused.stderr.strip().splitlines()[-1]

    resumed = run_training(cache, f"ckpt_path={run_dir}", cwd=elsewhere)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_weights(run_dir, straight)

    # The run's own file, named from here: taken, and recorded as the run named it
    named_here = stopped_run("named_here")
    same_file = ["data=text_files", "data.paths=[../launched/corpus.txt]"]
    resumed = run_training(cache, f"ckpt_path={named_here}", *same_file, cwd=elsewhere)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_weights(named_here, straight)
    checkpoint = torch.load(named_here / "checkpoints" / "last.ckpt", weights_only=True)
    record = checkpoint["hyper_parameters"]["run_config"]
    assert record["launch_dir"] == str(launched)
    assert record["data"]["paths"] == [str(launched / "corpus.txt")]
    assert "data.paths=[corpus.txt]" in record["overrides"]
    assert "data.paths=[../launched/corpus.txt]" not in record["overrides"]
    # so evaluate.py scores the run's validation text wherever it is launched
    scores = [
        run_script("evaluate.py", f"ckpt={named_here}", cache_dir=cache, cwd=cwd)
        for cwd in (launched, elsewhere)
    ]
    assert [score.returncode for score in scores] == [0, 0], scores[1].stderr[-3000:]
    loss_lines = [[line for line in s.stdout.splitlines() if "nats/token" in line] for s in scores]
    assert loss_lines[0] == loss_lines[1] != []
