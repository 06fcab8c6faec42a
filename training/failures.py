"""What ends a training run with a one-line message rather than a traceback: the user's
mistakes (errors.py's USER_ERRORS), config nodes whose Hydra target cannot be imported or takes
no such key, Lightning's config errors, a diverged run, and memory running out."""

import inspect
import logging
import sys
from pathlib import Path
from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate
from lightning.fabric.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig

from errors import USER_ERRORS, check_known
from training.guard import TrainingDiverged

TRAIN_ERRORS = (*USER_ERRORS, MisconfigurationException, TrainingDiverged)


def instantiate_checked(node: DictConfig, **kwargs: Any) -> Any:
    """hydra.utils.instantiate, with config errors (ours and Lightning's) surfacing as
    themselves, so they print as one line, and a key that the target does not take too."""
    check_target_takes(node)
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as error:
        cause = error.__cause__
        if isinstance(cause, TRAIN_ERRORS):
            raise cause from None
        raise


def target_of(node: DictConfig) -> Any:
    """What `node`'s _target_ names; one that cannot be imported is a one-line error naming it
    (Hydra's is a traceback), before anything is built."""
    hydra_log = logging.getLogger("hydra.utils")
    hydra_log.disabled = True  # it would log the error, over lines, before the one line below
    try:
        return get_object(node._target_)
    except Exception as error:  # ImportError, or whatever importing the module raised
        cause = error.__cause__ or error
        raise ValueError(
            f"{node._get_full_key(None)}._target_={node._target_!r} cannot be imported "
            f"({type(cause).__name__}: {cause}): give a class's import path, as configs/ do"
        ) from None
    finally:
        hydra_log.disabled = False


def check_target_takes(node: DictConfig) -> None:
    """Each key of `node` (`+trainer.foo=1` adds one) is an argument of its _target_, which
    would otherwise fail with a TypeError's traceback, and so on down the targets it holds (a
    model's attention); a target that takes any keyword checks its own."""
    for _, child in node.items_ex(resolve=False):
        if isinstance(child, DictConfig) and "_target_" in child:
            check_target_takes(child)
    if "_target_" not in node:
        return
    target = target_of(node)
    try:
        parameters = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):  # a target without a signature: instantiate judges it
        return
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return
    names = [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    key = node._get_full_key(None)
    check_known((k for k in node if not k.startswith("_")), names, f"{key}.", key)


def optimizer_state_mismatch(error: ValueError, checkpoint: Path | None) -> None:
    """Raise a one-line ValueError naming the checkpoint when the optimizer state it holds does
    not fit the model's parameter groups; anything else is left to its caller."""
    if checkpoint is None or "parameter group" not in str(error):
        return
    raise ValueError(
        f"ckpt_path={checkpoint}: its optimizer state does not fit this model's parameter groups "
        "(a checkpoint of a tinyformer from before weight decay was chosen by module type, or "
        "of another model): resume it with the version that wrote it, or start a new run; "
        "generate.py, evaluate.py and export.py read it as it is"
    ) from None


def out_of_memory(error: BaseException, batch_size: int, parameters: int, run_dir: str) -> None:
    """Raise a one-line ValueError for a GPU's torch.OutOfMemoryError or the CPU allocator's
    refusal; anything else is left to its caller."""
    if not isinstance(error, torch.OutOfMemoryError) and "can't allocate memory" not in str(error):
        return
    print(file=sys.stderr)  # below the progress bar, not on its line
    raise ValueError(
        f"out of memory at data.batch_size={batch_size} with {parameters / 1e6:.2f}M "
        "parameters: lower data.batch_size or the model size; the checkpoints so far are intact "
        f"(resume: python train.py ckpt_path={run_dir})"
    ) from None
