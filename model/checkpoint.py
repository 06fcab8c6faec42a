"""A trained network and its tokenizer's record from a checkpoint file, loaded safely, without
the training stack: what generate.py (and anything else that only runs a model) needs."""

import os
import pickle
from pathlib import Path
from typing import Any

import torch

from model.encdec import EncDecConfig, EncoderDecoder
from model.gpt import GPT, GPTConfig

# The networks by the kind name a checkpoint records: (config class, network class).
MODELS = {"gpt": (GPTConfig, GPT), "encdec": (EncDecConfig, EncoderDecoder)}


def build_model(kind: str, config: dict) -> GPT | EncoderDecoder:
    """The network of a checkpoint or run: its kind and its config dict."""
    if kind not in MODELS:
        raise ValueError(f"unknown model kind {kind!r}; known kinds are {sorted(MODELS)}")
    config_class, model_class = MODELS[kind]
    return model_class(config_class.from_dict(config))


def load_safely(
    path: str | os.PathLike, map_location: Any = "cpu", mmap: bool = False
) -> dict[str, Any]:
    """torch.load with weights_only=True: tensors and plain data only, so a checkpoint from a
    stranger cannot run code. A truncated, foreign or malicious file is a ValueError naming it.
    mmap=True maps the tensors' bytes instead of reading them (only what is used is read)."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as error:
        first_line = str(error).splitlines()[0] if str(error) else "truncated or foreign file"
        raise ValueError(
            f"{path} is not a readable tinyformer checkpoint ({type(error).__name__}: "
            f"{first_line}); point at a .ckpt written by train.py"
        ) from error


def model_state(state: dict) -> dict:
    """The network's weights from a LightningModule state dict, whether or not the model was
    compiled: torch.compile's wrapper adds `_orig_mod.` to every key (compiling in place, as
    train.py does, adds nothing), and a plain model loads either."""
    return {
        key.removeprefix("model.").replace("_orig_mod.", ""): value for key, value in state.items()
    }


def find_checkpoint(given: str | os.PathLike, which: str, key: str) -> Path:
    """The checkpoint file that `given` (the value of the command's option `key`) names, by one
    rule: a file is itself; a run directory, or its checkpoints/ folder, gives its `which`
    checkpoint. "last" is last.ckpt, where a run continues (train.py ckpt_path=); "best" is the
    newest best*.ckpt, else last.ckpt, what a trained model is used from (generate.py ckpt=)."""
    path = Path(given).expanduser()
    if path.is_file():
        return path
    folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    candidates = [folder / "last.ckpt"]
    if which == "best":
        best = sorted(folder.glob("best*.ckpt"), key=lambda p: p.stat().st_mtime)
        candidates = best[-1:] + candidates
    found = next((c for c in candidates if c.is_file()), None)
    if found is not None:
        return found
    missing = f"no {which} checkpoint in {folder}" if path.is_dir() else f"no checkpoint at {path}"
    raise FileNotFoundError(
        f"{key}={given}: {missing}; give the directory of a run that saved checkpoints (runs "
        "live under outputs/) or a .ckpt file"
    )


def load_checkpoint(path: Path) -> tuple[GPT | EncoderDecoder, dict]:
    """(model in eval mode, hyper_parameters) from a training checkpoint; the hyper-parameters
    hold the tokenizer's record under "tokenizer" and the run's config under "run_config"."""
    checkpoint = load_safely(path)
    try:
        if not isinstance(checkpoint, dict):
            raise TypeError(f"a {type(checkpoint).__name__}, not a dict")
        hparams, state = checkpoint["hyper_parameters"], checkpoint["state_dict"]
        if "tokenizer" not in hparams:
            raise KeyError("tokenizer")
        model = build_model(hparams.get("kind", "gpt"), hparams["model"])
    except (KeyError, TypeError) as error:
        raise ValueError(
            f"{path} is not a tinyformer checkpoint ({type(error).__name__}: {error}); point "
            "ckpt= at a .ckpt written by train.py"
        ) from error
    model.load_state_dict(model_state(state))
    return model.eval(), hparams
