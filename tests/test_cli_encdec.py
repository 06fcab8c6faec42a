"""End to end with the encoder-decoder: train.py model=encdec, then generate.py source=..."""

import shlex
from pathlib import Path

import pytest
import torch

from helpers import run_script, train_run
from wandb_offline import history

# One worker runs this file (pytest-xdist --dist loadgroup), so its module fixtures train once.
pytestmark = pytest.mark.xdist_group("encdec_run")

TINY_ENCDEC = [
    "model=encdec",
    "model.n_encoder_layer=2",
    "model.n_decoder_layer=2",
    "model.n_embd=64",
    "model.max_source_len=32",
    "model.max_target_len=33",
    "data.batch_size=32",
    "data.val_subset=32",
    "optim.lr=3e-3",
    "optim.warmup_steps=20",
    "trainer.max_steps=150",
    "trainer.val_check_interval=50",
    "trainer.limit_val_batches=4",
    "trainer.num_sanity_val_steps=0",
    "callbacks.attention_maps.every_n_steps=150",
    "callbacks.attention_maps.sample_length=24",
]


@pytest.fixture(scope="module")
def encdec_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("run_encdec")
    return train_run(run_dir, *TINY_ENCDEC, cache_dir=tmp_path_factory.mktemp("encdec_cache"))


@pytest.fixture(scope="module")
def span_run(tmp_path_factory) -> Path:
    """A short run of span denoising, whose sources hold <mask> tokens."""
    run_dir = tmp_path_factory.mktemp("run_span")
    steps = ["trainer.max_steps=20", "trainer.val_check_interval=20", "logger=none"]
    overrides = [*TINY_ENCDEC, "data.corruption=span", *steps]
    return train_run(run_dir, *overrides, cache_dir=tmp_path_factory.mktemp("span_cache"))


@pytest.mark.slow
def test_encdec_run_checkpoint_and_decreasing_val_loss(encdec_run):
    assert (encdec_run / "checkpoints" / "last.ckpt").is_file()
    checkpoint = torch.load(encdec_run / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["hyper_parameters"]["kind"] == "encdec"
    rows = history(encdec_run)
    val_losses = [row["val/loss"] for row in rows if "val/loss" in row]
    assert len(val_losses) == 3 and val_losses[-1] < val_losses[0] - 0.1, val_losses
    for key in ("val/exact_match", "val/cer", "val/token_accuracy"):
        values = [row[key] for row in rows if key in row]
        assert len(values) == 3 and all(0.0 <= v for v in values), (key, values)


@pytest.mark.slow
def test_encdec_run_logs_encoder_decoder_and_cross_attention_images(encdec_run):
    rows = history(encdec_run)
    logged = {key for row in rows for key in row}
    for kind in ("encoder/layer1/attn", "decoder/layer1/attn", "decoder/layer1/cross_attn"):
        assert f"attention/{kind}/_type" in logged, kind
        assert f"attention/{kind}/head0/entropy" in logged, kind
    media = encdec_run.glob("wandb/offline-run-*/files/media/images/attention/*/*/*.png")
    kinds = {(p.parent.parent.name, p.name.split("_")[0]) for p in media}
    assert {("encoder", "attn"), ("decoder", "attn"), ("decoder", "cross")} <= kinds, kinds


@pytest.mark.slow
def test_encdec_summary_shows_decodes_and_command(encdec_run):
    stdout = (encdec_run / "stdout.txt").read_text()
    assert "copy-the-source baseline" in stdout
    assert stdout.count("\nsource: ") == 3 and stdout.count("\noutput: ") == 3
    assert f"python generate.py ckpt={encdec_run}" in stdout
    # The command runs as printed (its source, a speech, has the apostrophes and commas of one).
    more = next(line for line in stdout.splitlines() if line.startswith("more: python "))
    _, script, *arguments = shlex.split(more.removeprefix("more: "))
    result = run_script(script, *arguments, cache_dir=encdec_run / "cache")
    assert result.returncode == 0 and result.stdout.strip(), result.stderr[-3000:]


@pytest.mark.slow
def test_a_span_runs_printed_command_decodes_its_masked_source(span_run):
    stdout = (span_run / "stdout.txt").read_text()
    more = next(line for line in stdout.splitlines() if line.startswith("more: python "))
    _, script, *arguments = shlex.split(more.removeprefix("more: "))
    assert any(a.startswith("source=") and "<mask>" in a for a in arguments), more
    result = run_script(script, *arguments, cache_dir=span_run / "cache")
    assert result.returncode == 0 and result.stdout.strip(), result.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("decoding", ["greedy", "beam"])
def test_generate_decodes_within_the_target_limit_and_plots(encdec_run, tmp_path, decoding):
    plot = tmp_path / "cross.png"
    result = run_script(
        "generate.py",
        f"ckpt={encdec_run}",
        "source='Thou art a villain, I tell thee'",
        f"decoding={decoding}",
        "max_new_tokens=200",
        f"attention_plot={plot}",
        cache_dir=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    output = result.stdout.rstrip("\n")
    # A decode ends at EOS or at model.max_target_len=33, never at max_new_tokens=200. Where a
    # 150-step model puts its EOS is its own business (the unit tests pin EOS handling down).
    assert 0 < len(output) <= 33 and "\n" not in output, output
    assert plot.is_file() and plot.stat().st_size > 10_000


def test_generate_encdec_flags_on_gpt_checkpoint_and_vice_versa(tmp_path):
    result = run_script("generate.py", f"ckpt={tmp_path}", "decoding=nucleus", cache_dir=tmp_path)
    assert result.returncode == 1
    assert result.stderr.strip() == "error: decoding='nucleus' is not one of sample, greedy, beam"


def test_model_and_data_kinds_must_match(tmp_path):
    result = run_script(
        "train.py",
        "model=gpt",
        "data=shakespeare_denoise",
        f"hydra.run.dir={tmp_path}",
        cache_dir=tmp_path / "cache",
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: model=gpt cannot train on data=shakespeare_denoise: use data=shakespeare_char, "
        "data=shakespeare_bpe, data=text_files or data=hub"
    ]
    assert not (tmp_path / "cache").exists()
