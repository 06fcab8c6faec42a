"""The optimizers `optim.name` chooses: AdamW for every parameter, or Muon for the hidden weight
matrices with AdamW for the rest (embeddings, norms, biases), as one torch Optimizer.

Lightning's automatic optimization drives one optimizer per module, and an LR scheduler drives
one optimizer's param_groups; MuonWithAdamW is both of torch's optimizers behind one such object:
its param_groups are theirs (the scheduler's changes reach them), its state is theirs (one
checkpoint entry holds both), and step() steps both.
"""

import torch
from torch.optim import AdamW, Optimizer

from model.attention import JOINED_PROJECTIONS

OPTIMIZERS = ("adamw", "muon")


class MuonWithAdamW(Optimizer):
    """torch.optim.Muon on `matrices` (2-D weights), torch.optim.AdamW (fused) on `others`; each
    a list of param_group dicts."""

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
        self.muon = torch.optim.Muon(matrices, lr=muon_lr, adjust_lr_fn="match_rms_adamw")
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
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # The update guard's flag (training/guard.py): fused AdamW reads it in its kernel, Muon
        # cannot, so a flagged step skips Muon here, at the price of one host sync a step.
        found_inf = self.adamw.found_inf = getattr(self, "found_inf", None)
        if found_inf is None or not found_inf.item():
            self.muon.step()
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
