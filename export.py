"""Export a trained model as plain files, for use without the training stack: generate.py
ckpt=<out>, model.checkpoint.load_checkpoint and, with format=hf, Hugging Face transformers.

    python export.py ckpt=<run dir, .ckpt or export> out=<dir>
    python export.py ckpt=<run dir> out=<dir> format=hf      # AutoModelForCausalLM loads it

<out> holds model.safetensors (the weights), config.json (under "tinyformer": the model's kind
and config, the tokenizer's record, the run's config; with format=hf also GPT-2's config), and
tokenizer.json + tinyformer_tokenizer.json (the tokenizer, as a run directory holds it); with
format=hf also transformers' tokenizer_config.json and generation_config.json.
"""

import glob
import importlib.util
import json
import os
import shutil
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import save_model

from data.files import disk_full_cause
from data.tokenizer import BPETokenizer, CharTokenizer, tokenizer_from_dict
from errors import (
    check_field_types,
    check_writable,
    config_from,
    run_command,
)
from model.checkpoint import (
    EXPORT_CONFIG,
    EXPORT_WEIGHTS,
    export_record,
    find_checkpoint,
    is_export,
    load_checkpoint,
    run_dir_of,
)
from model.encdec import EncoderDecoder
from model.gpt import GPT
from model.hf_gpt2 import gpt2_config, gpt2_obstacle, to_gpt2

FORMATS = ("safetensors", "hf")
# Every file an export of either format writes: those of an earlier export that a new one does
# not write are removed, so that a directory never mixes two exports.
EXPORT_FILES = {
    EXPORT_CONFIG,
    EXPORT_WEIGHTS,
    "tokenizer.json",
    "tinyformer_tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
}
# How far transformers' logits may be from ours before format=hf refuses to write the export.
LOGITS_TOLERANCE = 1e-4


@dataclass
class ExportOptions:
    """export.py's options, checked before anything is loaded."""

    ckpt: str
    out: str
    format: str = "safetensors"
    overwrite: bool = False

    def __post_init__(self) -> None:
        check_field_types(self, "")
        if not self.out.strip():  # out=$DIR with DIR unset: not the current directory
            raise ValueError("out= is empty: give the directory to write the export to")
        if self.format not in FORMATS:
            raise ValueError(f"format={self.format!r} is not one of {', '.join(FORMATS)}")
        if self.format == "hf" and importlib.util.find_spec("transformers") is None:
            raise ValueError("format=hf needs transformers: pip install -e '.[hf]'")


def holds_export(folder: Path) -> bool:
    """Whether `folder` holds an export of ours, which a new export may replace."""
    if not is_export(folder):
        return False
    try:
        export_record(folder)
    except ValueError:  # e.g. a model from the Hugging Face Hub: not ours to replace
        return False
    return True


def check_out(out: Path, checkpoint: Path, overwrite: bool) -> None:
    """Refuse an `out` where the export would lose saved files, or that cannot be written."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"out={out} is a file: give a directory")
    if checkpoint.resolve().is_relative_to(out.resolve()):
        raise ValueError(f"out={out} holds the checkpoint it exports ({checkpoint}): give another")
    # Any run's, whatever overwrite says: its tokenizer files would be replaced, and resuming
    # it would find an export where a run should be.
    run = run_dir_of(out)
    if run is not None:
        what = "a run's directory" if run == out else "a run's checkpoints/ folder"
        raise ValueError(
            f"out={out} is {what}, whose files an export would replace: give a new directory, "
            f"e.g. out={run / 'export'}"
        )
    if out.is_dir() and any(out.iterdir()) and not overwrite and not holds_export(out):
        raise ValueError(
            f"out={out} is not empty and holds no earlier export: give a new directory, or add "
            "overwrite=true to write the export's files into it (files of other names stay)"
        )
    # Where the export is first written (see staging_dir), and where its files are moved.
    unwritable = "give out= a directory on a disk you can write to"
    check_writable(out / EXPORT_CONFIG if out.is_dir() else out, f"out={out}", unwritable)


def staging_dir(out: Path, pid: int | str | None = None) -> Path:
    """Where the export is written before it is moved to `out`: on the disk of `out`'s files,
    so that each move is a rename. Beside a new `out`; inside an existing one, which may be
    the mount point of another disk than its parent's. `pid`: the export's process (this one
    by default; "*" for a glob of any)."""
    pid = os.getpid() if pid is None else pid
    if out.is_dir():
        return out / f".export.{pid}.tmp"
    return out.with_name(f".{glob.escape(out.name) if pid == '*' else out.name}.{pid}.tmp")


def remove_killed_staging(out: Path) -> None:
    """Remove the staging directories of `out` that exports killed before their end left: inside
    an existing `out`, one would make an empty `out` look not empty (and be refused) and stay
    in an export. A running export's (its process still there) is left to it."""
    pattern = staging_dir(out, "*")
    for path in pattern.parent.glob(pattern.name):
        pid = path.name.split(".")[-2]
        if pid.isdigit() and not process_runs(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def process_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # no signal: only whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    return True


def publish(staging: Path, out: Path) -> None:
    """Move the export written in `staging` to `out`. A new `out` becomes it in one rename. An
    existing one, empty too, is written into, never replaced (it may be a shell's working
    directory or a mount point): its files are replaced by those of the same names, an earlier
    export's other files (and evaluate.py's scores of it) are removed and any other file stays;
    config.json, which makes a
    directory an export, goes first and comes back last, so that `out` is never a half-written
    export."""
    if not out.exists():
        staging.rename(out)
        return
    stale = set()
    if holds_export(out):
        stale = EXPORT_FILES - {path.name for path in staging.iterdir()}
        # evaluate.py's scores of the earlier weights (eval_<data>.json), which no longer hold
        stale |= {path.name for path in out.glob("eval_*.json")}
    (out / EXPORT_CONFIG).unlink(missing_ok=True)
    for name in stale:
        (out / name).unlink(missing_ok=True)
    for path in sorted(staging.iterdir(), key=lambda path: path.name == EXPORT_CONFIG):
        os.replace(path, out / path.name)


def share_like_other_files(folder: Path) -> None:
    """safetensors writes its files for their owner only (0600): give every file of `folder`
    the permissions the user's umask gives a new file, as torch.save's checkpoints have."""
    umask = os.umask(0)
    os.umask(umask)
    for path in folder.iterdir():
        path.chmod(0o666 & ~umask)


def write_safetensors(model: GPT | EncoderDecoder, record: dict, folder: Path) -> None:
    # save_model stores a tied tensor (the embedding and the output head) once.
    save_model(model, str(folder / EXPORT_WEIGHTS))
    (folder / EXPORT_CONFIG).write_text(json.dumps({"tinyformer": record}, indent=2) + "\n")


def write_hf(
    model: GPT, tokenizer: CharTokenizer | BPETokenizer, record: dict, folder: Path
) -> None:
    """GPT2LMHeadModel's files, with our record in its config.json, and transformers' tokenizer
    files beside the tokenizer.json in `folder`; written only once GPT-2's logits are ours."""
    import transformers  # the hf extra, found by ExportOptions: only format=hf needs it

    transformers.logging.disable_progress_bar()
    vocab_size = tokenizer.vocab_size
    specials = {name: getattr(tokenizer, f"{name}_id") for name in ("bos", "eos", "pad", "unk")}
    config = transformers.GPT2Config(
        **gpt2_config(model, vocab_size),
        **{f"{name}_token_id": i for name, i in specials.items() if name != "unk"},
        tinyformer=record,
    )
    gpt2 = transformers.GPT2LMHeadModel(config).eval()
    gpt2.load_state_dict(to_gpt2(model, vocab_size))
    check_same_logits(model, gpt2, vocab_size)
    gpt2.save_pretrained(folder)
    transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"),
        model_max_length=model.config.block_size,
        **{f"{name}_token": tokenizer.specials[i] for name, i in specials.items() if i is not None},
    ).save_pretrained(folder)


@torch.no_grad()
def check_same_logits(model: GPT, gpt2: torch.nn.Module, vocab_size: int) -> None:
    """Refuse an export whose GPT-2 computes other logits than `model`, on random full blocks."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(vocab_size, (2, model.config.block_size), generator=generator)
    gap = (model(ids)[0][..., :vocab_size] - gpt2(ids).logits).abs().max().item()
    if gap > LOGITS_TOLERANCE:
        raise RuntimeError(
            f"transformers' GPT-2 computes other logits than this model (by up to {gap:.2g}): "
            "nothing was written; this is a bug in export.py's weight mapping"
        )


def export(options: ExportOptions) -> Path:
    """Write the export of options.ckpt to options.out; return the checkpoint exported."""
    checkpoint = find_checkpoint(options.ckpt, "best", "ckpt")
    out = Path(options.out).expanduser().resolve()  # out=. has no name to put a sibling by
    remove_killed_staging(out)
    check_out(out, checkpoint, options.overwrite)
    model, hparams = load_checkpoint(checkpoint)
    tokenizer = tokenizer_from_dict(hparams["tokenizer"])
    config = model.config
    if options.format == "hf":
        obstacle = gpt2_obstacle(model)
        if obstacle is not None:
            raise ValueError(
                f"format=hf {obstacle}; export format=safetensors (the default) instead"
            )
        # GPT-2 gets the tokenizer's rows only: padding rows are never sampled, and a key/value
        # head for every query head (see to_gpt2): the model this export holds.
        mha = replace(config.attention, n_kv_head=None)
        config = replace(config, vocab_size=tokenizer.vocab_size, attention=mha)
    record = {
        "format": options.format,
        "kind": hparams.get("kind", "gpt"),
        "model": config.to_dict(),
        "tokenizer": hparams["tokenizer"],
        "run_config": hparams.get("run_config"),
        "exported_from": str(checkpoint.resolve()),
    }
    # Removed whatever happens: a failed export leaves `out` as it was.
    staging = staging_dir(out)
    shutil.rmtree(staging, ignore_errors=True)  # left by a killed export of the same pid
    staging.mkdir(parents=True)
    try:
        tokenizer.save(staging / "tokenizer.json")
        if options.format == "hf":
            write_hf(model, tokenizer, record, staging)
        else:
            write_safetensors(model, record, staging)
        share_like_other_files(staging)
        publish(staging, out)
    except Exception as error:
        if disk_full_cause(error) is None:  # safetensors' error holds the errno in its text
            raise
        raise ValueError(
            f"no space left on the disk of {staging.parent} to write the export (nothing was "
            f"written to {out}): free some space, or give out= on another disk"
        ) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return checkpoint


def size(path: Path) -> int:
    """Bytes of a file, or of every file under a directory."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def readable_size(count: int) -> str:
    if count < 1e3:
        return f"{count} B"
    return f"{count / 1e6:.2f} MB" if count >= 1e6 else f"{count / 1e3:.1f} kB"


def run(cfg: DictConfig) -> None:
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ValueError(
            f"give {' and '.join(f'{key}=' for key in missing)}: python export.py "
            "ckpt=<run dir, .ckpt or export> out=<new directory>"
        )
    options = config_from(ExportOptions, OmegaConf.to_container(cfg, resolve=True), "", "export.py")
    checkpoint = export(options)
    out = Path(options.out).expanduser().resolve()  # out=. has no name to put a sibling by
    sizes = f"{readable_size(size(checkpoint))} -> {readable_size(size(out))}"
    print(f"exported {checkpoint} to {out}/ ({sizes}):")
    for name in sorted(EXPORT_FILES):
        if (out / name).is_file():
            print(f"  {name:<26} {readable_size(size(out / name))}")
    print(f"sample from it: python generate.py ckpt={out}")
    if options.format == "hf":
        print(f"or in Python: transformers.AutoModelForCausalLM.from_pretrained('{out}')")
    sys.stdout.flush()  # here, where a reader gone is caught, rather than at exit, where it is not


@hydra.main(version_base="1.3", config_path="configs", config_name="export")
def main(cfg: DictConfig) -> None:
    run_command(lambda: run(cfg))


if __name__ == "__main__":
    main()
