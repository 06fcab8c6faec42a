"""train.py's build step: the parts of one run, from its checked Plan (training/plan.py): the
data prepared, the LightningModule and the Trainer with its callbacks and loggers."""

import dataclasses

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import OmegaConf

from data.lm import LMDataModule
from data.tokenizer import tokenizer_from_dict
from errors import override_key
from training.attention_maps import finish_maps_later
from training.checkpoint_io import DurableCheckpointIO
from training.failures import instantiate_checked
from training.module import DataModule
from training.plan import Plan
from training.resume import ExactRestart, ResumeState, StopSignals
from training.summary import checked_sample
from training.sweep import check_not_ddp_in_sweep, trial_pruning
from training.wandb_run import ReleaseWandbStart, WandbLogger, run_names


def prepare_data(plan: Plan, datamodule: DataModule, world_size: int) -> None:
    """Tokenize (or reuse the cache), with a resumed run's tokenizer, and check that the
    training data fills a batch on each of the world_size processes and the end-of-run sample's
    prompt against it. Every rank prepares the data itself (one builds the cache entry, the
    others wait for it), so the vocabulary is the same everywhere."""
    if isinstance(datamodule, LMDataModule) and plan.init:
        datamodule.use_tokenizer(tokenizer_from_dict(plan.init.tokenizer), plan.init.option)
    elif isinstance(datamodule, LMDataModule) and plan.resume.saved_tokenizer is not None:
        given_by = f"ckpt_path={plan.resume.path}"
        datamodule.use_tokenizer(tokenizer_from_dict(plan.resume.saved_tokenizer), given_by)
    datamodule.prepare_data()
    datamodule.setup("fit")
    datamodule.check_batches(world_size)
    if isinstance(datamodule, LMDataModule):
        given = "sample.prompt" in {override_key(o) for o in plan.resume.overrides}
        plan.sample = checked_sample(plan.sample, datamodule.tokenizer, datamodule, given)
        plan.cfg.sample.prompt = plan.sample.prompt  # the run config records the one used


def build_module(plan: Plan, tokenizer) -> L.LightningModule:
    """The LightningModule, with init_from's weights if given; its hyper-parameters carry the
    resolved run config (with what a later resume composes from) and the tokenizer, so a
    checkpoint needs nothing else."""
    model = plan.model.for_tokenizer(tokenizer.vocab_size)
    plan.resume.check_data(tokenizer, model.vocab_size)
    run_config = OmegaConf.to_container(plan.cfg, resolve=True)
    run_config["model"]["vocab_size"] = model.vocab_size
    run_config.update(plan.resume.record())
    module = plan.kind.module_class(
        model=model.to_dict(),
        optim=dataclasses.asdict(plan.optim),
        tokenizer=tokenizer.to_dict(),
        run_config=run_config,
        on_nonfinite=plan.cfg.on_nonfinite,
    )
    if plan.init:
        plan.init.load_into(module.model)
    if plan.cfg.compile:
        # in place: the state dict keeps its keys, checkpoints load as ever
        module.model.compile(mode=plan.cfg.compile_mode)
    return module


def build_trainer(plan: Plan, stop: StopSignals) -> L.Trainer:
    """The Trainer with the config's callbacks and loggers, and ours: the state a resumed run
    needs, the stop on SIGTERM or Ctrl-C, and the start of an offline W&B run, on a thread once
    the first step is done."""
    callbacks = [instantiate_checked(c) for c in (plan.cfg.get("callbacks") or {}).values()]
    loggers = [
        instantiate_checked(
            c, **(run_names(c, plan.cfg.model, plan.run_dir) | plan.resume.wandb_options(c))
        )
        for c in (plan.cfg.get("logger") or {}).values()
    ]
    wandb_loggers = [logger for logger in loggers if isinstance(logger, WandbLogger)]
    for logger in wandb_loggers:
        logger.start_in_background()  # released after the first training step
    uploads = any(logger.uploads_checkpoints for logger in wandb_loggers)
    ours = [ResumeState(), ExactRestart(), stop, ReleaseWandbStart(wandb_loggers), *trial_pruning()]
    # Without a checkpoint callback (~callbacks.model_checkpoint), Lightning would add its own,
    # whose epoch=...-step=....ckpt files neither a resume nor generate.py looks for: none.
    saves = any(isinstance(c, ModelCheckpoint) for c in callbacks)
    trainer = instantiate_checked(
        plan.cfg.trainer,
        callbacks=[*callbacks, *ours],
        logger=loggers or False,
        plugins=[DurableCheckpointIO(background=not uploads)],
        **({} if saves else {"enable_checkpointing": False}),
    )
    check_not_ddp_in_sweep(trainer.world_size)
    finish_maps_later(callbacks)  # after the end-of-run printout: see fit()
    stop.end_launched_processes_too(trainer)
    return trainer
