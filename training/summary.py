"""What a run tells its user: the model and the baseline to beat before training, the
end-of-run sample before training too (its prompt is checked then), and at the end the run's
summary.json (for report.py and for people) and the printout of the best checkpoint."""

import json
import math
import re
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from omegaconf import OmegaConf

from data.files import write_text_atomic
from data.lm import LMDataModule
from data.tokenizer import tokenizer_from_dict
from model.checkpoint import load_checkpoint
from model.encdec import EncoderDecoder
from model.generation import Tokenizer
from model.sampling import SamplingConfig, stream_samples
from training.attention_maps import AttentionMapLogger
from training.checkpoint_io import DurableCheckpointIO
from training.module import DataModule, greedy_decodes
from training.run_history import RunHistory

# print on the first process only: every rank of a distributed run runs train.py
print_once = rank_zero_only(print)


def describe_baseline(datamodule: DataModule) -> str:
    """What a model must beat on this data."""
    if isinstance(datamodule, LMDataModule):
        return f"unigram baseline val loss {datamodule.unigram_loss():.3f}"
    copy = datamodule.copy_baseline()
    return (
        f"copy-the-source baseline: exact match {copy['exact_match']:.3f}, "
        f"character error rate {copy['cer']:.3f}"
    )


def checked_sample(
    sample: SamplingConfig, tokenizer: Tokenizer, datamodule: LMDataModule, prompt_given: bool
) -> SamplingConfig:
    """The end-of-run sample's options, checked before training: a prompt the tokenizer cannot
    encode is an error if the user gave it, and the default is replaced by the validation
    text's first token (the default, 'ROMEO:', suits only the embedded plays)."""
    try:
        tokenizer.encode(sample.prompt)
        return sample
    except ValueError as error:
        if prompt_given:
            raise ValueError(
                f"sample.prompt={sample.prompt!r}: {error}; give a prompt in this corpus's "
                "characters"
            ) from None
    fallback = tokenizer.decode(datamodule.val_sample(1).tolist())
    print_once(
        f"sample.prompt={sample.prompt!r} is not in this corpus's vocabulary: sampling from "
        f"{fallback!r}"
    )
    return replace(sample, prompt=fallback)


def run_summary(trainer: L.Trainer | None, started: float, status: str, error: str | None) -> dict:
    """summary.json's content: `status` ("completed", "diverged", "stopped by SIGTERM",
    "failed"...), the error that ended the run, and what the run reached."""
    summary: dict = {"status": status}
    if error is not None:
        summary["error"] = error
    summary["wall_seconds"] = time.perf_counter() - started
    if trainer is None:  # the config failed before there was a trainer
        return summary
    summary["steps"] = trainer.global_step
    summary["best_val_loss"] = best_val_loss(trainer)
    history = next((c for c in trainer.callbacks if isinstance(c, RunHistory)), None)
    if history is not None:
        for key in ("train/loss", "val/loss", "val/bits_per_char", "val/cer"):
            summary[key] = history.last(key)
        summary["train/tokens_per_sec"] = history.median("train/tokens_per_sec")
        summary["seconds_to_first_step"] = history.first_step_seconds
        summary["seconds_to_fit_start"] = history.fit_start_seconds
        summary["history"] = history.rows
    maps = next((c for c in trainer.callbacks if isinstance(c, AttentionMapLogger)), None)
    if maps is not None:
        summary["attention/entropy_mean"] = maps.last_metrics.get("attention/entropy_mean")
        summary["attention_maps_seconds"] = maps.seconds  # on the training thread
        summary["attention_maps_drawing_seconds"] = maps.drawing_seconds  # in their own process
        summary["attention_maps_skipped"] = maps.skipped_figures  # the drawer was still busy
    if isinstance(trainer.strategy.checkpoint_io, DurableCheckpointIO):
        summary["checkpoint_seconds"] = trainer.strategy.checkpoint_io.seconds  # training's
        summary["checkpoint_write_seconds"] = trainer.strategy.checkpoint_io.write_seconds
    return summary


def write_summary(output_dir: str, summary: dict) -> None:
    """<run dir>/summary.json, led by the job's overrides and its number in a sweep."""
    job = HydraConfig.get()
    number = None if OmegaConf.is_missing(job.job, "num") else job.job.num  # set in sweeps only
    summary = {"overrides": list(job.overrides.task), "job": number, **summary}
    path = Path(output_dir) / "summary.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(summary, indent=2))


def print_end(
    trainer: L.Trainer, sample: SamplingConfig, datamodule: DataModule, run_dir: str
) -> None:
    """The start-up cost, where the best checkpoint is, what it produces, and the command to get
    more. A failing sample is a warning: the run is complete and saved, a sample cannot undo it."""
    history = next((c for c in trainer.callbacks if isinstance(c, RunHistory)), None)
    if history is not None and history.first_step_seconds:
        print(f"first optimizer step {history.first_step_seconds:.1f} s after start")
    try:
        print_best(trainer, sample, datamodule, run_dir)
    except Exception as error:
        print(f"warning: the end-of-run sample failed ({error})", file=sys.stderr)


def best_val_loss(trainer: L.Trainer) -> float | None:
    """The run's lowest finite validation loss (its module keeps it across resumes), None where
    no validation gave one. Not the checkpoint callback's best score: that is whatever metric
    callbacks.model_checkpoint.monitor names (perplexity, exact match...), not always the loss."""
    best = trainer.lightning_module.best_val_loss
    return best if math.isfinite(best) else None


def print_best(
    trainer: L.Trainer, sample: SamplingConfig, datamodule: DataModule, run_dir: str
) -> None:
    callback = trainer.checkpoint_callback
    if callback is None or not (callback.best_model_path or callback.last_model_path):
        return
    if callback.best_model_path:
        score = callback.best_model_score  # None where monitor=null: the latest one is kept
        judged = "" if score is None else f" ({callback.monitor} {score:.4f})"
        chosen = callback.best_model_path
        print(f"\nbest checkpoint: {chosen}{judged}")
    else:  # save_top_k=0 keeps none by score: the last, as generate.py ckpt=<run dir> takes it
        chosen = callback.last_model_path
        print(f"\nlast checkpoint: {chosen}")
    model, hparams = load_checkpoint(Path(chosen))
    tokenizer = tokenizer_from_dict(hparams["tokenizer"])
    command = f"python generate.py {generate_option('ckpt', run_dir)}"
    if isinstance(model, EncoderDecoder):
        pairs = datamodule.val_texts(3)
        outputs = greedy_decodes(model, tokenizer, [s for s, _ in datamodule.val_pairs(3)])
        for (source_text, target_text), output in zip(pairs, outputs, strict=True):
            print(f"\nsource: {source_text}\noutput: {tokenizer.decode(output)}")
            print(f"target: {target_text}")
        print(f"\nmore: {command} {generate_option('source', pairs[0][0])} decoding=beam")
        return
    print("sample:\n")
    # On one thread: the run's last attention maps are being drawn on another core meanwhile,
    # and batch-1 decoding's small products, split over two threads, would wait for that core
    # at every step (1.3-1.6 s for 200 tokens on a 2-core CPU, against 0.3-0.5 s on one).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        stream_samples(model, tokenizer, sample, torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)
    print(f"\nmore: {command} {generate_option('prompt', sample.prompt)} max_new_tokens=500")


def _reads_as_number(value: str) -> bool:
    """Whether Hydra may read `value` unquoted as a number (.5, inf, nan)."""
    try:
        float(value)
    except ValueError:
        return False
    return True


def generate_option(key: str, value: str) -> str:
    """`key=value` as one shell word that generate.py's command line reads back as the string
    `value` (a speech with commas and apostrophes, say): in double quotes for Hydra, with the
    quotes, the backslashes before them and interpolations `${` escaped, then quoted for the
    shell."""
    # Unquoted where Hydra reads a string back (a path, ROMEO:), not a number, true or null.
    literal = value.lower() in ("true", "false", "null") or _reads_as_number(value)
    if re.fullmatch(r"[A-Za-z_/.][A-Za-z0-9_./:-]*", value) and not literal:
        return f"{key}={value}"
    escaped = re.sub(r'(\\+)(?="|\$\{|$)', lambda run: run.group(1) * 2, value)
    escaped = escaped.replace('"', '\\"').replace("${", "\\${")
    return shlex.quote(f'{key}="{escaped}"')
