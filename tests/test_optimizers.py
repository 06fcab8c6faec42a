"""training/optimizers.py: Muon for the hidden matrices and AdamW for the rest, as one optimizer
that Lightning, an LR scheduler and a checkpoint each see as one."""

import copy

import pytest
import torch
import torch.nn.functional as F

from helpers import as_saved_before_the_join, group_names, tiny_encdec, tiny_gpt
from training.module import OptimConfig
from training.optimizers import (
    Muon,
    MuonWithAdamW,
    build_optimizer,
    join_saved_state,
    orthogonalized,
)
from training.precision import multiplies_bf16

BETAS = (0.9, 0.99)
RATES = {"lr": 1e-3, "betas": BETAS, "muon_lr": 4e-3}


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    idx = torch.randint(11, (3, 8), generator=generator)
    return idx[:, :-1], idx[:, 1:]


def train_steps(model, optimizer, seeds, scheduler=None) -> None:
    model.train()
    for seed in seeds:
        x, y = batch(seed)
        F.cross_entropy(model(x)[0].flatten(0, 1), y.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()


def muon_gpt(seed: int = 0):
    torch.manual_seed(seed)
    model = tiny_gpt(11)
    optimizer = build_optimizer(
        "muon", model.optimizer_groups(0.1), lr=1e-3, betas=BETAS, muon_lr=4e-3
    )
    return model, optimizer


def matrices(seed: int) -> list[torch.nn.Parameter]:
    """A wide, two tall (which Muon steps together) and a square weight matrix, each with a
    gradient."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(8, 24), (24, 8), (16, 16), (24, 8)]
    weights = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in shapes]
    for weight in weights:
        weight.grad = torch.randn(weight.shape, generator=generator)
    return weights


def muon_steps(optimizer_class, steps: int = 3, **options) -> list[torch.Tensor]:
    weights = matrices(0)
    optimizer = optimizer_class(weights, lr=0.02, weight_decay=0.1, **options)
    for step in range(steps):
        for weight, fresh in zip(weights, matrices(step + 1), strict=True):
            weight.grad = fresh.grad
        optimizer.step()
    return [weight.detach() for weight in weights]


def assert_same_updates(ours: torch.Tensor, theirs: torch.Tensor, before: torch.Tensor, name=""):
    """Weights after the same steps, ours and a reference's, moved alike from `before`: the same
    arithmetic up to the rounding of bf16 products, whose order of accumulation may differ
    between our batched products (Muon stacks the matrices of one shape) and one matrix's, and
    from one CPU's kernels to another's. Within 10% of the largest move; a slip in the update
    (its scale, the weight decay, the momentum, a transpose) moves weights by far more."""
    ours_moved, theirs_moved = ours - before, theirs - before
    assert theirs_moved.abs().max() > 0, name
    difference = (ours_moved - theirs_moved).abs().max()
    assert difference <= 0.1 * theirs_moved.abs().max(), f"{name}: {difference}"


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon: torch >= 2.9")
@pytest.mark.parametrize(
    "options",
    [{}, {"adjust_lr_fn": "match_rms_adamw"}, {"nesterov": False, "momentum": 0.9}],
)
def test_muon_in_bf16_steps_as_torchs(options):
    ours = muon_steps(Muon, ns_dtype=torch.bfloat16, **options)
    theirs = muon_steps(torch.optim.Muon, **options)
    for mine, reference, before in zip(ours, theirs, matrices(0), strict=True):
        assert_same_updates(mine, reference, before.detach())


@pytest.mark.parametrize(
    "flags, native",
    [
        ({"avx2", "fma3"}, torch.float32),  # an AMD EPYC with AVX2 only: bf16 is emulated
        ({"avx2", "avx512_f", "avx512_bf16"}, torch.bfloat16),
        ({"avx2", "avx512_f", "avx512_bf16", "amx_tile", "amx_bf16"}, torch.bfloat16),
    ],
    ids=["avx2", "avx512_bf16", "amx"],
)
def test_muon_orthogonalises_in_bf16_only_where_the_device_multiplies_in_it(
    cpu_flags, flags, native
):
    """Muon's own choice (ns_dtype None) for each kind of CPU that CI runs on, whichever this
    one is: bf16 where the CPU has bf16 units, fp32 elsewhere."""
    cpu_flags(flags)
    assert multiplies_bf16("cpu") is (native == torch.bfloat16)
    emulated = torch.float32 if native == torch.bfloat16 else torch.bfloat16
    chosen = muon_steps(Muon, steps=1)
    for mine, reference in zip(chosen, muon_steps(Muon, steps=1, ns_dtype=native), strict=True):
        torch.testing.assert_close(mine, reference, rtol=0, atol=0)
    other = muon_steps(Muon, steps=1, ns_dtype=emulated)
    assert any(not torch.equal(a, b) for a, b in zip(chosen, other, strict=True))


@pytest.mark.parametrize("shape", [(8, 24), (24, 8)])
def test_newton_schulz_in_fp32_brings_singular_values_near_one_as_in_bf16(shape):
    update = torch.randn((2, *shape), generator=torch.Generator().manual_seed(3))  # a stack
    coefficients = (3.4445, -4.7750, 2.0315)
    fp32 = orthogonalized(update, coefficients, 5, 1e-7, torch.float32)
    bf16 = orthogonalized(update, coefficients, 5, 1e-7, torch.bfloat16)
    assert fp32.dtype == torch.float32 and fp32.shape == update.shape
    singular_values = torch.linalg.svdvals(fp32)  # of each matrix
    assert singular_values.min() > 0.5 and singular_values.max() < 1.3
    torch.testing.assert_close(fp32, bf16.float(), rtol=0, atol=0.05)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_orthogonalising_leaves_the_momentum_buffer_alone(dtype):
    # without Nesterov the update is the buffer itself; it must come out as a plain average
    weights = matrices(0)
    optimizer = Muon(weights, lr=0.02, momentum=0.9, nesterov=False, ns_dtype=dtype)
    optimizer.step()
    for weight in weights:
        expected = torch.zeros_like(weight.grad).lerp_(weight.grad, 0.1)
        assert torch.equal(optimizer.state[weight]["momentum_buffer"], expected)


def test_muon_takes_only_matrices():
    with pytest.raises(ValueError, match="2-D weight matrices only"):
        Muon([torch.nn.Parameter(torch.zeros(4))])


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    model, optimizer = muon_gpt()
    assert isinstance(optimizer, MuonWithAdamW)
    matrices = {id(p) for group in optimizer.muon.param_groups for p in group["params"]}
    others = {id(p) for group in optimizer.adamw.param_groups for p in group["params"]}
    names = {id(p): name for name, p in model.named_parameters()}
    assert sorted(names[i] for i in matrices) == sorted(
        name
        for name, p in model.named_parameters()
        if name.startswith("blocks.") and name.endswith("weight") and p.dim() == 2
    )
    assert {names[i] for i in others} >= {"tok_emb.weight", "pos_emb.weight", "ln_f.weight"}
    assert matrices.isdisjoint(others) and len(matrices | others) == len(names)


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon: torch >= 2.9")
def test_steps_are_those_of_torchs_muon_and_adamw_side_by_side():
    model, optimizer = muon_gpt()
    optimizer.muon.ns_dtype = torch.bfloat16  # torch's Muon orthogonalises in bf16 everywhere
    torch.manual_seed(0)
    twin = tiny_gpt(11)
    decayed, kept = twin.optimizer_groups(0.1)
    muon = torch.optim.Muon([decayed], lr=4e-3, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([kept], lr=1e-3, betas=BETAS, fused=True)
    train_steps(model, optimizer, range(3))
    twin.train()
    for seed in range(3):
        x, y = batch(seed)
        F.cross_entropy(twin(x)[0].flatten(0, 1), y.flatten()).backward()
        muon.step()
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()
    trained, untrained = model.state_dict(), muon_gpt()[0].state_dict()
    for name, theirs in twin.named_parameters():
        assert_same_updates(trained[name], theirs.detach(), untrained[name], name)


def test_a_scheduler_sets_both_optimizers_rates():
    _, optimizer = muon_gpt()
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)  # sets the rates of step 0
    assert [g["lr"] for g in optimizer.muon.param_groups] == [4e-3 * 0.5]
    assert [g["lr"] for g in optimizer.adamw.param_groups] == [1e-3 * 0.5]


def test_a_restored_optimizer_continues_exactly():
    model, optimizer = muon_gpt()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (step + 1))
    train_steps(model, optimizer, range(2), scheduler)
    saved = {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": copy.deepcopy(optimizer.state_dict()),  # its tensors change in place
        "scheduler": scheduler.state_dict(),
    }
    train_steps(model, optimizer, range(2, 4), scheduler)

    restored, restored_optimizer = muon_gpt(seed=1)
    restored.load_state_dict(saved["model"])
    # As Lightning restores: optimizer and scheduler built first, then their states loaded.
    restored_scheduler = torch.optim.lr_scheduler.LambdaLR(
        restored_optimizer, lambda step: 1 / (step + 1)
    )
    restored_optimizer.load_state_dict(saved["optimizer"])
    restored_scheduler.load_state_dict(saved["scheduler"])
    # Both inner optimizers hold their state again: Muon's momentum, AdamW's moments.
    matrix = restored.blocks[0].attn.qkv_proj.weight
    assert "momentum_buffer" in restored_optimizer.muon.state[matrix]
    assert "exp_avg" in restored_optimizer.adamw.state[restored.tok_emb.weight]
    train_steps(restored, restored_optimizer, range(2, 4), restored_scheduler)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(restored.state_dict()[name], tensor, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"name": "sgd"}, "optim.name='sgd' is not one of adamw, muon"),
        ({"name": "muon", "muon_lr": 0.0}, "optim.muon_lr must be > 0, got 0.0"),
    ],
)
def test_bad_optimizer_options_are_one_line_errors(options, message):
    with pytest.raises(ValueError, match=message):
        OptimConfig(**options)


# --------------------------------------------------------------------------- older checkpoints


def encdec_steps(model, optimizer, seeds) -> None:
    model.train()
    for seed in seeds:
        source, target = batch(seed)
        logits = model(source, target)[0]
        F.cross_entropy(logits.flatten(0, 1), target.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize(
    ("make", "steps"),
    [
        (lambda: tiny_gpt(11, n_kv_head=2), train_steps),
        (lambda: tiny_gpt(11, bias=False), train_steps),
        (lambda: tiny_encdec(11, n_kv_head=1), encdec_steps),  # cross-attention's kv_proj too
    ],
    ids=["gpt_gqa", "gpt_no_bias", "encdec_mqa"],
)
def test_an_optimizer_state_saved_before_q_k_v_were_joined_is_joined_like_the_weights(make, steps):
    torch.manual_seed(0)
    model = make()
    optimizer = build_optimizer("adamw", model.optimizer_groups(0.1), **RATES)
    steps(model, optimizer, [1, 2])
    state = copy.deepcopy(optimizer.state_dict())  # a saved one: no tensor shared with `optimizer`
    older, saved = as_saved_before_the_join(model, state)
    assert len(older["state"]) > len(state["state"])  # the test's premise: it did split some

    joined = join_saved_state(older, group_names(model), saved)
    assert [g["params"] for g in joined["param_groups"]] == [
        g["params"] for g in state["param_groups"]
    ]
    assert joined["state"].keys() == state["state"].keys()
    for index, entry in state["state"].items():
        for key, value in entry.items():
            assert torch.equal(joined["state"][index][key], value), (index, key)
    # ...and training goes on from it exactly as from the state it was split from
    restored = copy.deepcopy(model)
    optimizer_again = build_optimizer("adamw", restored.optimizer_groups(0.1), **RATES)
    optimizer_again.load_state_dict(joined)
    steps(model, optimizer, [3])
    steps(restored, optimizer_again, [3])
    for (name, a), b in zip(
        model.state_dict().items(), restored.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


def test_a_state_of_another_layout_is_left_for_the_optimizer_to_refuse():
    model = tiny_gpt(11)
    state = build_optimizer("adamw", model.optimizer_groups(0.1), **RATES).state_dict()
    names = group_names(model)
    assert join_saved_state(state, names, {n for group in names for n in group}) is state
    other = {
        "state": {},
        "param_groups": [{**g, "params": g["params"][:-1]} for g in state["param_groups"]],
    }
    saved = {
        n.replace("qkv_proj", p)
        for group in names
        for n in group
        for p in ("q_proj", "k_proj", "v_proj")
    }
    assert join_saved_state(other, names, saved) is other
