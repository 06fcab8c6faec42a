"""What a careless user or an unkind machine does to a run directory, tried for real: a kill
after a validation that was not a best, Ctrl-C during a validation, a signal in the sanity
check, while the data is prepared or in the end-of-run sample, a corpus the default sample
prompt does not fit, a run directory copied elsewhere and resumed, and two writers in one
directory."""

import json
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from data.cache import entry_problem
from helpers import ROOT, SMALLEST, clean_env, fault, run_training, stopped_status

pytestmark = pytest.mark.slow

# The first validation's checkpoint stays the best one: the lowest step, whatever the losses (a
# loss that did not change could still move by a rounding, one way or the other by the CPU's
# kernels).
FIRST_BEST = ["callbacks.model_checkpoint.monitor=step", "callbacks.model_checkpoint.mode=min"]
# A learning rate so small that the weights barely move: every validation scores about what the
# one before it did.
FROZEN = ["optim.lr=1e-12", "optim.warmup_steps=1"]


def step_of(path: Path) -> int:
    return torch.load(path, weights_only=True)["global_step"]


def val_losses(run_dir: Path) -> dict[int, float]:
    rows = json.loads((run_dir / "summary.json").read_text())["history"]
    return {row["step"]: row["val/loss"] for row in rows if "val/loss" in row}


def test_last_checkpoint_is_written_at_every_validation_and_at_the_end(tmp_path):
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    command = [*SMALLEST, *FIRST_BEST, "trainer.val_check_interval=2", f"hydra.run.dir={run_dir}"]
    kill = fault("SignalAt", step=6, signum=signal.SIGKILL)
    killed = run_training(cache, *command, "trainer.max_steps=7", *kill)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    checkpoints = run_dir / "checkpoints"
    # Step 6's validation was no best (step 2's was), and last.ckpt holds step 6 all the same.
    assert sorted(p.name for p in checkpoints.glob("*.ckpt")) == ["best-step2.ckpt", "last.ckpt"]
    assert step_of(checkpoints / "last.ckpt") == 6

    resumed = run_training(cache, f"ckpt_path={run_dir}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # the end of training, which validates though the interval of 2 does not divide 7
    assert step_of(checkpoints / "last.ckpt") == 7
    assert list(val_losses(run_dir))[-1] == 7


def test_a_best_checkpoint_and_last_ckpt_of_one_step_are_one_file_written_once(tmp_path):
    """A validation that writes a best checkpoint makes last.ckpt a hard link to it, and the
    next last.ckpt (no new best) replaces that name only."""
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    command = [*SMALLEST, *FIRST_BEST, "trainer.val_check_interval=2", f"hydra.run.dir={run_dir}"]
    first = run_training(cache, *command, "trainer.max_steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    best, last = run_dir / "checkpoints" / "best-step2.ckpt", run_dir / "checkpoints" / "last.ckpt"
    assert best.samefile(last) and best.stat().st_nlink == 2
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 0 < summary["checkpoint_seconds"] < summary["wall_seconds"]  # the training thread's
    assert 0 < summary["checkpoint_write_seconds"] < summary["wall_seconds"]  # the writer's

    # Resumed from its checkpoints/ folder, the run continues in its own directory.
    resumed = run_training(cache, f"ckpt_path={run_dir / 'checkpoints'}", "trainer.max_steps=4")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert not best.samefile(last) and best.stat().st_nlink == 1
    assert (step_of(best), step_of(last)) == (2, 4)


def test_a_checkpoint_whose_optimizer_groups_do_not_fit_is_one_line(tmp_path):
    """Resuming a checkpoint whose optimizer state has other parameter groups than the model
    gets (one written when weight decay was chosen by parameter name) names it and the fix."""
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    first = run_training(cache, *SMALLEST, "trainer.max_steps=2", f"hydra.run.dir={run_dir}")
    assert first.returncode == 0, first.stderr[-3000:]
    last = run_dir / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(last, weights_only=True)
    decay, no_decay = checkpoint["optimizer_states"][0]["param_groups"]
    no_decay["params"].append(decay["params"].pop())  # one matrix moved to the other group
    last.unlink()  # a file of its own, not the best checkpoint it is a hard link to
    torch.save(checkpoint, last)

    resumed = run_training(cache, f"ckpt_path={run_dir}", "trainer.max_steps=4")
    assert resumed.returncode == 1
    errors = [line for line in resumed.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: ckpt_path={last}: its optimizer state does not fit this model's parameter "
        "groups (a checkpoint of a tinyformer from before weight decay was chosen by module "
        "type, or of another model): resume it with the version that wrote it, or start a new "
        "run; generate.py, evaluate.py and export.py read it as it is"
    ]


def test_ctrl_c_during_a_validation_lets_it_finish_then_stops(tmp_path):
    """Ctrl-C in the middle of a validation: the validation finishes (its loss is recorded and
    last.ckpt written after it), the run ends by SIGINT, and resumed it reaches the
    validation losses of a run never interrupted."""
    cache, whole, stopped = tmp_path / "cache", tmp_path / "whole", tmp_path / "stopped"
    command = [*SMALLEST, "trainer.max_steps=8", "trainer.val_check_interval=4"]
    command += ["trainer.limit_val_batches=4"]
    done = run_training(cache, *command, f"hydra.run.dir={whole}")
    assert done.returncode == 0, done.stderr[-3000:]
    ctrl_c = fault("SignalDuringValidation", step=4, signum=signal.SIGINT)
    interrupted = run_training(cache, *command, f"hydra.run.dir={stopped}", *ctrl_c)
    assert interrupted.returncode == stopped_status(signal.SIGINT), interrupted.stderr[-3000:]
    assert val_losses(stopped) == {4: val_losses(whole)[4]}
    assert "Ctrl-C: stopping after this validation" in interrupted.stderr
    assert "a stop is already under way" not in interrupted.stderr
    assert step_of(stopped / "checkpoints" / "last.ckpt") == 4

    resumed = run_training(cache, f"ckpt_path={stopped}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert val_losses(stopped) == val_losses(whole)


QUIT_NOW = "Ctrl-C while stopping: quitting now; the checkpoints saved before stay as they were"


def test_a_second_ctrl_c_quits_at_once_by_sigint_and_the_run_resumes(tmp_path):
    """Ctrl-C twice in a validation: the second does not wait for the validation and the
    checkpoint of the first, and ends the run by SIGINT as one Ctrl-C does (it exited with
    status 1, saying nothing): a shell loop over runs stops too. The checkpoints saved before
    are whole, and the run resumes from them to the losses of a run never interrupted."""
    cache, whole, stopped = tmp_path / "cache", tmp_path / "whole", tmp_path / "stopped"
    command = [*SMALLEST, "trainer.max_steps=6", "trainer.val_check_interval=2"]
    command += ["trainer.limit_val_batches=4"]
    done = run_training(cache, *command, f"hydra.run.dir={whole}")
    assert done.returncode == 0, done.stderr[-3000:]
    twice = fault("SignalDuringValidation", step=4, signum=signal.SIGINT, again=True)
    interrupted = run_training(cache, *command, f"hydra.run.dir={stopped}", *twice)
    assert interrupted.returncode == -signal.SIGINT, interrupted.stderr[-3000:]
    assert "Ctrl-C: stopping after this validation" in interrupted.stderr
    assert interrupted.stderr.strip().splitlines()[-1] == QUIT_NOW
    assert "Traceback" not in interrupted.stderr
    checkpoints = stopped / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["best-step2.ckpt", "last.ckpt"]
    assert step_of(checkpoints / "last.ckpt") == 2

    resumed = run_training(cache, f"ckpt_path={stopped}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert val_losses(stopped) == val_losses(whole)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_ctrl_c_while_a_stop_saves_quits_and_leaves_the_checkpoint_before(tmp_path, signum):
    """A stop on SIGTERM or Ctrl-C after step 3, and Ctrl-C while it saves that step's
    checkpoint: the process ends by SIGINT at once, without the stop's checkpoint and with no
    half-written file, last.ckpt still step 2's (it raised a KeyboardInterrupt through Lightning
    and ended with status 1 and a traceback)."""
    run_dir = tmp_path / "run"
    command = [*SMALLEST, "trainer.max_steps=6", "trainer.val_check_interval=2"]
    command += [*fault("CtrlCWhileSavingTheStop", step=3, signum=signum)]
    stopped = run_training(tmp_path / "cache", *command, f"hydra.run.dir={run_dir}")
    assert stopped.returncode == -signal.SIGINT, stopped.stderr[-3000:]
    assert stopped.stderr.strip().splitlines()[-1] == QUIT_NOW
    assert "Traceback" not in stopped.stderr
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["best-step2.ckpt", "last.ckpt"]
    assert step_of(checkpoints / "last.ckpt") == 2
    assert not (run_dir / "summary.json").exists()


def test_ctrl_c_twice_to_rank_zero_ends_every_rank(tmp_path):
    """Ctrl-C twice to the process the command started (rank zero) of a run of two processes,
    in a validation: it quits at once, and ends the rank it started (which would otherwise wait
    for it in the ranks' agreement on the stop, and fail there), quietly."""
    command = [*SMALLEST, "trainer=ddp_cpu", "trainer.max_steps=4", "trainer.val_check_interval=2"]
    command += ["trainer.limit_val_batches=4", f"hydra.run.dir={tmp_path / 'run'}"]
    twice = fault("SignalDuringValidation", step=2, signum=signal.SIGINT, again=True, rank=0)
    stopped = run_training(tmp_path / "cache", *command, *twice, timeout=300)
    assert stopped.returncode == -signal.SIGINT, stopped.stderr[-3000:]
    assert stopped.stderr.strip().splitlines()[-1] == QUIT_NOW
    assert "Traceback" not in stopped.stderr, stopped.stderr[-3000:]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_in_the_sanity_check_stops_the_run_with_its_status(tmp_path, signum):
    """Before any step there is nothing to save: the run ends at once, with the status a shell
    gives a process that signal ended. Lightning took a Ctrl-C there for its own and exited
    with status 1, saying nothing."""
    run_dir = tmp_path / "run"
    command = [*SMALLEST, "trainer.max_steps=4", "trainer.num_sanity_val_steps=2"]
    command += [*fault("SignalInSanityCheck", signum=signum), f"hydra.run.dir={run_dir}"]
    stopped = run_training(tmp_path / "cache", *command)
    assert stopped.returncode == stopped_status(signum), stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr
    if signum == signal.SIGINT:
        assert stopped.stderr.strip().splitlines()[-1] == (
            "Ctrl-C before training began: stopping, nothing saved"
        )
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())


def test_a_signal_to_rank_zero_before_training_ends_every_rank(tmp_path):
    """The process the command started (rank zero) signalled in the sanity check of a run of two
    processes ends at once, and the rank it started with it, quietly: left alone, that one
    failed with a traceback in its next collective, its peer gone."""
    command = [*SMALLEST, "trainer=ddp_cpu", "trainer.max_steps=4"]
    command += ["trainer.num_sanity_val_steps=2", f"hydra.run.dir={tmp_path / 'run'}"]
    stop = fault("SignalInSanityCheck", signum=signal.SIGTERM, rank=0)
    stopped = run_training(tmp_path / "cache", *command, *stop, timeout=300)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr, stopped.stderr[-3000:]


def cache_entries(cache: Path) -> list[str]:
    """The names under the cache's LM entries but their locks: entries, and the temporary
    directories of builds (.tmp-*)."""
    return sorted(p.name for p in (cache / "lm").iterdir() if not p.name.endswith(".lock"))


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_preparing_the_data_stops_the_run_and_leaves_no_entry(tmp_path, signum):
    """A signal while the corpus is tokenized into the cache, its token files half-written, ends
    the run at once as in the sanity check (Ctrl-C was a traceback and status 1): no summary,
    and no cache entry but the build's temporary directory, which the next run's build of the
    entry removes as it builds the entry whole."""
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    command = [*SMALLEST, "trainer.max_steps=2", f"hydra.run.dir={run_dir}"]
    stop = fault("SignalWhileWritingTokens", signum=signum)
    stopped = run_training(cache, *command, *stop)
    assert stopped.returncode == stopped_status(signum), stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr
    if signum == signal.SIGINT:
        assert stopped.stderr.strip().splitlines()[-1] == (
            "Ctrl-C before training began: stopping, nothing saved"
        )
    assert not (run_dir / "summary.json").exists()
    assert [name[:5] for name in cache_entries(cache)] == [".tmp-"]

    done = run_training(cache, *command)
    assert done.returncode == 0, done.stderr[-3000:]
    (entry,) = cache_entries(cache)
    assert entry_problem(cache / "lm" / entry) is None
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"

    # Resumed, on a machine whose cache lacks the entry: stopped as it builds it, the start
    # leaves no record in the run's directory (.hydra/resume-N), as it trained nothing.
    records = sorted(p.name for p in (run_dir / ".hydra").iterdir())
    resumed = run_training(
        tmp_path / "other_cache", f"ckpt_path={run_dir}", "trainer.max_steps=4", *stop
    )
    assert resumed.returncode == stopped_status(signum), resumed.stderr[-3000:]
    assert records == sorted(p.name for p in (run_dir / ".hydra").iterdir())


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_in_the_end_of_run_sample_cuts_it_short_and_the_run_completes(tmp_path, signum):
    """Training is complete and saved when the sample begins: a signal there ends the sample,
    and the run ends as summary.json says, completed, with status 0. It ended with the signal's
    status, 143 or 130 (Ctrl-C saying "before training began"), and summary.json "completed"."""
    run_dir = tmp_path / "run"
    command = [*SMALLEST, "trainer.max_steps=2", "sample.max_new_tokens=200"]
    command += [*fault("SignalDuringTheSample", signum=signum), f"hydra.run.dir={run_dir}"]
    result = run_training(tmp_path / "cache", *command)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    name = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
    stop = f"{name}: training is complete and saved; the end-of-run sample stops here"
    assert result.stderr.splitlines().count(stop) == 1, result.stderr[-3000:]
    assert "sample:" in result.stdout and "\nmore: python generate.py" not in result.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["steps"]) == ("completed", 2)
    assert step_of(run_dir / "checkpoints" / "last.ckpt") == 2


def test_default_prompt_outside_the_vocabulary_falls_back_and_a_given_one_fails_early(tmp_path):
    corpus = tmp_path / "lowercase.txt"
    corpus.write_text("\n\n".join(f"a line of lowercase text, number {i}" for i in range(400)))
    data = ["data=text_files", f"data.paths=[{corpus}]", "trainer.max_steps=4"]
    data += ["trainer.val_check_interval=4"]
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    result = run_training(cache, *SMALLEST, *data, f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sample.prompt='ROMEO:' is not in this corpus's vocabulary: sampling from" in (
        result.stdout
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["history"]

    given = tmp_path / "given"
    result = run_training(cache, *SMALLEST, *data, "sample.prompt=ROMEO:", f"hydra.run.dir={given}")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert (
        errors
        == result.stderr.strip().splitlines()[-1:]
        == [
            "error: sample.prompt='ROMEO:': text contains 5 character(s) not in the vocabulary: "
            "'R', 'O', 'M', 'E', ':'; the char tokenizer's vocabulary was built from the training "
            "corpus, so use only characters that occur there; give a prompt in this corpus's "
            "characters"
        ]
    )
    assert not (given / "checkpoints").exists()  # refused before training


def test_a_copied_run_directory_keeps_its_best_checkpoint_record(tmp_path):
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    first = [*SMALLEST, *FIRST_BEST, "trainer.max_steps=10", "trainer.val_check_interval=10"]
    result = run_training(cache, *first, f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())

    # Step 10 stays the best only if the copy's checkpoint brought the record of it: without it,
    # step 12's would be the first seen, and so the best. Frozen weights: step 12 scores about
    # what step 10 did, and the best loss (kept in checkpoints too) stays about step 10's.
    more = ["trainer.max_steps=12", "trainer.val_check_interval=2", *FROZEN]
    result = run_training(cache, f"ckpt_path={copy}", *more)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = val_losses(copy)
    summary = json.loads((copy / "summary.json").read_text())
    assert summary["best_val_loss"] == pytest.approx(losses[10], rel=1e-6)
    assert sorted(p.name for p in (copy / "checkpoints").glob("*.ckpt")) == [
        "best-step10.ckpt",
        "last.ckpt",
    ]
    assert f"best checkpoint: {copy}/checkpoints/best-step10.ckpt" in result.stdout
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before  # untouched


WRITER = """
import sys
from pathlib import Path
import torch
sys.path.insert(0, {root!r})
from model.checkpoint import load_safely
from training.checkpoint_io import save_durably

path, name = Path(sys.argv[1]), sys.argv[2]
for i in range(40):
    save_durably({{"writer": name, "i": i, "data": torch.full((1 << 16,), float(i))}}, path)
    saved = load_safely(path)  # whole, whoever wrote it last
    assert saved["data"].eq(float(saved["i"])).all(), "a mixed file"
"""


def test_two_processes_saving_one_checkpoint_never_publish_a_broken_file(tmp_path):
    path = tmp_path / "last.ckpt"
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER.format(root=str(ROOT)), str(path), name],
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in ("a", "b")
    ]
    for writer in writers:
        _, stderr = writer.communicate(timeout=300)
        assert writer.returncode == 0, stderr[-3000:]
    assert torch.load(path, weights_only=True)["i"] == 39
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no leftovers


def test_one_writer_per_run_directory(tmp_path):
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    command = [*SMALLEST, "trainer.max_steps=100000", "trainer.val_check_interval=5"]
    running = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *command, f"hydra.run.dir={run_dir}"],
        cwd=ROOT,
        env=clean_env(cache),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "checkpoints" / "last.ckpt").is_file():
            assert running.poll() is None, running.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the first run never wrote a checkpoint"
            time.sleep(0.2)
        in_use = f"error: {run_dir} is in use by process {running.pid}: wait for that run to end"
        for second in (
            [*command, f"hydra.run.dir={run_dir}"],  # a second run there
            [f"ckpt_path={run_dir}"],  # a resume while the run goes on
        ):
            result = run_training(cache, *second)
            assert result.returncode == 1
            lines = result.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith(in_use), result.stderr[-3000:]
        assert running.poll() is None  # untouched by the refused ones
    finally:
        running.send_signal(signal.SIGTERM)
        running.communicate(timeout=300)
    saved = step_of(run_dir / "checkpoints" / "last.ckpt")
    assert saved >= 5

    # A new run into the stopped run's directory would overwrite its checkpoints: refused.
    result = run_training(cache, *command, "trainer.max_steps=10", f"hydra.run.dir={run_dir}")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"error: hydra.run.dir={run_dir} already holds a run ({run_dir}/checkpoints/last.ckpt): "
        f"continue it with ckpt_path={run_dir}, or choose another hydra.run.dir"
    ]
    assert step_of(run_dir / "checkpoints" / "last.ckpt") == saved
    # The refused commands left no record of a start in the run's directory.
    assert FIRST_START == sorted(p.name for p in (run_dir / ".hydra").iterdir())


# The record of a run's first start; each start after it that trains adds a .hydra/resume-N.
FIRST_START = ["config.yaml", "hydra.yaml", "overrides.yaml"]


def digests(run_dir: Path) -> dict[str, bytes]:
    """Every file of the run directory but Hydra's log and the writer's lock (each command
    appends to the one and takes the other), by path."""
    files = (p for p in run_dir.rglob("*") if p.is_file() and p.name not in ("train.log", ".lock"))
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in files}


def test_commands_that_train_nothing_leave_the_run_as_it_was(tmp_path):
    run_dir, other, cache = tmp_path / "run", tmp_path / "other", tmp_path / "cache"
    command = [*SMALLEST, "trainer.max_steps=4", "trainer.val_check_interval=2"]
    for directory, width in ((run_dir, 32), (other, 48)):
        result = run_training(
            cache, *command, f"model.n_embd={width}", f"hydra.run.dir={directory}"
        )
        assert result.returncode == 0, result.stderr[-3000:]
    before = digests(run_dir)
    last = run_dir / "checkpoints" / "last.ckpt"

    done = run_training(cache, f"ckpt_path={run_dir}")  # a finished job's command, repeated
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == (
        f"ckpt_path={last} is at trainer.max_steps=4 already: nothing to train (give a larger "
        "trainer.max_steps to train on)"
    )
    for refused, message in (
        (
            [f"ckpt_path={run_dir}", "trainer.max_steps=3"],
            f"error: ckpt_path={last} is at step 4, past trainer.max_steps=3: give a larger "
            "trainer.max_steps to train on",
        ),
        (
            [f"ckpt_path={other}/checkpoints/last.ckpt", f"hydra.run.dir={run_dir}"],
            f"error: hydra.run.dir={run_dir} holds another run ({last}) than "
            f"ckpt_path={other}/checkpoints/last.ckpt: drop hydra.run.dir",
        ),
        (
            [f"ckpt_path={run_dir}", "trainer.max_steps=6", "model.n_embd=48"],
            f"error: ckpt_path={last} cannot resume with changed settings (model.n_embd",
        ),
    ):
        result = run_training(cache, *refused)
        assert result.returncode == 1, result.stderr[-3000:]
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(message), result.stderr[-3000:]
    assert digests(run_dir) == before
    assert FIRST_START == sorted(p.name for p in (run_dir / ".hydra").iterdir())

    resumed = run_training(cache, f"ckpt_path={run_dir}", "trainer.max_steps=6")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert step_of(last) == 6 and (run_dir / ".hydra" / "resume-1" / "config.yaml").is_file()


def test_a_batch_too_large_for_memory_is_one_line(tmp_path, shared_cache):
    """A real allocation failure: the process may map at most 6 GB, and a step at batch 8192
    of the default model needs far more."""

    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))

    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "data.batch_size=8192", "logger=none"]
        + ["trainer.num_sanity_val_steps=0", f"hydra.run.dir={run_dir}"],
        cwd=ROOT,
        env=clean_env(shared_cache),
        preexec_fn=limit_memory,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == result.stderr.strip().splitlines()[-1:]
    assert errors[0].startswith("error: out of memory at data.batch_size=8192 with 0.82M ")
    assert errors[0].endswith(f"(resume: python train.py ckpt_path={run_dir})")
