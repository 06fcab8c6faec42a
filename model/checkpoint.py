"""A trained network and its tokenizer's record from a checkpoint file or an export directory,
loaded safely, without the training stack: what generate.py (and anything else that only runs a
model) needs.

An export (export.py) is a directory of `config.json`, whose "tinyformer" entry holds what a
checkpoint's hyper-parameters hold (kind, model config, tokenizer record, run config) and the
weights' layout ("safetensors": ours; "hf": Hugging Face GPT-2's), `model.safetensors` and the
tokenizer's files, which other tools read."""

import json
import os
import pickle
import struct
import zipfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, load_model

from errors import not_text
from model.encdec import EncDecConfig, EncoderDecoder
from model.gpt import GPT, GPTConfig
from model.hf_gpt2 import from_gpt2

# The networks by the kind name a checkpoint records: (config class, network class). The rest
# of each kind (what trains it, its data) is its row in kinds.py.
MODELS = {"gpt": (GPTConfig, GPT), "encdec": (EncDecConfig, EncoderDecoder)}


def build_model(kind: str, config: dict) -> GPT | EncoderDecoder:
    """The network of a checkpoint or run: its kind and its config dict."""
    if kind not in MODELS:
        raise ValueError(f"unknown model kind {kind!r}; known kinds are {sorted(MODELS)}")
    config_class, model_class = MODELS[kind]
    return model_class(config_class.from_dict(config))


def build_saved_model(kind: str, config: dict, path: Path) -> GPT | EncoderDecoder:
    """build_model for the config saved in `path`, whose refusal (a setting this version does
    not know, a value it does not take) names the file, which the config's own message cannot."""
    try:
        return build_model(kind, config)
    except ValueError as error:
        raise ValueError(f"{path} holds a model this version cannot build: {error}") from None


def load_safely(
    path: str | os.PathLike, map_location: Any = "cpu", mmap: bool = False
) -> dict[str, Any]:
    """torch.load with weights_only=True: tensors and plain data only, so a checkpoint from a
    stranger cannot run code. A truncated, damaged, foreign or malicious file is a ValueError
    naming it. mmap=True maps the tensors' bytes instead of reading them (only what is used is
    read, and so not checked for damage)."""
    if Path(path).is_file() and not zipfile.is_zipfile(path):
        # Read as pickle opcodes, any other bytes (a text file) fail inside torch's unpickler
        # with whatever error those opcodes meet: KeyError, IndexError, struct.error...
        raise ValueError(
            f"{path} is not a readable tinyformer checkpoint (not the zip archive torch.save "
            "writes); point at a .ckpt written by train.py"
        )
    damaged = None if mmap else damaged_member(path)
    if damaged is not None:
        raise ValueError(
            f"{path} is damaged: its {damaged} does not match the checksum written with it; use "
            "another checkpoint of the run (last.ckpt, best*.ckpt) or an export of it"
        )
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise
    # KeyError, IndexError, struct.error: a damaged archive's pickle fails as other bytes do
    except (
        pickle.UnpicklingError,
        RuntimeError,
        EOFError,
        OSError,
        ValueError,
        KeyError,
        IndexError,
        struct.error,
    ) as error:
        first_line = str(error).splitlines()[0] if str(error) else "truncated or foreign file"
        raise ValueError(
            f"{path} is not a readable tinyformer checkpoint ({type(error).__name__}: "
            f"{first_line}); point at a .ckpt written by train.py"
        ) from error


def damaged_member(path: str | os.PathLike) -> str | None:
    """The first file of the checkpoint's zip archive whose bytes no longer match the CRC-32 that
    torch.save wrote with them, if any. torch.load does not check them: a damaged byte loads as
    a wrong weight, a NaN that fails sampling far from its cause or a plausible number that
    fails nothing. An archive too broken to list is left to torch.load's own error. Reads the
    file once more (about 20 ms for 10 MB)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError):
        return None


def model_state(state: dict) -> dict:
    """The network's weights from a LightningModule state dict, whether or not the model was
    compiled: torch.compile's wrapper adds `_orig_mod.` to every key (compiling in place, as
    train.py does, adds nothing), and a plain model loads either."""
    return {
        key.removeprefix("model.").replace("_orig_mod.", ""): value for key, value in state.items()
    }


# An export directory's two files that make it one; the tokenizer's files lie beside them.
EXPORT_CONFIG, EXPORT_WEIGHTS = "config.json", "model.safetensors"
# What config.json's "tinyformer" entry always holds (and may hold run_config, exported_from).
EXPORT_KEYS = {"format", "kind", "model", "tokenizer"}


def is_export(path: Path) -> bool:
    """Whether `path` is an export directory (config.json and model.safetensors)."""
    return (path / EXPORT_CONFIG).is_file() and (path / EXPORT_WEIGHTS).is_file()


def run_dir_of(folder: Path) -> Path | None:
    """The run directory (as train.py makes one) that `folder` is, or whose checkpoints/ folder
    it is; None if neither. Any existing folder named checkpoints counts as a run's. Where
    evaluate.py and export.py write, a run's files could be lost."""
    if folder.name == "checkpoints" and folder.is_dir():
        return folder.parent
    if (folder / "checkpoints").is_dir() or (folder / ".hydra").is_dir():
        return folder
    return None


def find_checkpoint(given: str | os.PathLike, which: str, key: str) -> Path:
    """The checkpoint that `given` (the value of the command's option `key`) names, by one rule:
    a file is itself (an export's own .json or .safetensors file is refused, naming its
    directory); an export directory is itself; a run directory, or its checkpoints/
    folder, gives its `which` checkpoint. "last" is last.ckpt, where a run continues (train.py
    ckpt_path=), which an export cannot do: it holds no training state; "best" is the best
    checkpoint (see best_checkpoint), else last.ckpt, what a trained model is used from
    (generate.py ckpt=)."""
    # null, Hydra's mark of a value not given, or nothing (ckpt=$RUN with RUN unset): the
    # empty path would be the current directory
    if given is None or given == "???" or not str(given).strip():
        raise ValueError(
            f"give {key}=: the directory of a run that saved checkpoints (runs live under "
            "outputs/), a .ckpt file, or an export's directory"
        )
    if not isinstance(given, str | os.PathLike):  # ckpt=0, a sweep job's folder
        raise ValueError(not_text(key, given))
    path = Path(given).expanduser()
    if path.is_file():
        # An export's weights, config or tokenizer alone hold no model (a .ckpt beside them does)
        if path.suffix in (".safetensors", ".json") and is_export(path.parent):
            raise ValueError(
                f"{key}={given} is a file of the export {path.parent}: give the export's "
                f"directory, {key}={path.parent}"
            )
        return path
    if is_export(path):
        if which == "last":
            raise ValueError(
                f"{key}={given} is an export, which holds the weights only: continue from the "
                "run directory it was exported from"
            )
        return path
    folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    candidates = [folder / "last.ckpt"]
    if which == "best":
        candidates = [best_checkpoint(folder), *candidates]
    found = next((c for c in candidates if c is not None and c.is_file()), None)
    if found is not None:
        return found
    looked_for = " or ".join(c.name if c else "best*.ckpt" for c in candidates)
    missing = f"no {looked_for} in {folder}" if path.is_dir() else f"no checkpoint at {path}"
    # an export holds no training state to continue from
    export = "" if which == "last" else ", or an export's directory"
    raise FileNotFoundError(
        f"{key}={given}: {missing}; give the directory of a run that saved checkpoints (runs "
        f"live under outputs/) or a .ckpt file{export}"
    )


def best_checkpoint(folder: Path) -> Path | None:
    """The run's best*.ckpt by the metric its checkpoint callback monitors (by default the
    lowest validation loss): the only one (save_top_k=1, the default), or, of several, the one
    that the latest names as the best in its checkpoint callback's record (written as the top k
    last changed, so it knows them all). By name in `folder`: the record's paths are those of
    the run's directory when it wrote them."""
    saved = list(folder.glob("best*.ckpt"))
    if len(saved) < 2:
        return saved[0] if saved else None
    # The newest by step, not by file time, which a copy of the folder reorders.
    checkpoints = {path: load_safely(path, mmap=True) for path in saved}
    newest = max(saved, key=lambda path: checkpoints[path].get("global_step", 0))
    callbacks = checkpoints[newest].get("callbacks", {})
    records = [r for r in callbacks.values() if isinstance(r, dict) and "best_model_path" in r]
    best = folder / Path(records[0]["best_model_path"]).name if records else newest
    return best if best.is_file() else newest


def load_checkpoint(path: Path, key: str = "ckpt") -> tuple[GPT | EncoderDecoder, dict]:
    """(model in eval mode, hyper_parameters) from a training checkpoint or an export directory
    (what find_checkpoint returns); the hyper-parameters hold the model's kind under "kind", its
    config under "model", the tokenizer's record under "tokenizer" and the run's config under
    "run_config". `key` is the option that named it, for the messages."""
    if path.is_dir():
        return load_export(path, key)
    checkpoint = load_safely(path)
    try:
        if not isinstance(checkpoint, dict):
            raise TypeError(f"a {type(checkpoint).__name__}, not a dict")
        hparams, state = checkpoint["hyper_parameters"], checkpoint["state_dict"]
        if "tokenizer" not in hparams:
            raise KeyError("tokenizer")
        model = build_saved_model(hparams.get("kind", "gpt"), hparams["model"], path)
    except (KeyError, TypeError) as error:
        raise ValueError(
            f"{path} is not a tinyformer checkpoint ({type(error).__name__}: {error}); point "
            f"{key}= at a .ckpt written by train.py"
        ) from error
    try:
        model.load_state_dict(model_state(state))
    except RuntimeError as error:
        raise ValueError(
            f"{path} does not hold the weights of its own model config "
            f"({weights_mismatch(error)}); point {key}= at a checkpoint train.py wrote whole"
        ) from None
    return model.eval(), hparams


def export_record(folder: Path, key: str = "ckpt") -> dict:
    """The "tinyformer" entry of an export's config.json: format, kind, model, tokenizer,
    run_config and exported_from. `key` is the option that named it, for the message."""
    config_file = folder / EXPORT_CONFIG
    try:
        record = json.loads(config_file.read_text(encoding="utf-8"))["tinyformer"]
        if not isinstance(record, dict) or not EXPORT_KEYS <= record.keys():
            raise KeyError(f"tinyformer needs the keys {sorted(EXPORT_KEYS)}")
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"{config_file} is not a tinyformer export's config ({type(error).__name__}: "
            f"{error}); point {key}= at a directory written by export.py"
        ) from None
    return record


def load_export(folder: Path, key: str = "ckpt") -> tuple[GPT | EncoderDecoder, dict]:
    """(model in eval mode, its record) from an export directory; the record has the keys of a
    checkpoint's hyper-parameters that load_checkpoint names."""
    record = export_record(folder, key)
    model = build_saved_model(record["kind"], record["model"], folder / EXPORT_CONFIG)
    weights_file = folder / EXPORT_WEIGHTS
    try:
        if record["format"] == "hf":
            model.load_state_dict(from_gpt2(load_file(weights_file), model))
        else:  # safetensors stores a tied tensor once; load_model ties it again
            load_model(model, weights_file)
    except (SafetensorError, RuntimeError, KeyError) as error:
        raise ValueError(
            f"{weights_file} does not hold the weights of {folder / EXPORT_CONFIG}'s model "
            f"({weights_mismatch(error)}); export it again"
        ) from None
    return model.eval(), record


def weights_mismatch(error: Exception) -> str:
    """A failed load's error on one line, for a message: load_state_dict lists every missing or
    unexpected key over many lines."""
    return f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"


def pick_device(name: str) -> torch.device:
    """The device= option of the commands that run a trained model: auto, cpu or cuda."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"device={name!r} is not one of auto, cpu, cuda")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda, but torch finds no GPU on this machine: use device=cpu")
    return torch.device(name)
