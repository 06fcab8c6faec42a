"""What the tests share: the project root, tiny models, and running the project's commands as a
user would, in an environment that is the same on every machine."""

import json
import os
import signal
import struct
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# The tests import the project's modules (model, errors, train, report...) by plain name; so do
# the lines below. conftest.py imports this file first.
sys.path.insert(0, str(ROOT))

from model.attention import AttentionConfig  # noqa: E402
from model.checkpoint import build_model  # noqa: E402
from model.encdec import EncDecConfig, EncoderDecoder  # noqa: E402
from model.gpt import GPT, GPTConfig  # noqa: E402

# A GPT that trains in seconds: the end-to-end tests' default run.
TINY = [
    "model.n_layer=2",
    "model.n_embd=64",
    "model.block_size=64",
    "model.attention.n_head=4",
    "data.batch_size=16",
    "trainer.max_steps=80",
    "trainer.val_check_interval=20",
    "trainer.limit_val_batches=4",
    "trainer.num_sanity_val_steps=0",
    "optim.warmup_steps=10",
    "callbacks.attention_maps.every_n_steps=40",
    "callbacks.attention_maps.sample_length=24",
    "sample.max_new_tokens=40",
]

# The smallest GPT the tests train: one layer, a 32-token block; each run adds its own steps,
# validations, attention heads, logger and faults.
SMALLEST_BASE = [
    "model.n_layer=1",
    "model.n_embd=32",
    "model.block_size=32",
    "data.batch_size=8",
    "trainer.limit_val_batches=2",
    "trainer.num_sanity_val_steps=0",
    "callbacks.attention_maps.sample_length=16",
    "sample.max_new_tokens=10",
]
# The fault tests' smallest run: two heads and csv logging.
SMALLEST = [*SMALLEST_BASE, "model.attention.n_head=2", "logger=csv"]

# The special token ids of the tests' encoder-decoders; ids from FIRST_WORD up are words.
PAD, BOS, EOS = 0, 1, 2
FIRST_WORD = 3

# Variables of the caller's shell that change what a run does: a cluster's or launcher's ranks
# and ports (Lightning would join a process group), W&B's mode and service, a full traceback
# instead of one line, Hugging Face's offline mode, endpoint and token, and progress bars turned
# off (Hugging Face's, tqdm's), which the tests of the output look for. A CI may set any of them.
FOREIGN = (
    *("WANDB_", "HYDRA_", "SLURM_", "TORCHELASTIC_", "PL_", "LOCAL_RANK", "NODE_RANK"),
    *("HF_", "TQDM_"),
)
FOREIGN_EXACT = {"RANK", "WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"}
# The libraries' caches and settings, which conftest.py points at a private folder per test
# process (and which the commands the tests start inherit): folder names inside it.
CACHE_VARIABLES = {
    "HF_HOME": "hf",
    "HF_DATASETS_CACHE": "hf/datasets",
    "WANDB_CONFIG_DIR": "wandb/config",
    "WANDB_CACHE_DIR": "wandb/cache",
    "WANDB_DATA_DIR": "wandb/data",
    "MPLCONFIGDIR": "matplotlib",
}


def tiny_gpt_config(
    vocab_size: int,
    position: str = "learned",
    *,
    n_head: int = 4,
    n_kv_head: int | None = None,
    window: int | None = None,
    **overrides,
) -> GPTConfig:
    """tiny_gpt's config: 2 layers, width 32, a 16-token block and the attention knobs given;
    `overrides` are other GPTConfig fields (block_size, n_layer, bias, even a whole attention)."""
    values = {
        "block_size": 16,
        "n_layer": 2,
        "n_embd": 32,
        "position": position,
        "attention": AttentionConfig(n_head=n_head, n_kv_head=n_kv_head, window=window),
        **overrides,
    }
    return GPTConfig(vocab_size=vocab_size, **values)


def tiny_gpt(vocab_size: int, position: str = "learned", **options) -> GPT:
    """An untrained GPT small enough for any unit test, in eval mode; `options` are
    tiny_gpt_config's. Its weights come from torch's global generator: the same seed, the same
    model."""
    return GPT(tiny_gpt_config(vocab_size, position, **options)).eval()


def tiny_encdec(
    vocab_size: int,
    position: str = "learned",
    *,
    n_head: int = 4,
    n_kv_head: int | None = None,
    window: int | None = None,
    **overrides,
) -> EncoderDecoder:
    """An untrained encoder-decoder small enough for any unit test, in eval mode: 2 encoder and
    2 decoder layers, width 32, sources and targets of up to 16 tokens and the attention knobs
    given; `overrides` are other EncDecConfig fields (cross_position, max_target_len...)."""
    values = {
        "n_embd": 32,
        "n_encoder_layer": 2,
        "n_decoder_layer": 2,
        "max_source_len": 16,
        "max_target_len": 16,
        "position": position,
        "attention": AttentionConfig(n_head=n_head, n_kv_head=n_kv_head, window=window),
        **overrides,
    }
    return EncoderDecoder(EncDecConfig(vocab_size=vocab_size, **values)).eval()


def save_checkpoint(model: GPT | EncoderDecoder, tokenizer, path: Path) -> Path:
    """`model` and `tokenizer` saved at `path` in train.py's checkpoint layout (hyper-parameters
    and the LightningModule's state dict), for the commands that read one; returns `path`."""
    hparams = {
        "kind": "encdec" if isinstance(model, EncoderDecoder) else "gpt",
        "model": model.config.to_dict(),
        "tokenizer": tokenizer.to_dict(),
        "run_config": {"seed": 0},
    }
    state = {f"model.{key}": value for key, value in model.state_dict().items()}
    torch.save({"hyper_parameters": hparams, "state_dict": state}, path)
    return path


@torch.no_grad()
def sharpened(model: torch.nn.Module, factor: float = 4.0) -> torch.nn.Module:
    """`model` with every weight matrix scaled by `factor`, in place: peakier attention and
    outputs than the small init gives, so that dependences show clearly and greedy decoding
    picks EOS now and then."""
    for param in model.parameters():
        if param.dim() == 2:
            param.mul_(factor)
    return model


def group_names(model: torch.nn.Module) -> list[list[str]]:
    """The names of the parameters in each of model's optimizer param groups, in order."""
    names = {id(param): name for name, param in model.named_parameters()}
    return [[names[id(p)] for p in group["params"]] for group in model.optimizer_groups(0.1)]


def projections_it_joins(name: str, modules: dict) -> tuple[list[str], list[int]] | None:
    """For a parameter of a joined projection (qkv_proj, or cross-attention's kv_proj), the
    names of the parameters it replaced and their widths; None for any other. `modules`: the
    model's named_modules(); a "model." prefix (a checkpoint's) is kept in the names."""
    module, _, kind = name.rpartition(".")
    prefix, _, projection = module.rpartition(".")
    if projection not in ("qkv_proj", "kv_proj"):
        return None
    letters = "qkv" if projection == "qkv_proj" else "kv"
    widths = modules[prefix.removeprefix("model.")].widths[-len(letters) :]  # (q, k, v) widths
    return [f"{prefix}.{letter}_proj.{kind}" for letter in letters], list(widths)


def as_saved_before_the_join(model: torch.nn.Module, state: dict) -> tuple[dict, set[str]]:
    """An optimizer state_dict of `model` as a checkpoint from before attention's projections
    were joined holds it (q_proj, k_proj, v_proj apart, in that order, each with its own
    state), and that checkpoint's parameter names."""
    modules = dict(model.named_modules())
    saved, split, param_groups = set(), {}, []
    for group, names in zip(state["param_groups"], group_names(model), strict=True):
        start = len(split)
        for old_id, name in zip(group["params"], names, strict=True):
            entry = state["state"][old_id]
            joined = projections_it_joins(name, modules)
            if joined is None:
                saved.add(name)
                split[len(split)] = entry
                continue
            parts, widths = joined
            pieces = {
                key: value.split(widths) if value.dim() else [value] * len(widths)
                for key, value in entry.items()
            }
            for i, part in enumerate(parts):
                saved.add(part)
                split[len(split)] = {key: value[i].clone() for key, value in pieces.items()}
        param_groups.append({**group, "params": list(range(start, len(split)))})
    return {"state": split, "param_groups": param_groups}, saved


def checkpoint_before_the_join(checkpoint: dict) -> dict:
    """A Lightning checkpoint of this version as one from before attention's q, k and v
    projections were joined: its weights and its optimizer state held apart."""
    hparams = checkpoint["hyper_parameters"]
    model = build_model(hparams["kind"], hparams["model"])
    modules = dict(model.named_modules())
    weights = {}
    for key, value in checkpoint["state_dict"].items():
        joined = projections_it_joins(key, modules)
        if joined is None:
            weights[key] = value
            continue
        parts, widths = joined
        for part, piece in zip(parts, value.split(widths), strict=True):
            weights[part] = piece.clone()
    states = [as_saved_before_the_join(model, state)[0] for state in checkpoint["optimizer_states"]]
    return {**checkpoint, "state_dict": weights, "optimizer_states": states}


def is_foreign(variable: str) -> bool:
    """Whether the caller's `variable` is one no test may inherit (FOREIGN), the caches that
    conftest.py points at its own folder excepted."""
    foreign = variable.startswith(FOREIGN) or variable in FOREIGN_EXACT
    return foreign and variable not in CACHE_VARIABLES


def clean_env(cache_dir: Path, **extra: str) -> dict[str, str]:
    """os.environ less what FOREIGN names, with the prepared-data cache at `cache_dir`, one
    thread per process (the suite's processes run side by side, and one thread computes the
    same floats everywhere) and W&B offline and quiet."""
    env = {key: value for key, value in os.environ.items() if not is_foreign(key)}
    return {
        **env,
        "TINYFORMER_CACHE": str(cache_dir),
        "OMP_NUM_THREADS": "1",
        "WANDB_SILENT": "true",
        **extra,
    }


def stopped_status(signum: int) -> int:
    """A command's returncode once `signum` stopped it: Ctrl-C ends it by SIGINT itself, so
    that a shell loop running it stops too (errors.end_as_interrupted); SIGTERM, with status
    143, the job's own, for a scheduler to record."""
    return -signal.SIGINT if signum == signal.SIGINT else 128 + signum


def default_signals() -> None:
    """For a child process (preexec_fn): Ctrl-C and SIGTERM do what they do in a shell, and the
    command runs in a process group of its own, as a shell's job does. A test process may have
    come to ignore SIGINT (a library, a test worker), and a child inherits an ignored signal,
    so without this a command could not be interrupted in some orders."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.setpgrp()


def run_script(
    script: str,
    *arguments: str,
    cache_dir: Path,
    env: dict | None = None,
    stdin: str = "",
    timeout: float = 600,
    cwd: Path = ROOT,
) -> subprocess.CompletedProcess:
    """Run one of the project's commands (train.py, generate.py, export.py, report.py) from
    `cwd` (the root by default), with `stdin` piped in (nothing by default: a command never
    waits for a terminal); one that runs past `timeout` seconds fails the test
    (subprocess.TimeoutExpired)."""
    return subprocess.run(
        [sys.executable, str(ROOT / script), *arguments],
        cwd=cwd,
        env=clean_env(cache_dir, **(env or {})),
        preexec_fn=default_signals,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_unread(
    script: str, *arguments: str, cache_dir: Path, buffered: bool
) -> subprocess.CompletedProcess:
    """run_script's command with a stdout whose reader has gone before the first line (`| head`
    at its quickest): block-buffered as Python buffers a pipe, or written line by line as
    PYTHONUNBUFFERED=1 has it (set in many containers). Its stdout is None."""
    env = clean_env(cache_dir)
    env.pop("PYTHONUNBUFFERED", None)
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            [sys.executable, str(ROOT / script), *arguments],
            cwd=ROOT,
            env=env,
            preexec_fn=default_signals,
            stdin=subprocess.DEVNULL,
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=600,
        )
    finally:
        os.close(write)


def train_run(run_dir: Path, *overrides: str, cache_dir: Path, env: dict | None = None) -> Path:
    """Run train.py into `run_dir` (with `env` added to its environment), fail the test with its
    stderr if it fails, keep its output as run_dir/stdout.txt and stderr.txt, and return
    run_dir."""
    result = run_script(
        "train.py", *overrides, f"hydra.run.dir={run_dir}", cache_dir=cache_dir, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir / "stderr.txt").write_text(result.stderr)
    (run_dir / "stdout.txt").write_text(result.stdout)  # last: the run is complete
    return run_dir


def composed(*overrides: str):
    """configs/train.yaml as Hydra composes it under `overrides`, with its hydra node (the
    resolvers of train.py must be registered to resolve some of its values)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose("train", overrides=list(overrides), return_hydra_config=True)


def val_losses(run_dir: Path) -> list[float]:
    """The validation losses of a run's history (summary.json), in order."""
    history = json.loads((run_dir / "summary.json").read_text())["history"]
    return [row["val/loss"] for row in history if "val/loss" in row]


@contextmanager
def small_disk(folder: Path, size: str) -> Iterator[Path]:
    """A real file system of `size` (tmpfs, e.g. "128k") mounted at `folder` while the block
    runs, so that writes fail with a true ENOSPC; the test is skipped where mounting needs a
    root this process is not."""
    folder.mkdir(parents=True, exist_ok=True)
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)]
    if subprocess.run(mount, capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "--lazy", str(folder)], check=True)


@contextmanager
def read_only(folder: Path) -> Iterator[Path]:
    """`folder`, as it is, mounted read-only over itself while the block runs, so that writes
    there fail with EROFS as on a read-only disk, whoever runs the test (file permissions stop
    no root); the test is skipped where mounting needs a root this process is not."""
    bind = ["mount", "--bind", str(folder), str(folder)]
    if subprocess.run(bind, capture_output=True).returncode != 0:
        pytest.skip("cannot bind-mount a folder read-only here (needs root)")
    try:
        remount = ["mount", "-o", "remount,bind,ro", str(folder)]
        subprocess.run(remount, capture_output=True, check=True)
        yield folder
    finally:
        subprocess.run(["umount", "--lazy", str(folder)], check=True)


def fault(name: str, **options) -> list[str]:
    """The overrides that add faults.py's `name` to a run, e.g. fault("SignalAt", step=20,
    signum=9): it fires in the run started afresh, not in the resumed one."""
    return [f"+callbacks.fault._target_=faults.{name}"] + [
        f"+callbacks.fault.{key}={value}" for key, value in options.items()
    ]


def run_training(
    cache_dir: Path, *overrides: str, timeout: float = 600, cwd: Path = ROOT
) -> subprocess.CompletedProcess:
    """train.py, launched in `cwd`, with tests/ on its path, so that overrides can add
    faults.py's callbacks."""
    env = {"PYTHONPATH": str(ROOT / "tests")}
    return run_script(
        "train.py", *overrides, cache_dir=cache_dir, env=env, timeout=timeout, cwd=cwd
    )


def write_hub_dataset(folder: Path, splits: dict[str, list[str]], column: str = "text") -> Path:
    """A dataset laid out as a Hub dataset repository, <folder>/data/<split>-00000-of-00001.parquet
    with one column, `column`: `datasets.load_dataset(<folder>)` (and so data=hub
    data.name=<folder>) finds its splits by the files' names, without the network. A second call
    adds splits, of another column if asked."""
    import datasets  # 0.6 s: only for the tests that write one

    (folder / "data").mkdir(parents=True, exist_ok=True)
    for split, rows in splits.items():
        path = folder / "data" / f"{split}-00000-of-00001.parquet"
        datasets.Dataset.from_dict({column: rows}).to_parquet(str(path))
    return folder


def damage_checkpoint(path: Path) -> None:
    """Overwrite bytes in the middle of the largest file of the checkpoint's zip archive (a
    tensor's data), as a failing disk or a bad copy would."""
    with zipfile.ZipFile(path) as archive:
        largest = max(archive.infolist(), key=lambda info: info.file_size)
    data = bytearray(path.read_bytes())
    # the local header: 30 bytes, then the name and the extra field, whose lengths end it
    name_length, extra_length = struct.unpack("<HH", data[largest.header_offset + 26 :][:4])
    start = largest.header_offset + 30 + name_length + extra_length
    middle = start + largest.file_size // 2
    data[middle : middle + 16] = bytes(255 - b for b in data[middle : middle + 16])
    path.write_bytes(bytes(data))
