"""Checkpoint files that survive a crash at any moment, and load without running code
(model/checkpoint.py's load_safely)."""

import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from model.checkpoint import load_safely


def partial_path(path: Path) -> Path:
    """Where a checkpoint is written before it takes its name: hidden, and not a *.ckpt, so
    nothing that looks for checkpoints ever picks a half-written one."""
    return path.with_name(f".{path.name}.partial")


def save_durably(checkpoint: dict[str, Any], path: Path) -> None:
    """torch.save to a temporary file beside `path`, fsync it, rename it over `path` (atomic on
    POSIX), and fsync the folder so the rename itself survives a power cut. A process killed at
    any point leaves either the old file or the new one at `path`, never a mix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = partial_path(path)
    with open(temporary, "wb") as f:
        torch.save(checkpoint, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


class DurableCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint IO with save_durably for local files (Lightning's own atomic save
    renames without an fsync) and load_safely for every load, resuming included."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None
    ) -> None:
        if storage_options is not None or "://" in str(path):
            super().save_checkpoint(checkpoint, path, storage_options)  # remote storage
            return
        save_durably(checkpoint, Path(path))

    def load_checkpoint(
        self, path: str | os.PathLike, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if "://" in str(path):
            return super().load_checkpoint(path, weights_only=True)
        return load_safely(path, map_location or "cpu")
