"""Train a model from the shell: `python train.py [group=choice] [key=value ...]`.

Hydra composes configs/train.yaml and makes the run directory; this file instantiates the
data, the LightningModule, the loggers and the Trainer, fits, writes the run's summary.json,
and returns the best validation loss so that Hydra sweepers can minimise it. Given ckpt_path,
it continues a run where its checkpoint left it (prepare_resume).
"""

import dataclasses
import json
import shlex
import signal
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import NoReturn

import hydra
import lightning as L
import torch
from hydra import compose
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException, InstantiationException
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from data.lm import LMDataModule
from data.seq2seq import Seq2SeqDataModule
from data.tokenizer import tokenizer_from_dict
from generate import (
    USER_ERRORS,
    SamplingConfig,
    exit_on_user_error,
    load_run,
    stream_samples,
)
from model.checkpoint import load_safely
from model.encdec import EncDecConfig, EncoderDecoder
from model.gpt import GPTConfig
from training.attention_maps import AttentionMapLogger
from training.checkpoint_io import DurableCheckpointIO, claim_run_dir
from training.module import (
    LanguageModelModule,
    OptimConfig,
    Seq2SeqModule,
    TrainingDiverged,
    check_nonfinite_action,
    greedy_decodes,
    module_for,
)
from training.resume import ResumeState, StopSignals
from training.run_history import RunHistory

# Errors that end a run with a one-line message: the user's (config, files) and a diverged run.
TRAIN_ERRORS = (*USER_ERRORS, MisconfigurationException, TrainingDiverged)


def sqlite_url(path: str) -> str:
    """A SQLAlchemy URL for the sqlite file at `path`, its folder made first: an Optuna study is
    created before Hydra makes the sweep directory it lives in."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{Path(path).resolve()}"


def resume_run_dir(ckpt_path: str | None, new_run_dir: str) -> str:
    """hydra.run.dir: a run resumed from a run directory, or from a file in its checkpoints/,
    continues in that directory; any other run gets a new one."""
    if ckpt_path is None or ckpt_path == "last":
        return new_run_dir
    path = Path(ckpt_path).expanduser()
    if (path / "checkpoints").is_dir():
        return str(path)
    if path.is_file() and path.parent.name == "checkpoints":
        return str(path.parent.parent)
    return new_run_dir


def hydra_record_dir(output_dir: str) -> str:
    """hydra.output_subdir: .hydra, or .hydra/resume-N for a run resumed in its own directory,
    so the record of how the run was first started is never overwritten."""
    record = Path(output_dir) / ".hydra"
    if not (record / "config.yaml").exists():
        return ".hydra"
    number = 1
    while (record / f"resume-{number}").exists():
        number += 1
    return f".hydra/resume-{number}"


OmegaConf.register_new_resolver("sqlite_url", sqlite_url)
OmegaConf.register_new_resolver("resume_run_dir", resume_run_dir)
# Cached: Hydra reads the value more than once, and it must not change once the record is written.
OmegaConf.register_new_resolver("hydra_record_dir", hydra_record_dir, use_cache=True)


def instantiate_checked(node: DictConfig, **kwargs):
    """hydra.utils.instantiate, with config errors (ours and Lightning's) surfacing as
    themselves, so they print as one line."""
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as error:
        cause = error.__cause__
        if isinstance(cause, TRAIN_ERRORS):
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


def check_model_fits_data(module_class: type, data: DictConfig) -> None:
    """Before the data config is instantiated: its interpolations may name keys that only the
    fitting model has (a character GPT's data reads model.block_size)."""
    expected, choices = DATA_FOR[module_class]
    if data.get("_target_") != f"{expected.__module__}.{expected.__name__}":
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
    model, tokenizer, _ = load_run(Path(best))
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


def sample_prompt(prompt: str, tokenizer, datamodule: LMDataModule, overrides: list[str]) -> str:
    """The end-of-run sample's prompt, checked before training: one the tokenizer cannot encode
    is an error if the user gave it, and the default is replaced by the validation text's first
    token (the default, 'ROMEO:', suits only the embedded plays)."""
    try:
        tokenizer.encode(prompt)
        return prompt
    except ValueError as error:
        if "sample.prompt" in {override_key(o) for o in overrides}:
            raise ValueError(
                f"sample.prompt={prompt!r}: {error}; give a prompt in this corpus's characters"
            ) from None
    fallback = tokenizer.decode(datamodule.val_sample(1).tolist())
    print_once(
        f"sample.prompt={prompt!r} is not in this corpus's vocabulary: sampling from {fallback!r}"
    )
    return fallback


def describe_baseline(datamodule) -> str:
    """What a model must beat on this data."""
    if isinstance(datamodule, LMDataModule):
        return f"unigram baseline val loss {datamodule.unigram_loss():.3f}"
    copy = datamodule.copy_baseline()
    return (
        f"copy-the-source baseline: exact match {copy['exact_match']:.3f}, "
        f"character error rate {copy['cer']:.3f}"
    )


# print on the first process only: every rank of a distributed run runs this file
print_once = rank_zero_only(print)


def find_checkpoint(ckpt_path: str, output_dir: str) -> Path | None:
    """The checkpoint `ckpt_path` names: `last` is this run directory's checkpoints/last.ckpt
    (None when there is none yet: the run starts afresh), a directory its last.ckpt, a file
    itself."""
    if ckpt_path == "last":
        last = Path(output_dir) / "checkpoints" / "last.ckpt"
        return last if last.is_file() else None
    path = Path(ckpt_path).expanduser()
    if path.is_dir():
        path = path / "checkpoints" / "last.ckpt"
    if not path.is_file():
        raise FileNotFoundError(
            f"ckpt_path={ckpt_path}: no checkpoint at {path}; give a run directory, a .ckpt "
            "file, or ckpt_path=last with hydra.run.dir=<run dir>"
        )
    return path


def override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def resumed_overrides(original: list[str], given: list[str]) -> list[str]:
    """The overrides a resumed run composes: the checkpoint's run's, then this command's, which
    win where both set a key."""
    keys = {override_key(o) for o in given}
    return [o for o in original if override_key(o) not in keys] + list(given)


# Settings a resumed run may not change: they decide what the restored state means.
FIXED_ON_RESUME = ("model.", "data.", "seed", "optim.beta1", "optim.beta2", "optim.weight_decay")
FREE_ON_RESUME = ("model.vocab_size", "data.num_workers", "data.num_proc", "data.cache_dir")


def flatten(config: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def resume_conflicts(saved: dict, current: dict) -> list[str]:
    """'key: saved -> current' for every fixed setting this run changes."""
    saved, current = flatten(saved), flatten(current)
    keys = sorted(set(saved) | set(current))
    return [
        f"{key}: {saved.get(key)!r} in the checkpoint, {current.get(key)!r} now"
        for key in keys
        if key.startswith(FIXED_ON_RESUME)
        and not key.startswith(FREE_ON_RESUME)
        and saved.get(key) != current.get(key)
    ]


def prepare_resume(cfg: DictConfig) -> tuple[DictConfig, Path | None, dict | None, list[str]]:
    """(config, checkpoint path, checkpoint, overrides) of a run. Given ckpt_path, the config
    is composed again from the checkpoint's run's overrides under this command's, and must keep
    the settings that the checkpoint's state depends on."""
    given = [o for o in HydraConfig.get().overrides.task if override_key(o) != "ckpt_path"]
    if not cfg.get("ckpt_path"):
        return cfg, None, None, given
    path = find_checkpoint(cfg.ckpt_path, cfg.paths.output_dir)
    if path is None:
        print_once(
            f"ckpt_path=last: no checkpoint in {cfg.paths.output_dir}/checkpoints yet, so this "
            "run starts from scratch (to continue another run, give its directory: "
            "ckpt_path=outputs/<date>/<time>)"
        )
        return cfg, None, None, given
    # Mapped, not read: Lightning reads the file itself, and this copy is kept through the run.
    checkpoint = load_safely(path, mmap=True)
    hparams = checkpoint.get("hyper_parameters") if isinstance(checkpoint, dict) else None
    saved = hparams.get("run_config") if isinstance(hparams, dict) else None
    if saved is None:
        raise ValueError(f"ckpt_path={path} was not written by train.py: it has no run config")
    saved_kind = hparams.get("kind")
    asked_kind = module_for(instantiate_checked(cfg.model)).kind
    if "model" in {override_key(o) for o in given} and asked_kind != saved_kind:
        raise ValueError(
            f"ckpt_path={path} holds a {saved_kind} model and this command asks for a "
            f"{asked_kind}: drop model=... to resume it, or start a new run without ckpt_path"
        )
    overrides = resumed_overrides(saved.get("overrides", []), given)
    if overrides != given:
        try:
            cfg = compose("train", overrides=[*overrides, f"ckpt_path={path}"])
        except ConfigCompositionException as error:
            raise ValueError(
                f"ckpt_path={path}: this command's overrides do not fit the checkpoint's run "
                f"({' '.join(str(error).split())}); drop the ones that change its model or data"
            ) from None
    else:
        cfg.ckpt_path = str(path)
    current = OmegaConf.to_container(cfg, resolve=True)
    conflicts = resume_conflicts(saved, current)
    if conflicts:
        raise ValueError(
            f"ckpt_path={path} cannot resume with changed settings ({'; '.join(conflicts[:4])}"
            f"{'; ...' if len(conflicts) > 4 else ''}): drop those overrides, or start a new "
            "run without ckpt_path"
        )
    print_once(
        f"resuming from {path} at step {checkpoint['global_step']}"
        + (f" with that run's overrides: {' '.join(overrides)}" if overrides else "")
    )
    return cfg, path, checkpoint, overrides


def wandb_resume_options(node: DictConfig, checkpoint: dict | None) -> dict:
    """For a W&B logger of a resumed run: online, continue the checkpoint's W&B run (same id);
    offline (where W&B cannot continue a run), a new run in the same group."""
    if checkpoint is None or not node.get("_target_", "").endswith("WandbLogger"):
        return {}
    state = checkpoint.get("callbacks", {}).get("ResumeState", {}).get("wandb")
    if state is None:
        return {}
    if node.get("offline"):
        return {"group": node.get("group") or state["group"]}
    return {"id": state["id"], "resume": "must"}


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


def run_summary(
    trainer: L.Trainer, callbacks: list, started: float, status: str = "completed", **extra
) -> dict:
    """summary.json's content: `status` ("completed", "diverged", "stopped by SIGTERM"...),
    `extra` keys, and what the run reached."""
    history = next((c for c in callbacks if isinstance(c, RunHistory)), None)
    maps = next((c for c in callbacks if isinstance(c, AttentionMapLogger)), None)
    summary: dict = {"status": status, **extra, "wall_seconds": time.perf_counter() - started}
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


def model_vocab_size(model_config: GPTConfig | EncDecConfig, tokens: int) -> int:
    """The rows of the embedding: the tokenizer's `tokens`, or more for a GPT whose
    model.vocab_size pads it (to a multiple of 64 for faster matmuls, or to a given size)."""
    asked = model_config.vocab_size
    if asked is None or asked == tokens:
        return tokens
    if isinstance(model_config, EncDecConfig):
        raise ValueError(
            f"model.vocab_size={asked}: only the GPT's vocabulary can be padded; leave it null "
            f"for the encoder-decoder (the tokenizer has {tokens} tokens)"
        )
    if asked < tokens:
        raise ValueError(
            f"model.vocab_size={asked} is smaller than the tokenizer's {tokens} tokens; leave "
            f"it null, or give at least {tokens}"
        )
    return asked


def check_run_options(cfg: DictConfig) -> None:
    """The top-level options that no dataclass validates."""
    if not isinstance(cfg.seed, int) or isinstance(cfg.seed, bool) or not 0 <= cfg.seed < 2**32:
        raise ValueError(f"seed must be an integer in [0, 2**32), got {cfg.seed!r}")
    if not isinstance(cfg.compile, bool):
        raise ValueError(f"compile must be true or false, got {cfg.compile!r}")
    check_nonfinite_action(cfg.on_nonfinite)
    steps = cfg.trainer.get("max_steps")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(
            f"trainer.max_steps must be a positive integer (the schedule needs a length), "
            f"got {steps!r}"
        )


def train(cfg: DictConfig) -> float | None:
    """Train in cfg's run directory, as its one writer: a second run or a resume started there
    while this one runs is refused (the other ranks of a distributed run write nothing)."""
    run_dir = Path(cfg.paths.output_dir)
    with claim_run_dir(run_dir) if rank_zero_only.rank == 0 else nullcontext():
        return fit(cfg)


def check_fresh_run_dir(cfg: DictConfig) -> None:
    """A new run never overwrites another's checkpoints (a sweep job's directory is new)."""
    last = Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"
    if last.is_file() and not in_sweep():
        raise ValueError(
            f"hydra.run.dir={cfg.paths.output_dir} already holds a run ({last}): continue it "
            f"with ckpt_path={cfg.paths.output_dir}, or choose another hydra.run.dir"
        )


def fit(cfg: DictConfig) -> float | None:
    started = time.perf_counter()
    # Everything a user can get wrong in the config is checked before any data is loaded.
    cfg, ckpt_path, checkpoint, overrides = prepare_resume(cfg)
    if checkpoint is None:
        check_fresh_run_dir(cfg)
    check_run_options(cfg)
    optim = OptimConfig(**cfg.optim)
    sample = SamplingConfig(**OmegaConf.to_container(cfg.sample, resolve=True))
    model_config = instantiate_checked(cfg.model)
    module_class = module_for(model_config)
    check_model_fits_data(module_class, cfg.data)
    datamodule = instantiate_checked(cfg.data)
    resumed_tokenizer = checkpoint["hyper_parameters"]["tokenizer"] if checkpoint else None
    stop = StopSignals()
    callbacks = [instantiate_checked(c) for c in (cfg.get("callbacks") or {}).values()]
    callbacks += [ResumeState(), stop]
    loggers = [
        instantiate_checked(c, **sweep_run_names(c), **wandb_resume_options(c, checkpoint))
        for c in (cfg.get("logger") or {}).values()
    ]
    trainer = instantiate_checked(
        cfg.trainer,
        callbacks=callbacks,
        logger=loggers or False,
        plugins=[DurableCheckpointIO()],
    )
    check_not_ddp_in_multirun(trainer)
    L.seed_everything(cfg.seed, workers=True)

    # Every rank prepares the data itself (one builds the cache entry, the others wait for it
    # and reuse it), so the vocabulary size is the same everywhere without passing it around.
    if resumed_tokenizer is not None and isinstance(datamodule, LMDataModule):
        datamodule.use_tokenizer(tokenizer_from_dict(resumed_tokenizer))
    datamodule.prepare_data()
    datamodule.setup("fit")
    tokenizer = datamodule.tokenizer
    if isinstance(datamodule, LMDataModule):
        cfg.sample.prompt = sample_prompt(sample.prompt, tokenizer, datamodule, overrides)
    if resumed_tokenizer is not None and tokenizer.to_dict() != resumed_tokenizer:
        raise ValueError(
            f"ckpt_path={ckpt_path} was trained with another tokenizer than this data "
            "gives; resume with the data options of that run"
        )
    vocab_size = model_vocab_size(model_config, datamodule.vocab_size)
    # model.vocab_size is free on resume only because it is derived; a padding must match.
    saved_vocab_size = checkpoint["hyper_parameters"]["model"]["vocab_size"] if checkpoint else None
    if saved_vocab_size not in (None, vocab_size):
        raise ValueError(
            f"ckpt_path={ckpt_path} has a {saved_vocab_size}-row vocabulary and this run asks for "
            f"{vocab_size}: drop model.vocab_size=... to resume it"
        )
    model_config = dataclasses.replace(model_config, vocab_size=vocab_size)
    run_config = OmegaConf.to_container(cfg, resolve=True)
    run_config["model"]["vocab_size"] = vocab_size
    run_config["overrides"] = overrides  # what a resumed run composes its config from
    if checkpoint is not None:
        run_config["resumed_from"] = {
            "checkpoint": str(ckpt_path),
            "step": checkpoint["global_step"],
        }
    module = module_class(
        model=model_config.to_dict(),
        optim=dataclasses.asdict(optim),
        tokenizer=tokenizer.to_dict(),
        run_config=run_config,
        on_nonfinite=cfg.on_nonfinite,
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
    stop.guard_shutdown()
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
    except SIGTERMException:
        end_stopped_run(trainer, cfg, callbacks, started, stop)
    except TrainingDiverged as error:
        end_diverged_run(trainer, cfg, callbacks, started, error)
    except RuntimeError as error:  # torch.OutOfMemoryError (a GPU's) is one too
        if not out_of_memory(error):
            raise
        print(file=sys.stderr)  # below the progress bar, not on its line
        raise ValueError(
            f"out of memory at data.batch_size={cfg.data.batch_size} with "
            f"{module.model.num_parameters() / 1e6:.2f}M parameters: lower data.batch_size or "
            "the model size; the checkpoints so far are intact (resume: python train.py "
            f"ckpt_path={cfg.paths.output_dir})"
        ) from None
    if module.skipped_steps >= trainer.global_step > 0:
        end_diverged_run(
            trainer,
            cfg,
            callbacks,
            started,
            TrainingDiverged(
                f"every one of the {trainer.global_step} steps had a non-finite loss or gradient "
                "norm and was skipped (on_nonfinite=skip): the model learned nothing. Lower "
                "optim.lr, or look for bad values in the data"
            ),
        )

    if trainer.is_global_zero:
        summary = run_summary(trainer, callbacks, started)
        write_summary(cfg.paths.output_dir, summary)
        if summary.get("seconds_to_first_step"):
            print(f"first optimizer step {summary['seconds_to_first_step']:.1f} s after start")
        try:
            print_summary(trainer, cfg, datamodule)
        except Exception as error:  # the run is complete and saved: a sample cannot undo that
            print(f"warning: the end-of-run sample failed ({error})", file=sys.stderr)
    score = trainer.checkpoint_callback.best_model_score if trainer.checkpoint_callback else None
    if score is None:
        score = trainer.callback_metrics.get("val/loss")
    return None if score is None else float(score)


def out_of_memory(error: RuntimeError) -> bool:
    """A GPU's torch.OutOfMemoryError, or the CPU allocator's refusal."""
    return isinstance(error, torch.OutOfMemoryError) or "can't allocate memory" in str(error)


def end_diverged_run(
    trainer: L.Trainer, cfg: DictConfig, callbacks: list, started: float, error: TrainingDiverged
) -> NoReturn:
    """A run whose loss went non-finite: its summary says so, and the error ends the command."""
    if trainer.is_global_zero:
        summary = run_summary(trainer, callbacks, started, "diverged", error=str(error))
        write_summary(cfg.paths.output_dir, summary)
    raise error


def end_stopped_run(
    trainer: L.Trainer, cfg: DictConfig, callbacks: list, started: float, stop: StopSignals
) -> None:
    """A run stopped by SIGTERM or SIGINT: summary, how to continue, and the exit status a shell
    gives a process that signal ended (128 + signal number), so job schedulers see it."""
    name = signal.Signals(stop.signum).name
    if trainer.is_global_zero:
        summary = run_summary(trainer, callbacks, started, f"stopped by {name}")
        write_summary(cfg.paths.output_dir, summary)
        saved = f"saved {stop.saved}" if stop.saved else "no checkpoint callback, nothing saved"
        print(
            f"stopped by {name} after step {trainer.global_step}; {saved}; continue with: "
            f"python train.py ckpt_path={cfg.paths.output_dir}",
            file=sys.stderr,
        )
    sys.exit(128 + stop.signum)


class JobFailed(Exception):
    """A sweep job that the user's config broke."""


def train_sweep_job(cfg: DictConfig) -> float | None:
    """One job of a sweep. A job the user's config breaks (say n_head=3 with n_embd=128) fails
    with a one-line message and a failed summary.json, and its error goes back to the sweeper,
    which records it (Optuna marks the trial failed) while the other jobs run on."""
    try:
        return train(cfg)
    except TRAIN_ERRORS as error:
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
        return exit_on_user_error(lambda: train(cfg), TRAIN_ERRORS)
    finally:
        # Every job ends its W&B run, failed or not: a sweep's next job must not log into it.
        if "wandb" in sys.modules:  # imported only by a run that logs to W&B
            sys.modules["wandb"].finish()


if __name__ == "__main__":
    main()
