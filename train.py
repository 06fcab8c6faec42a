"""Train a model from the shell: `python train.py [group=choice] [key=value ...]`.

Hydra composes configs/train.yaml and makes the run directory; this file instantiates the
data, the LightningModule, the loggers and the Trainer, fits, and returns the best validation
loss so that Hydra sweepers can minimise it.
"""

import dataclasses
import shlex
from pathlib import Path

import hydra
import lightning as L
import torch
import wandb
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch.loggers import WandbLogger
from omegaconf import DictConfig, OmegaConf

from generate import SamplingConfig, exit_on_user_error, load_checkpoint, stream_samples
from model.module import LanguageModelModule, OptimConfig


def instantiate_checked(node: DictConfig, **kwargs):
    """hydra.utils.instantiate, with our own config errors surfacing as themselves."""
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as error:
        cause = error.__cause__
        if isinstance(cause, ValueError | FileNotFoundError):
            raise cause from None
        raise


def print_summary(trainer: L.Trainer, cfg: DictConfig) -> None:
    """Where the best checkpoint is, a short sample from it, and how to get more."""
    callback = trainer.checkpoint_callback
    best = callback.best_model_path if callback else ""
    if not best:
        return
    print(f"\nbest checkpoint: {best} (val/loss {callback.best_model_score:.4f})")
    model, tokenizer, _ = load_checkpoint(Path(best))
    sample = SamplingConfig(**OmegaConf.to_container(cfg.sample, resolve=True))
    print("sample:\n")
    stream_samples(model, tokenizer, sample, torch.device("cpu"))
    prompt = shlex.quote(f"prompt={sample.prompt}")
    print(f"\nmore: python generate.py ckpt={cfg.paths.output_dir} {prompt} max_new_tokens=500")


def train(cfg: DictConfig) -> float | None:
    # Everything a user can get wrong in the config is checked before any data is loaded.
    optim = OptimConfig(**cfg.optim)
    SamplingConfig(**OmegaConf.to_container(cfg.sample, resolve=True))
    model_config = instantiate_checked(cfg.model)
    datamodule = instantiate_checked(cfg.data)
    callbacks = [instantiate_checked(c) for c in (cfg.get("callbacks") or {}).values()]
    loggers = [instantiate_checked(c) for c in (cfg.get("logger") or {}).values()]
    L.seed_everything(cfg.seed, workers=True)

    datamodule.prepare_data()
    datamodule.setup("fit")
    model_config = dataclasses.replace(model_config, vocab_size=datamodule.vocab_size)
    run_config = OmegaConf.to_container(cfg, resolve=True)
    run_config["model"]["vocab_size"] = datamodule.vocab_size
    module = LanguageModelModule(
        model=model_config.to_dict(),
        optim=dataclasses.asdict(optim),
        tokenizer=datamodule.tokenizer.to_dict(),
        run_config=run_config,
    )
    print(
        f"model: {module.model.num_parameters() / 1e6:.2f}M parameters; "
        f"unigram baseline val loss {datamodule.unigram_loss():.3f}"
    )
    for logger in loggers:
        logger.log_hyperparams(run_config)
    trainer = instantiate_checked(cfg.trainer, callbacks=callbacks, logger=loggers or False)
    trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))

    if trainer.is_global_zero:
        print_summary(trainer, cfg)
    if any(isinstance(logger, WandbLogger) for logger in loggers):
        wandb.finish()  # a multirun's next job must not log into this run
    score = trainer.checkpoint_callback.best_model_score if trainer.checkpoint_callback else None
    if score is None:
        score = trainer.callback_metrics.get("val/loss")
    return None if score is None else float(score)


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> float | None:
    return exit_on_user_error(lambda: train(cfg))


if __name__ == "__main__":
    main()
