"""init_from=: a new run that starts from a trained GPT's weights, model settings and tokenizer
(fine-tuning), through the real command line. Its refusals are in test_bad_input.py."""

import shutil

import pytest
import torch

from helpers import composed, run_training
from model.checkpoint import find_checkpoint
from training.init_from import override_value


def saved(path) -> dict:
    return torch.load(path, weights_only=True)


@pytest.mark.slow
def test_a_run_starts_from_the_weights_it_is_given_and_resumes_without_them(
    tmp_path, trained_run, shared_cache
):
    source = tmp_path / "source"
    shutil.copytree(trained_run, source)
    original = saved(find_checkpoint(source, "best", "init_from"))
    text = tmp_path / "lines.txt"  # other text, in characters the source's tokenizer knows
    text.write_text("\n\n".join(f"the king and the queen, line {i}." for i in range(400)))
    run = tmp_path / "fine_tuned"
    # An update of 1e-30 (times warm-up's 1/100) moves no weight of the source's size: the
    # weights after the first step are those the run started from.
    started = run_training(
        shared_cache,
        f"init_from={source}",
        "data=text_files",
        f"data.paths=[{text}]",
        "data.batch_size=4",
        "model.dropout=0.1",  # a setting that keeps the weights' shapes: this command's wins
        "optim.lr=1e-30",
        "trainer.max_steps=1",
        "trainer.limit_val_batches=1",
        "logger=none",
        f"hydra.run.dir={run}",
    )
    assert started.returncode == 0, started.stderr[-3000:]
    assert f"init_from: starting from the weights and tokenizer of {source}" in started.stdout
    first = saved(run / "checkpoints" / "last.ckpt")
    assert first["global_step"] == 1
    assert first["hyper_parameters"]["tokenizer"] == original["hyper_parameters"]["tokenizer"]
    expected_model = {**original["hyper_parameters"]["model"], "dropout": 0.1}
    assert first["hyper_parameters"]["model"] == expected_model
    assert first["state_dict"].keys() == original["state_dict"].keys()
    for key, value in original["state_dict"].items():
        assert torch.equal(first["state_dict"][key], value), key

    # Continued, the run composes its model from its own record, without the source.
    shutil.rmtree(source)
    resumed = run_training(shared_cache, f"ckpt_path={run}", "trainer.max_steps=2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    second = saved(run / "checkpoints" / "last.ckpt")
    assert second["global_step"] == 2
    assert second["hyper_parameters"]["model"] == expected_model
    assert second["hyper_parameters"]["tokenizer"] == original["hyper_parameters"]["tokenizer"]


@pytest.mark.slow
def test_a_run_starts_from_an_export(tmp_path, trained_run, shared_cache):
    """An export directory (weights and settings, no training state) starts a run too, in
    either format."""
    from export import ExportOptions, export

    for export_format in ("safetensors", "hf"):
        folder = tmp_path / f"export_{export_format}"
        export(ExportOptions(ckpt=str(trained_run), out=str(folder), format=export_format))
        run = tmp_path / f"from_{export_format}"
        result = run_training(
            shared_cache,
            f"init_from={folder}",
            "optim.lr=1e-30",
            "trainer.max_steps=1",
            "trainer.limit_val_batches=1",
            "logger=none",
            f"hydra.run.dir={run}",
        )
        assert result.returncode == 0, result.stderr[-3000:]
        weights = saved(run / "checkpoints" / "last.ckpt")["state_dict"]
        original = saved(find_checkpoint(trained_run, "best", "ckpt"))["state_dict"]
        for key, value in original.items():
            assert torch.equal(weights[key], value), (export_format, key)


@pytest.mark.slow
def test_a_command_with_ckpt_path_last_starts_from_the_weights_then_continues(
    tmp_path, trained_run, shared_cache
):
    """`init_from=... ckpt_path=last`, the command a pre-empted job repeats: the first start
    begins from init_from's weights, a later one continues the run it started."""
    run = tmp_path / "fine_tuned"
    command = [
        f"init_from={trained_run}",
        "ckpt_path=last",
        "trainer.limit_val_batches=1",
        "logger=none",
        f"hydra.run.dir={run}",
    ]
    for steps in (1, 2):
        result = run_training(shared_cache, *command, f"trainer.max_steps={steps}")
        assert result.returncode == 0, result.stderr[-3000:]
        assert saved(run / "checkpoints" / "last.ckpt")["global_step"] == steps
    assert "resuming from" in result.stdout


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        3,
        0.1,
        1e-05,
        float("inf"),
        "learned",
        "1/sqrt_dk",
        "it's",
        "a\\b",
        "a\\",
        "a\\'b",
        "${seed}",
        "\\${seed}",
        "",
        "1.0",
        "null",
        "a,b",
        "x=y",
    ],
)
def test_a_model_setting_comes_back_from_its_override_as_it_was(value):
    """A source's model settings become overrides of the new run: each is read back, by Hydra's
    grammar and OmegaConf, as the value it was, never as an interpolation or an escape."""
    cfg = composed(f"++model.position={override_value(value)}")
    got = cfg.model.position
    assert got == value and type(got) is type(value)


@pytest.mark.slow
def test_init_from_with_ckpt_path_is_refused_before_any_resume_is_announced(
    tmp_path, trained_run, shared_cache
):
    result = run_training(
        shared_cache,
        f"init_from={trained_run}",
        f"ckpt_path={trained_run}",
        "logger=none",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert result.returncode == 1 and result.stdout == "", result.stdout
    assert result.stderr.splitlines() == [
        f"error: init_from={trained_run} starts a new run from a model's weights and "
        f"ckpt_path={trained_run} continues a run: give one of them"
    ]
