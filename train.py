"""Train a model from the shell: `python train.py [group=choice] [key=value ...]`.

Hydra composes configs/train.yaml and makes the run directory; this file instantiates the
data, the LightningModule, the loggers and the Trainer, fits, writes the run's summary.json,
and returns the best validation loss so that Hydra sweepers can minimise it.
"""

import dataclasses
import json
import shlex
import sys
import time
from pathlib import Path

import hydra
import lightning as L
import torch
import wandb
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from data.lm import LMDataModule
from data.seq2seq import Seq2SeqDataModule
from data.tokenizer import tokenizer_from_dict
from generate import (
    USER_ERRORS,
    SamplingConfig,
    exit_on_user_error,
    load_checkpoint,
    stream_samples,
)
from model.attention_maps import AttentionMapLogger
from model.encdec import EncoderDecoder
from model.module import (
    LanguageModelModule,
    OptimConfig,
    Seq2SeqModule,
    greedy_decodes,
    module_for,
)
from model.run_history import RunHistory


def sqlite_url(path: str) -> str:
    """A SQLAlchemy URL for the sqlite file at `path`, its folder made first: an Optuna study is
    created before Hydra makes the sweep directory it lives in."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{Path(path).resolve()}"


OmegaConf.register_new_resolver("sqlite_url", sqlite_url)


def instantiate_checked(node: DictConfig, **kwargs):
    """hydra.utils.instantiate, with our own config errors surfacing as themselves."""
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as error:
        cause = error.__cause__
        if isinstance(cause, USER_ERRORS):
            raise cause from None
        raise


# The data each kind of model trains on, and the choices that provide it.
DATA_FOR = {
    LanguageModelModule: (
        LMDataModule,
        "data=shakespeare_char, data=shakespeare_bpe, data=text_files or data=hub",
    ),
    Seq2SeqModule: (
        Seq2SeqDataModule,
        "data=shakespeare_denoise, data=shakespeare_next_line or data=pairs",
    ),
}


def check_model_fits_data(module_class: type, datamodule: L.LightningDataModule) -> None:
    expected, choices = DATA_FOR[module_class]
    if not isinstance(datamodule, expected):
        picked = HydraConfig.get().runtime.choices
        raise ValueError(
            f"model={picked.get('model')} cannot train on data={picked.get('data')}: use {choices}"
        )


def print_summary(trainer: L.Trainer, cfg: DictConfig, datamodule) -> None:
    """Where the best checkpoint is, what it produces, and the command to get more."""
    callback = trainer.checkpoint_callback
    best = callback.best_model_path if callback else ""
    if not best:
        return
    print(f"\nbest checkpoint: {best} (val/loss {callback.best_model_score:.4f})")
    model, tokenizer, _ = load_checkpoint(Path(best))
    command = f"python generate.py ckpt={cfg.paths.output_dir}"
    if isinstance(model, EncoderDecoder):
        pairs = datamodule.val_texts(3)
        outputs = greedy_decodes(model, tokenizer, [s for s, _ in datamodule.val_pairs(3)])
        for (source_text, target_text), output in zip(pairs, outputs, strict=True):
            print(f"\nsource: {source_text}\noutput: {tokenizer.decode(output)}")
            print(f"target: {target_text}")
        print(f"\nmore: {command} {shlex.quote(f'source={pairs[0][0]}')} decoding=beam")
        return
    sample = SamplingConfig(**OmegaConf.to_container(cfg.sample, resolve=True))
    print("sample:\n")
    stream_samples(model, tokenizer, sample, torch.device("cpu"))
    print(f"\nmore: {command} {shlex.quote(f'prompt={sample.prompt}')} max_new_tokens=500")


def describe_baseline(datamodule) -> str:
    """What a model must beat on this data."""
    if isinstance(datamodule, LMDataModule):
        return f"unigram baseline val loss {datamodule.unigram_loss():.3f}"
    copy = datamodule.copy_baseline()
    return (
        f"copy-the-source baseline: exact match {copy['exact_match']:.3f}, "
        f"character error rate {copy['cer']:.3f}"
    )


def checkpoint_tokenizer(ckpt_path: str) -> dict:
    """The tokenizer a checkpoint was trained with, so a resumed run keeps its token ids."""
    if not Path(ckpt_path).is_file():
        raise FileNotFoundError(f"ckpt_path: no checkpoint at {ckpt_path}; check the path")
    checkpoint = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    return checkpoint["hyper_parameters"]["tokenizer"]


def check_not_ddp_in_multirun(trainer: L.Trainer) -> None:
    # Lightning starts the other ranks by re-running the command line, which in a sweep would
    # re-run the whole sweep in every rank.
    if trainer.world_size > 1 and in_sweep():
        raise ValueError(
            f"a multi-process trainer (world size {trainer.world_size}) cannot run inside a "
            "--multirun sweep; sweep with one process per job (trainer=default), or launch "
            "each distributed run on its own"
        )


def in_sweep() -> bool:
    return HydraConfig.get().mode == RunMode.MULTIRUN


def sweep_run_names(node: DictConfig) -> dict:
    """For a W&B logger in a sweep job, what the config leaves unset: the sweep directory as the
    group, the job's overrides as tags (W&B allows 64 characters) and as its name."""
    if not (in_sweep() and node.get("_target_", "").endswith("WandbLogger")):
        return {}
    job = HydraConfig.get()
    names = {"group": job.sweep.dir, "tags": [o[:64] for o in job.overrides.task]}
    names["name"] = f"{job.job.num}: {job.job.override_dirname}"[:128]
    return {key: value for key, value in names.items() if not node.get(key)}


def write_summary(output_dir: str, summary: dict) -> None:
    """<run dir>/summary.json: how the run went, for report.py and for people."""
    job = HydraConfig.get()
    number = None if OmegaConf.is_missing(job.job, "num") else job.job.num  # set in sweeps only
    summary = {"overrides": list(job.overrides.task), "job": number, **summary}
    path = Path(output_dir) / "summary.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2))


def run_summary(trainer: L.Trainer, callbacks: list, started: float) -> dict:
    history = next((c for c in callbacks if isinstance(c, RunHistory)), None)
    maps = next((c for c in callbacks if isinstance(c, AttentionMapLogger)), None)
    summary: dict = {"status": "completed", "wall_seconds": time.perf_counter() - started}
    summary["steps"] = trainer.global_step
    best = trainer.checkpoint_callback.best_model_score if trainer.checkpoint_callback else None
    summary["best_val_loss"] = None if best is None else float(best)
    if history is not None:
        for key in ("train/loss", "val/loss", "val/bits_per_char", "val/cer"):
            summary[key] = history.last(key)
        summary["train/tokens_per_sec"] = history.median("train/tokens_per_sec")
        summary["seconds_to_first_step"] = history.first_step_seconds
        summary["history"] = history.rows
    if maps is not None:
        summary["attention/entropy_mean"] = maps.last_metrics.get("attention/entropy_mean")
        summary["attention_maps_seconds"] = maps.seconds
    return summary


def train(cfg: DictConfig) -> float | None:
    started = time.perf_counter()
    # Everything a user can get wrong in the config is checked before any data is loaded.
    optim = OptimConfig(**cfg.optim)
    SamplingConfig(**OmegaConf.to_container(cfg.sample, resolve=True))
    model_config = instantiate_checked(cfg.model)
    datamodule = instantiate_checked(cfg.data)
    module_class = module_for(model_config)
    check_model_fits_data(module_class, datamodule)
    if not isinstance(cfg.compile, bool):
        raise ValueError(f"compile must be true or false, got {cfg.compile!r}")
    resumed_tokenizer = checkpoint_tokenizer(cfg.ckpt_path) if cfg.get("ckpt_path") else None
    callbacks = [instantiate_checked(c) for c in (cfg.get("callbacks") or {}).values()]
    loggers = [
        instantiate_checked(c, **sweep_run_names(c)) for c in (cfg.get("logger") or {}).values()
    ]
    trainer = instantiate_checked(cfg.trainer, callbacks=callbacks, logger=loggers or False)
    check_not_ddp_in_multirun(trainer)
    L.seed_everything(cfg.seed, workers=True)

    # Every rank prepares the data itself (one builds the cache entry, the others wait for it
    # and reuse it), so the vocabulary size is the same everywhere without passing it around.
    if resumed_tokenizer is not None and isinstance(datamodule, LMDataModule):
        datamodule.use_tokenizer(tokenizer_from_dict(resumed_tokenizer))
    datamodule.prepare_data()
    datamodule.setup("fit")
    tokenizer = datamodule.tokenizer
    if resumed_tokenizer is not None and tokenizer.to_dict() != resumed_tokenizer:
        raise ValueError(
            f"ckpt_path={cfg.ckpt_path} was trained with another tokenizer than this data "
            "gives; resume with the data options of that run"
        )
    model_config = dataclasses.replace(model_config, vocab_size=datamodule.vocab_size)
    run_config = OmegaConf.to_container(cfg, resolve=True)
    run_config["model"]["vocab_size"] = datamodule.vocab_size
    module = module_class(
        model=model_config.to_dict(),
        optim=dataclasses.asdict(optim),
        tokenizer=tokenizer.to_dict(),
        run_config=run_config,
    )
    if cfg.compile:
        module.model.compile()  # in place: the state dict keeps its keys, checkpoints load as ever
    if trainer.is_global_zero:
        tokenizer.save(Path(cfg.paths.output_dir) / "tokenizer.json")
        print(
            f"model: {module.model.num_parameters() / 1e6:.2f}M parameters; "
            f"{describe_baseline(datamodule)}"
        )
    for logger in loggers:
        logger.log_hyperparams(run_config)
    trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))

    if trainer.is_global_zero:
        summary = run_summary(trainer, callbacks, started)
        write_summary(cfg.paths.output_dir, summary)
        if summary.get("seconds_to_first_step"):
            print(f"first optimizer step {summary['seconds_to_first_step']:.1f} s after start")
        print_summary(trainer, cfg, datamodule)
    score = trainer.checkpoint_callback.best_model_score if trainer.checkpoint_callback else None
    if score is None:
        score = trainer.callback_metrics.get("val/loss")
    return None if score is None else float(score)


class JobFailed(Exception):
    """A sweep job that the user's config broke."""


def train_sweep_job(cfg: DictConfig) -> float | None:
    """One job of a sweep. A job the user's config breaks (say n_head=3 with n_embd=128) fails
    with a one-line message and a failed summary.json, and its error goes back to the sweeper,
    which records it (Optuna marks the trial failed) while the other jobs run on."""
    try:
        return train(cfg)
    except USER_ERRORS as error:
        job = HydraConfig.get().job
        message = f"job {job.num} ({job.override_dirname}): {error}"
        print(f"error: {message}", file=sys.stderr)
        write_summary(cfg.paths.output_dir, {"status": "failed", "error": str(error)})
        raise JobFailed(message) from None


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> float | None:
    try:
        if in_sweep():
            return train_sweep_job(cfg)
        return exit_on_user_error(lambda: train(cfg))
    finally:
        # Every job ends its W&B run, failed or not: a sweep's next job must not log into it.
        wandb.finish()


if __name__ == "__main__":
    main()
