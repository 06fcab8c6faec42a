"""A callback that records which examples each process trained on, so a data-parallel run can be
checked for what it promises: every rank sees a different shard of the data at every step."""

import hashlib
import json
from pathlib import Path

import lightning as L
import torch

from errors import check_int


def example_fingerprint(row: torch.Tensor) -> str:
    """A short hash of one example's token ids: equal examples, equal fingerprints."""
    return hashlib.sha1(row.cpu().numpy().tobytes()).hexdigest()[:16]


class BatchLog(L.Callback):
    """Append one JSON line per training step of the first `max_steps` to
    `out_dir/rank<R>.jsonl`: the step, the rank and a fingerprint of each example's input."""

    def __init__(self, out_dir: str, max_steps: int = 100):
        check_int("callbacks.batch_log.max_steps", max_steps)
        self.out_dir = Path(out_dir)
        self.max_steps = max_steps

    def on_train_batch_start(self, trainer: L.Trainer, pl_module, batch, batch_idx: int) -> None:
        if trainer.global_step >= self.max_steps:
            return
        inputs = batch[0] if isinstance(batch, list | tuple) else batch["source"]
        record = {
            "step": trainer.global_step,
            "rank": trainer.global_rank,
            "examples": [example_fingerprint(row) for row in inputs],
        }
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with open(self.out_dir / f"rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
