"""Train a model from the shell: `python train.py [group=choice] [key=value ...]`.

Hydra composes configs/train.yaml and makes the run directory; then a run is four steps:
check (training/plan.py: every option, before any data loads; given ckpt_path, the
checkpoint's run's config), build (training/build.py: Trainer, data, LightningModule), fit,
summarise (training/summary.py: summary.json and the end-of-run printout). train() returns the
best validation loss, which Hydra's sweepers minimise.
"""

import gc

# The imports below build a heap of about 400,000 objects (torch, Lightning, Hydra) that lives
# as long as the process. Python collected over it 6 times while it grew and once more at exit,
# seconds of a 2-core CPU's start and end, and none of it is garbage. So no collection until the
# imports are done, and then those objects are frozen out of every later one.
gc.disable()
# ruff: noqa: E402 (the imports come after gc.disable())

import signal
import time
from contextlib import nullcontext
from pathlib import Path

import hydra
import lightning as L
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from data.sources import progress_bars_on_terminals_only
from errors import exit_on_user_error
from training.attention_maps import finish_maps
from training.build import build_module, build_trainer, prepare_data
from training.checkpoint_io import claim_run_dir
from training.failures import (
    TRAIN_ERRORS,
    instantiate_checked,
    optimizer_state_mismatch,
    out_of_memory,
)
from training.guard import TrainingDiverged, all_steps_skipped
from training.module import DataModule, TrainingModule
from training.plan import Plan, check_options
from training.precision import fast_precision
from training.resume import StopSignals, hydra_record_dir, refused_leaves_no_record, resume_run_dir
from training.summary import best_val_loss, describe_baseline, print_end, run_summary, write_summary
from training.sweep import in_sweep, pruned_reason, raise_if_pruned, run_sweep_job, sqlite_url
from training.wandb_run import finish_wandb

OmegaConf.register_new_resolver("sqlite_url", sqlite_url)
OmegaConf.register_new_resolver("resume_run_dir", resume_run_dir)
OmegaConf.register_new_resolver("fast_precision", fast_precision)
# Cached: Hydra reads the value more than once, and it must not change once the record is written.
OmegaConf.register_new_resolver("hydra_record_dir", hydra_record_dir, use_cache=True)
gc.freeze()
gc.enable()


def run_fit(
    trainer: L.Trainer,
    module: TrainingModule,
    datamodule: DataModule,
    plan: Plan,
    stop: StopSignals,
) -> tuple[str, TrainingDiverged | None]:
    """(status, error): how Trainer.fit ended ("pruned": an Optuna trial's pruner stopped it
    early). Running out of memory, and a checkpoint whose
    optimizer state does not fit, are one-line errors."""
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=plan.resume.path, weights_only=True)
    except SIGTERMException:
        return f"stopped by {signal.Signals(stop.signum).name}", None
    except TrainingDiverged as diverged:
        return "diverged", diverged
    except RuntimeError as failure:  # torch.OutOfMemoryError (a GPU's) is one too
        parameters = module.model.num_parameters()
        out_of_memory(failure, plan.cfg.data.batch_size, parameters, plan.run_dir)
        raise
    except ValueError as failure:
        optimizer_state_mismatch(failure, plan.resume.path)
        raise
    error = all_steps_skipped(module.skipped_steps, trainer.global_step)
    if error:
        return "diverged", error
    return ("pruned" if pruned_reason(trainer) else "completed"), None


def fit(cfg: DictConfig, stop: StopSignals) -> float | None:
    started = time.perf_counter()
    with refused_leaves_no_record():
        plan = check_options(cfg)
        if plan.resume.says_nothing_to_train():
            return None
        datamodule = instantiate_checked(plan.cfg.data)
        trainer = build_trainer(plan, stop)
        L.seed_everything(plan.cfg.seed, workers=True)
        prepare_data(plan, datamodule, trainer.world_size)
        module = build_module(plan, datamodule.tokenizer)
    if trainer.is_global_zero:
        datamodule.tokenizer.save(Path(plan.run_dir) / "tokenizer.json")
        parameters = module.model.num_parameters() / 1e6
        print(f"model: {parameters:.2f}M parameters; {describe_baseline(datamodule)}")
    for logger in trainer.loggers:
        logger.log_hyperparams(module.hparams.run_config)

    status, error = run_fit(trainer, module, datamodule, plan, stop)

    if trainer.is_global_zero:
        write_summary(plan.run_dir, run_summary(trainer, started, status, error and str(error)))
    if error:
        raise error
    if status not in ("completed", "pruned"):
        finish_wandb()  # before the ranks end together (StopSignals.exit): its last writes too
        stop.exit(trainer, plan.run_dir)
    if trainer.is_global_zero:  # the last maps draw meanwhile
        stop.run_sample(lambda: print_end(trainer, plan.sample, datamodule, plan.run_dir))
    finish_maps(trainer)
    if trainer.is_global_zero:  # again, now with the time the last maps took
        write_summary(plan.run_dir, run_summary(trainer, started, status, None))
    raise_if_pruned(trainer)
    return best_val_loss(trainer)


def train(cfg: DictConfig) -> float | None:
    """Train in cfg's run directory, as its one writer: a second run or a resume started there
    while this one runs is refused (the other ranks of a distributed run write nothing). SIGTERM
    and Ctrl-C are StopSignals' from the first check on, so that before the first step (preparing
    the data too) they end the command at once with their status, not a traceback, and to the
    process's end but in a sweep, so that once training has completed they end the end-of-run
    sample and the run ends completed, status 0, as summary.json says."""
    stop = StopSignals()
    with stop.handling_signals(put_back=in_sweep()):
        with refused_leaves_no_record():
            claim = claim_run_dir(Path(cfg.paths.output_dir)) if rank_zero_only.rank == 0 else None
        with claim or nullcontext():
            return fit(cfg, stop)


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> float | None:
    progress_bars_on_terminals_only()
    try:
        if in_sweep():
            return run_sweep_job(train, cfg)
        return exit_on_user_error(lambda: train(cfg), TRAIN_ERRORS)
    finally:
        finish_wandb()  # every job's, failed or not


if __name__ == "__main__":
    main()
