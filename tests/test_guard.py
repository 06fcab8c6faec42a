"""The update guard: a flagged non-finite step leaves weights, AdamW moments and step count
exactly as they were, and is reported when asked; finite steps update as if unguarded; on a
GPU, no step waits for the device to tell whether it was flagged."""

import copy
import math

import pytest
import torch

from training.guard import UpdateGuard
from training.optimizers import Muon, MuonWithAdamW

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
OPTIMIZERS = ["adamw", "muon"]


def _model_and_optimizer(device: str, kind: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).to(device)
    if kind == "muon":  # Muon on the weight matrix, AdamW on the bias
        matrices, others = [{"params": [model.weight]}], [{"params": [model.bias]}]
        return model, MuonWithAdamW(matrices, others, muon_lr=0.1, lr=0.1, betas=(0.9, 0.999))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)


def _backward(model: torch.nn.Module, scale: float = 1.0) -> torch.Tensor:
    x = torch.randn(5, 4, device=next(model.parameters()).device)
    loss = model(x).square().mean() * scale
    loss.backward()
    return loss


def _guarded_step(guard, optimizer, model, step: int, loss: torch.Tensor) -> None:
    grads = [p.grad for p in model.parameters()]
    guard.flag(optimizer, step, torch.nn.utils.get_total_norm(grads), loss)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("kind", OPTIMIZERS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("what", ["nan gradient", "inf loss"])
def test_a_nonfinite_step_changes_nothing_and_is_reported(device, what, kind):
    model, optimizer = _model_and_optimizer(device, kind)
    guard = UpdateGuard()
    _guarded_step(guard, optimizer, model, 1, _backward(model))
    weights = copy.deepcopy(model.state_dict())
    state = copy.deepcopy(optimizer.state_dict())

    loss = _backward(model)
    if what == "nan gradient":
        model.weight.grad[0, 0] = math.nan
    else:
        loss = torch.tensor(math.inf, device=device)
    _guarded_step(guard, optimizer, model, 2, loss)

    for name, value in model.state_dict().items():
        assert torch.equal(value, weights[name]), name
    for index, moments in optimizer.state_dict()["state"].items():
        for key, value in moments.items():
            assert torch.equal(value, state["state"][index][key]), key
    (skipped,) = guard.skipped()
    assert skipped.step == 2
    assert math.isnan(skipped.norm) if what == "nan gradient" else math.isinf(skipped.loss)
    assert guard.skipped() == []  # each step is reported once


@pytest.mark.parametrize("kind", OPTIMIZERS)
@pytest.mark.parametrize("device", DEVICES)
def test_finite_steps_update_as_unguarded_and_after_a_skipped_one(device, kind):
    guarded, optimizer = _model_and_optimizer(device, kind)
    plain, plain_optimizer = _model_and_optimizer(device, kind)
    guard = UpdateGuard()
    for step in range(1, 5):
        torch.manual_seed(step)
        loss = _backward(guarded)
        if step == 2:
            guarded.bias.grad[0] = math.inf
        _guarded_step(guard, optimizer, guarded, step, loss)
        if step != 2:  # the plain twin never sees the bad step
            torch.manual_seed(step)
            _backward(plain)
            plain_optimizer.step()
        plain_optimizer.zero_grad(set_to_none=True)
    for name, value in guarded.state_dict().items():
        assert torch.equal(value, plain.state_dict()[name]), name
    assert [s.step for s in guard.skipped()] == [2]


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_applies_the_flag_on_the_device_as_it_would_skip_on_the_host(nesterov):
    """The select MuonWithAdamW has Muon make off the CPU, run here on the CPU, for matrices
    stepped together (two of one shape) and alone: unflagged steps are the plain steps to the
    bit; a flagged one, its gradients NaN, changes neither the weights nor the momentum."""
    torch.manual_seed(0)
    shapes = [(3, 4), (3, 4), (4, 2)]
    flagged = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
    plain = [torch.nn.Parameter(weight.detach().clone()) for weight in flagged]
    flagged_optimizer = Muon(flagged, lr=0.1, nesterov=nesterov)
    plain_optimizer = Muon(plain, lr=0.1, nesterov=nesterov)
    for _ in range(3):
        for weight, twin in zip(flagged, plain, strict=True):
            weight.grad = torch.randn(weight.shape)
            twin.grad = weight.grad.clone()
        flagged_optimizer.step(found_inf=torch.tensor(0.0))
        plain_optimizer.step()
    for weight, twin in zip(flagged, plain, strict=True):
        assert torch.equal(weight, twin)
    weights = [weight.detach().clone() for weight in flagged]
    momenta = [flagged_optimizer.state[weight]["momentum_buffer"].clone() for weight in flagged]
    for weight in flagged:
        weight.grad = torch.full(weight.shape, math.nan)
    flagged_optimizer.step(found_inf=torch.tensor(1.0))
    for weight, before, momentum in zip(flagged, weights, momenta, strict=True):
        assert torch.equal(weight, before)
        assert torch.equal(flagged_optimizer.state[weight]["momentum_buffer"], momentum)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a host only waits for a device")
@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_a_guarded_step_never_makes_the_host_wait(kind):
    model, optimizer = _model_and_optimizer("cuda", kind)
    loss = _backward(model)
    grads = [p.grad for p in model.parameters()]
    UpdateGuard().flag(optimizer, 1, torch.nn.utils.get_total_norm(grads), loss)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host read of device values raises
    try:
        optimizer.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
