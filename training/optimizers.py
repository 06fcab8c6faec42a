"""The optimizers `optim.name` chooses: AdamW for every parameter, or Muon for the hidden weight
matrices with AdamW for the rest (embeddings, norms, biases), as one torch Optimizer.

Lightning's automatic optimization drives one optimizer per module, and an LR scheduler drives
one optimizer's param_groups; MuonWithAdamW is both optimizers behind one such object:
its param_groups are theirs (the scheduler's changes reach them), its state is theirs (one
checkpoint entry holds both), and step() steps both.
"""

import math

import torch
from torch import Tensor
from torch.optim import AdamW, Optimizer

from model.attention import JOINED_PROJECTIONS
from training.precision import multiplies_bf16

OPTIMIZERS = ("adamw", "muon")


def closure_loss(closure) -> Tensor | None:
    """What an optimizer's optional closure returns, run with gradients on (inside a step,
    they are off)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def orthogonalized(
    update: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float, dtype
) -> Tensor:
    """Muon's quintic Newton-Schulz iteration in `dtype`: `update`, a stack of matrices of one
    shape, with the singular values of each moved towards 1 (to about 0.5-1.5, which trains as
    well as exactly 1), computed on the wide side of the matrices."""
    a, b, c = coefficients
    tall = update.size(-2) > update.size(-1)
    x = update.to(dtype, copy=True)  # a copy: div_ must not scale the caller's update
    if tall:
        x = x.mT
    x.div_(x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps))  # spectral norm <= 1: converges
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def rms_factor(adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch.optim.Muon's learning-rate scale for a (rows, columns) matrix."""
    rows, columns = shape[:2]
    if adjust_lr_fn == "match_rms_adamw":  # the RMS of an AdamW update
        return 0.2 * math.sqrt(max(rows, columns))
    if adjust_lr_fn in (None, "original"):
        return math.sqrt(max(1, rows / columns))
    return 1.0


class Muon(Optimizer):
    """Muon with torch.optim.Muon's options, state and update (its arithmetic, in bf16: tested
    against it up to the rounding of bf16 products), orthogonalising in `ns_dtype`. torch's
    always runs Newton-Schulz in bf16, which a CPU without bf16 units emulates: on an AVX2 EPYC
    that is 0.88 s a step for the default model's matrices against 0.03 s in fp32
    (bench/muon_step.py). ns_dtype None: bf16 on devices that multiply in it, else fp32. It
    does not need torch.optim.Muon (new in torch 2.9)."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315),
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        ns_dtype: torch.dtype | None = None,
    ) -> None:
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps,
                        adjust_lr_fn=adjust_lr_fn)  # fmt: skip
        super().__init__(params, defaults)
        if any(p.ndim != 2 for group in self.param_groups for p in group["params"]):
            raise ValueError("Muon takes 2-D weight matrices only")
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None, found_inf: Tensor | None = None):
        """One update; found_inf (a 0-d tensor on the parameters' device, 1.0 or 0.0) skips it:
        a flagged step leaves the weights and momentum as they were, decided on the device, so
        that the host never waits to read the flag."""
        loss = closure_loss(closure)
        skip = None if found_inf is None else found_inf.bool()
        for group in self.param_groups:
            for params in stackable(p for p in group["params"] if p.grad is not None):
                self._step_stack(group, params, skip)
        return loss

    def _step_stack(self, group: dict, params: list[Tensor], skip: Tensor | None) -> None:
        """Step matrices of one shape as one stack: some thirty kernels for all of them, where
        one matrix at a time takes about as many for each, and on a GPU those launches set the
        pace of a small model's step. The new values are computed beside stacked copies of the
        old, which a flagged step copies back instead."""
        lr, momentum = group["lr"], group["momentum"]
        buffers = []
        for param in params:
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(param.grad)
            buffers.append(state["momentum_buffer"])
        grads = torch.stack([param.grad for param in params])
        old_buffers = torch.stack(buffers)
        averaged = old_buffers.lerp(grads, 1 - momentum)
        update = grads.lerp_(averaged, momentum) if group["nesterov"] else averaged
        dtype = self.ns_dtype or (
            torch.bfloat16 if multiplies_bf16(params[0].device.type) else torch.float32
        )
        orthogonal = orthogonalized(
            update, group["ns_coefficients"], group["ns_steps"], group["eps"], dtype
        )
        weights = torch.stack(params)
        stepped = weights.mul(1 - lr * group["weight_decay"])
        stepped.add_(orthogonal, alpha=-lr * rms_factor(group["adjust_lr_fn"], params[0].shape))
        if skip is not None:  # a flagged step keeps the old values (and any NaN out)
            averaged = torch.where(skip, old_buffers, averaged)
            stepped = torch.where(skip, weights, stepped)
        torch._foreach_copy_(buffers, averaged.unbind())
        torch._foreach_copy_(params, stepped.unbind())


def stackable(params) -> list[list[Tensor]]:
    """`params` in lists that stack (one shape, dtype and device each), in order of appearance."""
    stacks: dict[tuple, list[Tensor]] = {}
    for param in params:
        stacks.setdefault((param.shape, param.dtype, param.device), []).append(param)
    return list(stacks.values())


class MuonWithAdamW(Optimizer):
    """Muon (this file's: torch.optim.Muon's update, orthogonalising in bf16 only where it is
    native) on `matrices` (2-D weights), torch.optim.AdamW (fused) on `others`; each a list of
    param_group dicts."""

    def __init__(
        self,
        matrices: list[dict],
        others: list[dict],
        *,
        muon_lr: float,
        lr: float,
        betas: tuple[float, float],
    ):
        # "match_rms_adamw": Muon's update is scaled to the RMS of AdamW's, so that muon_lr is
        # on AdamW's scale. Its weight decay is decoupled, muon_lr * weight_decay a step, so
        # the matrices decay muon_lr / lr times as fast as under AdamW. A joined qkv_proj is
        # one matrix to Muon, orthogonalised as a whole.
        self.muon = Muon(matrices, lr=muon_lr, adjust_lr_fn="match_rms_adamw")
        self.adamw = AdamW(others, lr=lr, betas=betas, fused=True)
        super().__init__([*self.muon.param_groups, *self.adamw.param_groups], {})
        self._share_groups_and_state()

    def _share_groups_and_state(self) -> None:
        n_muon = len(self.muon.param_groups)
        self.muon.param_groups, self.adamw.param_groups = (
            self.param_groups[:n_muon],
            self.param_groups[n_muon:],
        )
        self.muon.state = self.adamw.state = self.state  # keyed by parameter: no overlap

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        # The update guard's flag (training/guard.py): fused AdamW reads it in its kernel, Muon
        # on the device too, except on the CPU, where reading it costs no wait and skipping the
        # step is cheaper than selecting each tensor.
        found_inf = self.adamw.found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and found_inf.device.type == "cpu":
            if not found_inf.item():
                self.muon.step()
        else:
            self.muon.step(found_inf=found_inf)
        self.adamw.step()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # new group dicts and state: share them again
        self._share_groups_and_state()


def build_optimizer(
    name: str,
    groups: list[dict],
    *,
    lr: float,
    betas: tuple[float, float],
    muon_lr: float,
) -> Optimizer:
    """`groups` are a model's [weight-decayed, not decayed] param groups (optimizer_groups in
    model/blocks.py): the decayed ones are its hidden layers' weight matrices, which Muon takes
    with optim.name=muon. Fused AdamW: one kernel for all parameters, 3.5x faster steps than
    the default on CPU."""
    if name == "adamw":
        return AdamW(groups, lr=lr, betas=betas, fused=True)
    decayed, kept = groups
    return MuonWithAdamW([decayed], [kept], muon_lr=muon_lr, lr=lr, betas=betas)


def peak_rates(optimizer: Optimizer, lr: float, muon_lr: float) -> list[float]:
    """The rate each param group of a build_optimizer optimizer peaks at: Muon's muon_lr,
    AdamW's lr."""
    if isinstance(optimizer, MuonWithAdamW):
        muon, adamw = len(optimizer.muon.param_groups), len(optimizer.adamw.param_groups)
        return [muon_lr] * muon + [lr] * adamw
    return [lr] * len(optimizer.param_groups)


def saved_parts(name: str, saved: set[str]) -> list[str]:
    """The parameters of a checkpoint (`saved`: its parameter names) that parameter `name` of
    the model joins: [name], unless the checkpoint holds its parts apart."""
    module, _, kind = name.rpartition(".")
    prefix, _, projection = module.rpartition(".")
    parts = [f"{prefix}.{part}.{kind}" for part in JOINED_PROJECTIONS.get(projection, ())]
    return parts if parts and all(part in saved for part in parts) else [name]


def join_saved_state(state: dict, groups: list[list[str]], saved: set[str]) -> dict:
    """An optimizer's state_dict from a checkpoint whose model held q_proj, k_proj and v_proj
    apart (`saved`: its parameter names), for param groups that hold the parameters named in
    `groups` now: each joined parameter's state (AdamW's moments, Muon's momentum) is its parts'
    end to end, as its weight is. A state that does not fit that layout comes back as it is,
    for the optimizer's own check to refuse."""
    parts = [[saved_parts(name, saved) for name in names] for names in groups]
    sizes = [sum(map(len, group)) for group in parts]
    saved_sizes = [len(group["params"]) for group in state["param_groups"]]
    if sizes == [len(names) for names in groups] or sizes != saved_sizes:
        return state  # nothing joined, or another layout
    joined, param_groups, index = {}, [], 0
    for group, group_parts in zip(state["param_groups"], parts, strict=True):
        saved_ids = iter(group["params"])
        param_groups.append({**group, "params": list(range(index, index + len(group_parts)))})
        for names in group_parts:
            entries = [state["state"].get(next(saved_ids)) for _ in names]
            if any(entry is not None for entry in entries):
                if any(entry is None for entry in entries):
                    return state
                joined[index] = {
                    key: torch.cat([entry[key] for entry in entries])
                    if isinstance(value, torch.Tensor) and value.dim() > 0
                    else value
                    for key, value in entries[0].items()
                }
            index += 1
    return {"state": joined, "param_groups": param_groups}
