"""End to end through the real command line: train.py writes a run, generate.py samples it."""

import fcntl
import json
import math
import os
import pty
import select
import shlex
import signal
import struct
import subprocess
import sys
import termios

import pytest
import torch
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from data.tokenizer import tokenizer_from_dict
from helpers import (
    ROOT,
    SMALLEST,
    TINY,
    clean_env,
    default_signals,
    run_script,
    train_run,
    val_losses,
)
from model.sampling import SEPARATOR
from training.summary import generate_option
from wandb_offline import config, history, run_info, summary


def test_tab_completion_lists_config_keys(tmp_path):
    line = "python train.py model.attention.n_"
    environment = {"COMP_LINE": line, "COMP_POINT": str(len(line))}
    result = run_script("train.py", "-sc", "query=bash", cache_dir=tmp_path, env=environment)
    assert result.returncode == 0, result.stderr[-3000:]
    assert {"model.attention.n_head=", "model.attention.n_kv_head="} <= set(result.stdout.split())


@pytest.mark.slow
def test_train_writes_best_and_last_checkpoints(trained_run):
    checkpoints = sorted(p.name for p in (trained_run / "checkpoints").glob("*.ckpt"))
    assert "last.ckpt" in checkpoints
    assert any(name.startswith("best-step") for name in checkpoints), checkpoints


@pytest.mark.slow
def test_checkpoint_carries_resolved_config_and_tokenizer(trained_run):
    checkpoint = torch.load(trained_run / "checkpoints" / "last.ckpt", weights_only=True)
    hparams = checkpoint["hyper_parameters"]
    assert hparams["model"]["n_embd"] == 64
    assert hparams["model"]["vocab_size"] == len(hparams["tokenizer"]["chars"])
    assert hparams["run_config"]["trainer"]["max_steps"] == 80
    assert hparams["run_config"]["paths"]["output_dir"] == str(trained_run)


@pytest.mark.slow
def test_offline_wandb_run_has_decreasing_val_loss_and_attention_images(trained_run):
    rows = history(trained_run)
    val_losses = [row["val/loss"] for row in rows if "val/loss" in row]
    assert len(val_losses) == 4, val_losses  # steps 20, 40, 60, 80
    assert val_losses[-1] < val_losses[0] - 0.2, val_losses
    train_losses = [row["train/loss"] for row in rows if "train/loss" in row]
    assert len(train_losses) >= 5
    image_rows = [row for row in rows if "attention/layer1/attn/_type" in row]
    assert image_rows and image_rows[0]["attention/layer1/attn/_type"] == "image-file"
    assert any("attention/layer0/attn/head3/score_std" in row for row in rows)
    pngs = list(trained_run.glob("wandb/offline-run-*/files/media/images/attention/layer*/*.png"))
    assert len(pngs) >= 4, pngs  # 2 layers x (step 40, step 80)
    assert config(trained_run)["model"]["attention"]["n_head"] == 4


@pytest.mark.slow
def test_offline_wandb_run_config_is_the_run_config_and_its_summary_the_best(trained_run):
    logged = config(trained_run)
    checkpoint = torch.load(trained_run / "checkpoints" / "last.ckpt", weights_only=True)
    run_config = checkpoint["hyper_parameters"]["run_config"]  # the resolved config, recorded
    assert logged.keys() - {"_wandb"} == run_config.keys()
    for key, value in run_config.items():
        assert logged[key] == value, key
    val_losses = [row["val/loss"] for row in history(trained_run) if "val/loss" in row]
    logged_summary = summary(trained_run)
    assert logged_summary["val/loss"] == {"min": pytest.approx(min(val_losses))}
    assert logged_summary["val/best_loss"] == pytest.approx(min(val_losses))
    info = run_info(trained_run)
    assert info["name"] == "gpt-2x64-shakespeare_char"
    assert info["group"] == str(trained_run.resolve())


@pytest.mark.slow
def test_summary_history_holds_what_the_loggers_got_at_each_step(trained_run):
    """summary.json's training rows hold the values W&B got at the same step, the throughput
    too (the run history read it before the module logged the step's: one log late, and the
    last one never)."""
    logged = [
        (row["train/loss"], row.get("train/tokens_per_sec"))
        for row in history(trained_run)
        if "train/loss" in row
    ]
    rows = json.loads((trained_run / "summary.json").read_text())["history"]
    kept = [
        (row["train/loss"], row.get("train/tokens_per_sec")) for row in rows if "train/loss" in row
    ]
    assert len(kept) == 8 and all(rate is not None for _, rate in logged)  # every 10 steps
    assert kept == logged


@pytest.mark.slow
def test_a_run_prints_what_a_user_needs_and_no_library_noise(trained_run):
    stdout = (trained_run / "stdout.txt").read_text()
    output = stdout + (trained_run / "stderr.txt").read_text()
    assert stdout.startswith("model: 0.")  # the size and the baseline come first
    noise = ["GPU available", "litlogger", "Seed set", "Trainable params", "anonymous"]
    noise += ["Run history", "Deprecat", "Warning:", "Traceback"]
    noise += ["it/s", "examples/s"]  # progress bars, in a log: lines instead
    for line in noise:
        assert line not in output, line


def output_on_a_terminal(arguments: list[str], env: dict, timeout: float = 600) -> str:
    """What a command writes to stdout and stderr when both are a terminal (a pseudo-terminal
    here); fails the test if the command fails."""
    primary, secondary = pty.openpty()
    # 24 rows of 100 columns: a terminal of no width gets bars of nothing
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    process = subprocess.Popen(
        arguments,
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=secondary,
        stderr=secondary,
        preexec_fn=default_signals,
    )
    os.close(secondary)  # the child holds the only other end: reading ends when it exits
    written = b""
    try:
        while select.select([primary], [], [], timeout)[0]:
            try:
                chunk = os.read(primary, 65536)
            except OSError:  # EIO: the child's end closed
                break
            if not chunk:
                break
            written += chunk
    finally:
        os.close(primary)
    assert process.wait(timeout=60) == 0, written[-3000:]
    return written.decode(errors="replace")


@pytest.mark.slow
def test_a_terminal_gets_progress_bars_and_a_log_gets_plain_lines(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"Speaker {i}:\nSome words, and more." for i in range(300)))
    overrides = [*SMALLEST, "trainer.max_steps=4", "trainer.val_check_interval=2"]
    overrides += ["data=text_files", f"data.paths=[{corpus}]", "logger=none"]
    overrides += ["callbacks.progress_bar.every_seconds=1e9"]  # a line at each validation only
    command = [sys.executable, str(ROOT / "train.py"), *overrides]
    # A cold data cache each: `datasets` reads and maps the corpus under its progress bars
    terminal = output_on_a_terminal(
        [*command, f"hydra.run.dir={tmp_path / 'terminal'}"], clean_env(tmp_path / "cache1")
    )
    assert "Generating train split" in terminal and "Epoch 0: 100%" in terminal
    assert "step 4/4" not in terminal
    log = run_script(
        "train.py", *overrides, f"hydra.run.dir={tmp_path / 'log'}", cache_dir=tmp_path / "cache2"
    )
    assert log.returncode == 0, log.stderr[-3000:]
    for bar in ("Generating train split", "Map", "Epoch", "Sanity", "it/s", "\r"):
        assert bar not in log.stdout + log.stderr, log.stdout + log.stderr
    lines = [line for line in log.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 2, log.stdout
    # train/loss shows from the first step logged on (trainer.log_every_n_steps=10)
    assert lines[0].startswith("step 2/4 (50%)  val/loss ") and lines[0].endswith("left")
    assert lines[1].startswith("step 4/4 (100%)  val/loss ") and "left" not in lines[1]


@pytest.mark.slow
def test_train_prints_sample_and_generate_command(trained_run):
    stdout = (trained_run / "stdout.txt").read_text()
    assert "best checkpoint:" in stdout
    assert f"python generate.py ckpt={trained_run}" in stdout


@pytest.mark.slow
def test_a_run_that_monitors_no_metric_keeps_and_samples_its_latest_checkpoint(
    tmp_path, shared_cache
):
    overrides = [*SMALLEST, "trainer.max_steps=4", "trainer.val_check_interval=2"]
    overrides += ["callbacks.model_checkpoint.monitor=null"]
    run_dir = train_run(tmp_path / "run", *overrides, cache_dir=shared_cache)
    checkpoints = sorted(path.name for path in (run_dir / "checkpoints").glob("*.ckpt"))
    assert checkpoints == ["best-step4.ckpt", "last.ckpt"]
    stdout = (run_dir / "stdout.txt").read_text()
    assert f"best checkpoint: {run_dir}/checkpoints/best-step4.ckpt\nsample:" in stdout
    assert "warning" not in (run_dir / "stderr.txt").read_text()


@pytest.mark.slow
def test_a_run_that_keeps_no_best_checkpoint_samples_its_last(tmp_path, shared_cache):
    overrides = [*SMALLEST, "trainer.max_steps=4", "trainer.val_check_interval=2"]
    overrides += ["callbacks.model_checkpoint.save_top_k=0"]
    run_dir = train_run(tmp_path / "run", *overrides, cache_dir=shared_cache)
    assert sorted(path.name for path in (run_dir / "checkpoints").iterdir()) == ["last.ckpt"]
    stdout = (run_dir / "stdout.txt").read_text()
    assert f"last checkpoint: {run_dir}/checkpoints/last.ckpt\nsample:" in stdout
    assert f"more: python generate.py ckpt={run_dir} " in stdout
    assert "warning" not in (run_dir / "stderr.txt").read_text()


@pytest.mark.slow
@pytest.mark.parametrize(
    "monitoring",
    [
        # the latest checkpoints, by Lightning's step counter
        ["callbacks.model_checkpoint.monitor=step", "callbacks.model_checkpoint.mode=max"],
        # a checkpoint chosen while training may judge by a training metric
        [
            "callbacks.model_checkpoint.monitor=train/loss",
            "+callbacks.model_checkpoint.every_n_train_steps=2",
            "trainer.log_every_n_steps=1",
        ],
    ],
    ids=["step", "train_loss_every_2_steps"],
)
def test_monitors_that_lightning_takes_are_taken(tmp_path, shared_cache, monitoring):
    overrides = [*SMALLEST, "trainer.max_steps=4", "trainer.val_check_interval=2", *monitoring]
    run_dir = train_run(tmp_path / "run", *overrides, cache_dir=shared_cache)
    assert list((run_dir / "checkpoints").glob("best*.ckpt"))


@pytest.mark.slow
def test_a_run_that_monitors_another_metric_still_reports_its_best_loss(tmp_path, shared_cache):
    """summary.json's best_val_loss, and what train() returns to a sweeper, is the loss whatever
    the checkpoint monitors: here perplexity, whose best is another number."""
    overrides = [*SMALLEST, "trainer.max_steps=4", "trainer.val_check_interval=2"]
    overrides += ["callbacks.model_checkpoint.monitor=val/perplexity"]
    run_dir = train_run(tmp_path / "run", *overrides, cache_dir=shared_cache)
    summary = json.loads((run_dir / "summary.json").read_text())
    losses = val_losses(run_dir)
    assert len(losses) == 2
    assert summary["best_val_loss"] == pytest.approx(min(losses))
    stdout = (run_dir / "stdout.txt").read_text()
    assert f"(val/perplexity {math.exp(min(losses)):.4f})" in stdout


@pytest.mark.parametrize(
    "value",
    [
        "ROMEO:",
        "Measureless liar, thou hast",
        "usurp'st my father's right",
        'say "so"',
        "a\\",
        "[a,b]",
        "x=${y}",
        "\n",
        " ",
        "outputs/2026-11-27/12-00-00",
        "a\\${x}",
        "123",
        "1e5",
        ".5",
        "true",
        "null",
        "nan",
        "ÉMILE:",
        "Straße",
    ],
)
def test_the_printed_generate_command_gives_generate_the_text_as_it_is(value):
    """The end-of-run printout's `more:` command: the shell and then Hydra read each option
    back as the very text (a prompt or a source from the data, a run directory)."""
    (word,) = shlex.split(generate_option("prompt", value))
    (override,) = OverridesParser.create().parse_overrides([word])
    assert override.key_or_group == "prompt"
    assert OmegaConf.create({"prompt": override.value()}).prompt == value


@pytest.mark.slow
def test_the_end_of_run_sample_takes_generate_options_as_sample_keys(tmp_path, shared_cache):
    # Greedy: the two samples are the same text; no `+`: train.yaml has each key.
    options = ["sample.decoding=greedy", "sample.num_samples=2", "sample.top_p=0.9"]
    options += ["sample.seed=3", "sample.prompt=ROMEO:", "sample.max_new_tokens=30"]
    overrides = [*SMALLEST, "trainer.max_steps=4", "trainer.val_check_interval=4", *options]
    stdout = train_run(tmp_path / "run", *overrides, cache_dir=shared_cache).joinpath("stdout.txt")
    sampled = stdout.read_text().split("sample:\n\n", 1)[1].split("\nmore:", 1)[0]
    first, second = sampled.split(f"\n{SEPARATOR}\n")
    assert first.startswith("ROMEO:") and len(first) > len("ROMEO:")
    assert first.strip() == second.strip()


@pytest.mark.slow
def test_generate_streams_text_from_run_dir_and_the_same_seed_gives_the_same_text(
    trained_run, shared_cache
):
    options = ["prompt=ROMEO:", "max_new_tokens=60", "num_samples=2", "top_p=0.95", "seed=7"]
    results = [
        run_script("generate.py", f"ckpt={trained_run}", *options, cache_dir=shared_cache)
        for _ in range(2)
    ]
    for result in results:
        assert result.returncode == 0, result.stderr
    assert results[0].stdout == results[1].stdout
    samples = results[0].stdout.split("-" * 40)
    assert len(samples) == 2
    for sample in samples:
        text = sample.strip()
        assert text.startswith("ROMEO:")
        assert len(text) >= len("ROMEO:") + 50


@pytest.mark.slow
def test_csv_logger_run_saves_attention_pngs(tmp_path, shared_cache):
    overrides = [*TINY, "trainer.max_steps=40", "logger=csv", f"hydra.run.dir={tmp_path}"]
    result = run_script("train.py", *overrides, cache_dir=shared_cache)
    assert result.returncode == 0, result.stderr[-3000:]
    pngs = sorted(p.name for p in (tmp_path / "attention_maps").glob("*.png"))
    assert pngs == ["layer0_attn_step000040.png", "layer1_attn_step000040.png"]
    metrics = (tmp_path / "csv" / "version_0" / "metrics.csv").read_text()
    assert "attention/layer1/attn/head0/entropy" in metrics and "val/loss" in metrics
    assert not (tmp_path / "wandb").exists()


def test_a_run_without_the_checkpoint_callback_writes_no_checkpoints(tmp_path, shared_cache):
    """~callbacks.model_checkpoint: no checkpoint, rather than Lightning's own in its stead,
    whose epoch=0-step=4.ckpt the printed generate.py command and a resume did not find."""
    steps = ["trainer.max_steps=4", "trainer.val_check_interval=2"]
    overrides = [*SMALLEST, *steps, "~callbacks.model_checkpoint", f"hydra.run.dir={tmp_path}"]
    result = run_script("train.py", *overrides, cache_dir=shared_cache)
    assert result.returncode == 0, result.stderr[-3000:]
    assert list(tmp_path.rglob("*.ckpt")) == []
    assert "generate.py" not in result.stdout
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 4


@pytest.mark.slow
def test_padded_vocabulary_trains_and_samples_real_tokens_only(tmp_path, shared_cache):
    overrides = [*TINY, "trainer.max_steps=20", "logger=none", "model.vocab_size=128"]
    run_dir = train_run(tmp_path / "run", *overrides, cache_dir=shared_cache)
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    tokenizer = tokenizer_from_dict(checkpoint["hyper_parameters"]["tokenizer"])
    assert tokenizer.vocab_size < 128
    assert checkpoint["state_dict"]["model.lm_head.weight"].shape[0] == 128
    assert checkpoint["hyper_parameters"]["run_config"]["model"]["vocab_size"] == 128
    result = run_script(
        "generate.py",
        f"ckpt={run_dir}",
        "max_new_tokens=200",
        "temperature=2.0",
        cache_dir=shared_cache,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(result.stdout) >= 200  # every sampled id decoded


def test_bad_override_fails_before_data_with_one_line(tmp_path):
    cache_dir = tmp_path / "cache"
    result = run_script(
        "train.py",
        "model.attention.n_head=3",
        "model.n_embd=128",
        f"hydra.run.dir={tmp_path / 'run'}",
        cache_dir=cache_dir,
    )
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "n_embd=128" in lines[0] and "n_head=3" in lines[0]
    assert not cache_dir.exists(), "no data may be prepared for an invalid config"


@pytest.mark.slow
def test_ctrl_c_ends_generate_and_the_shell_loop_running_it(trained_run, shared_cache):
    """Ctrl-C (SIGINT to the job's process group, as a terminal sends it) while generate.py
    streams, in a shell loop over two generations: no traceback, generate.py ends by SIGINT,
    and the loop ends there too. Had generate.py exited with status 130 by itself (what the
    shell's $? shows either way), bash would have taken the Ctrl-C as handled and gone on to the
    next generation."""
    generate = shlex.join([sys.executable, str(ROOT / "generate.py"), f"ckpt={trained_run}"])
    # the first streams until interrupted; the second, if the loop went on, ends at once
    loop = f"for n in 1000000 1; do echo start $n >&2; {generate} max_new_tokens=$n; done"
    loop += "; echo after >&2"
    looping = subprocess.Popen(
        ["bash", "-c", loop],
        cwd=ROOT,
        env=clean_env(shared_cache),
        preexec_fn=default_signals,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    streamed = looping.stdout.read(20)  # it is streaming text now
    os.killpg(looping.pid, signal.SIGINT)
    _, stderr = looping.communicate(timeout=120)
    assert len(streamed) == 20
    said = stderr.decode()
    assert looping.returncode == -signal.SIGINT, said[-3000:]
    assert "Traceback" not in said and said.splitlines()[-1] == "", said[-3000:]
    assert "start 1\n" not in said and "after" not in said, said[-3000:]


# A command interrupted with output its reader will never take: the other end of its stdout
# closed. One of its exit callbacks runs code from a string, as torch._dynamo's does, which
# erases Python's own record of the interrupt: only errors.end_as_interrupted's end is left.
UNREAD_OUTPUT_AT_CTRL_C = """
import atexit, sys
from errors import end_as_interrupted
atexit.register(lambda: eval("0"))
sys.stdout.write("x" * 100)
end_as_interrupted(newline=True)
"""


def test_ctrl_c_ends_by_sigint_with_output_that_can_no_longer_be_written():
    reader, writer = os.pipe()
    os.close(reader)
    # stdout buffered, as a command's is in a pipe, whatever the test's own setting
    env = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"}
    command = [sys.executable, "-c", UNREAD_OUTPUT_AT_CTRL_C]
    try:
        ended = subprocess.run(
            command, cwd=ROOT, env=env, stdout=writer, stderr=subprocess.PIPE, text=True, timeout=60
        )
    finally:
        os.close(writer)
    assert ended.returncode == -signal.SIGINT, ended.stderr[-3000:]
    assert ended.stderr == "\n"


@pytest.mark.slow
def test_cpu_fast_recipe_trains_with_muon_in_bf16(tmp_path, shared_cache):
    """experiment=cpu_fast, cut to a tiny model and 30 steps: Muon on the matrices, bf16-mixed
    (the loss falls; the weights stay fp32, as mixed precision keeps them). The recipe picks
    bf16 only on CPUs with bf16 units (test_precision.py); this test asks for it anywhere."""
    overrides = ["experiment=cpu_fast", *TINY, "trainer.max_steps=30"]
    overrides += ["trainer.precision=bf16-mixed"]
    overrides += ["trainer.val_check_interval=10", "logger=csv"]
    run_dir = train_run(tmp_path / "run", *overrides, cache_dir=shared_cache)
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    run_config = checkpoint["hyper_parameters"]["run_config"]
    assert run_config["optim"]["name"] == "muon"
    assert run_config["trainer"]["precision"] == "bf16-mixed"
    assert {t.dtype for t in checkpoint["state_dict"].values()} == {torch.float32}
    groups = checkpoint["optimizer_states"][0]["param_groups"]
    assert [group["initial_lr"] for group in groups] == [1.2e-2, 5e-3]
    summary = json.loads((run_dir / "summary.json").read_text())
    val = val_losses(run_dir)
    assert len(val) == 3 and val[-1] < val[0]
    # Launch, then fitting, then the first step: bench/vs_nanogpt.py times validations from
    # launch with these.
    assert 0 < summary["seconds_to_fit_start"] < summary["seconds_to_first_step"]
