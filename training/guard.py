"""What a non-finite step does (on_nonfinite: stop or skip), and the guard that keeps
non-finite updates out of the weights without making the host wait for the device.

Each step, the fused AdamW is handed a `found_inf` flag, as AMP's gradient scaler does: when the
loss or the gradient norm is not finite, the optimizer kernel itself leaves the weights, its
moments and its step count as they were. The host reads the flag one step later (or before a
checkpoint is written), by which time a GPU has long finished computing it, so training never
stalls on a per-step synchronisation. MuonWithAdamW hands the flag to both of its optimizers;
Muon (optimizers.py) applies it with a device-side select (on the CPU, where reading the flag
costs no wait, it skips the step instead).
"""

import math
from dataclasses import dataclass

import torch
from torch import Tensor

# What a step with a non-finite loss or gradient norm does (train.py's on_nonfinite).
NONFINITE_ACTIONS = ("stop", "skip")


def check_nonfinite_action(action: object) -> None:
    if action not in NONFINITE_ACTIONS:
        raise ValueError(f"on_nonfinite={action!r} is not one of {', '.join(NONFINITE_ACTIONS)}")


class TrainingDiverged(RuntimeError):
    """A non-finite loss or gradient norm stopped training (on_nonfinite=stop)."""


def all_steps_skipped(skipped: int, steps: int) -> TrainingDiverged | None:
    """A run whose every update was skipped (on_nonfinite=skip) learned nothing: it diverged."""
    if not skipped >= steps > 0:
        return None
    return TrainingDiverged(
        f"every one of the {steps} steps had a non-finite loss or gradient norm and was "
        "skipped (on_nonfinite=skip): the model learned nothing. Lower optim.lr, or look for "
        "bad values in the data"
    )


@dataclass
class NonfiniteStep:
    step: int  # 1-based: the update that was skipped
    norm: float
    loss: float


@dataclass
class _Flagged:
    step: int
    values: Tensor  # (gradient norm, loss), on the host once `ready` has happened
    ready: torch.cuda.Event | None  # None: the values are already on the host


class UpdateGuard:
    """Flags each step's update for the optimizer, and reports the skipped ones later."""

    def __init__(self) -> None:
        self._flagged: list[_Flagged] = []

    def flag(self, optimizer: torch.optim.Optimizer, step: int, norm: Tensor, loss: Tensor) -> None:
        """Make `optimizer`'s next step a no-op if `norm` or `loss` is not finite. The optimizer
        must read `found_inf`: a fused torch optimizer, or MuonWithAdamW (optimizers.py)."""
        values = torch.stack([norm.detach().float(), loss.detach().float()])
        optimizer.found_inf = (~torch.isfinite(values).all()).float()
        ready = None
        if values.is_cuda:
            host = torch.empty(2, pin_memory=True)
            host.copy_(values, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            values = host
        self._flagged.append(_Flagged(step, values, ready))

    def skipped(self) -> list[NonfiniteStep]:
        """The steps flagged so far whose update was skipped, in order; waits for the device
        where it has not reached them yet."""
        skipped = []
        for flagged in self._flagged:
            if flagged.ready is not None:
                flagged.ready.synchronize()
            norm, loss = flagged.values.tolist()
            if not (math.isfinite(norm) and math.isfinite(loss)):
                skipped.append(NonfiniteStep(flagged.step, norm, loss))
        self._flagged.clear()
        return skipped
