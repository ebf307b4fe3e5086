"""The in-place undo of an optimizer step against a copy-based reference, in fp32."""

from __future__ import annotations

import copy

import pytest
import torch

from ds_recycle.engine.undo import StepUndo, UndoUnsupported

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05),
    "sgd-momentum-wd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adam-l2": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
}


def _params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(64, 32, generator=gen)), torch.nn.Parameter(torch.randn(32, generator=gen))]


def _step(optimizer, params, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    grads = {
        p: torch.randn(p.shape, generator=gen) * 10.0 ** torch.randint(-4, 1, (1,), generator=gen).item()
        for p in params
    }
    for p, g in grads.items():
        p.grad = g.clone()
    optimizer.step()
    return grads


def _schedule(optimizer) -> None:
    """What an LR scheduler does after a step (OneCycle also cycles momentum or beta1)."""
    for group in optimizer.param_groups:
        group["lr"] *= 0.3
        if group.get("momentum"):
            group["momentum"] = 0.8
        if "betas" in group:
            group["betas"] = (0.85, group["betas"][1])


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("prior_steps", [0, 1, 5])
@pytest.mark.parametrize("scheduled", [False, True], ids=["", "scheduler-stepped"])
def test_undo_restores_the_state_before_the_step(name, prior_steps, scheduled):
    params = _params(0)
    optimizer = OPTIMIZERS[name](params)
    for i in range(prior_steps):
        _step(optimizer, params, seed=100 + i)
    want_params = [p.detach().clone() for p in params]
    want_state = copy.deepcopy(optimizer.state_dict())

    gen = torch.Generator().manual_seed(7)
    grads = {p: torch.randn(p.shape, generator=gen) for p in params}
    undo = StepUndo.before_step(optimizer, {p: g.clone() for p, g in grads.items()})
    for p, g in grads.items():
        p.grad = g.clone()
    optimizer.step()
    after = {i: {k: v.abs().max().item() for k, v in st.items()} for i, st in optimizer.state_dict()["state"].items()}
    if scheduled:
        _schedule(optimizer)
    undo.undo()

    for got, want in zip(params, want_params, strict=True):
        torch.testing.assert_close(got.detach(), want, rtol=2e-7, atol=2e-7)
    got_state = optimizer.state_dict()["state"]
    assert got_state.keys() == want_state["state"].keys()
    for index, state in want_state["state"].items():
        for key, value in state.items():
            # Each moment comes back within a few ulps of its value after the step (the subtraction
            # can cancel when the step's gradient dwarfs the old moment).
            torch.testing.assert_close(got_state[index][key], value, rtol=1e-6, atol=1e-6 * after[index][key], msg=key)


def test_undo_then_a_clipped_step_matches_a_clipped_step_from_a_copy():
    """The post-validation path: step, undo, step again with scaled gradients."""
    params, reference = _params(1), _params(1)
    optimizer, ref_optimizer = torch.optim.Adam(params, lr=1e-2), torch.optim.Adam(reference, lr=1e-2)
    for i in range(3):
        for ps, opt in ((params, optimizer), (reference, ref_optimizer)):
            _step(opt, ps, seed=200 + i)
        gen = torch.Generator().manual_seed(300 + i)
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        undo = StepUndo.before_step(optimizer, {p: g.clone() for p, g in zip(params, grads, strict=True)})
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        optimizer.step()
        undo.undo()
        for p, g, r in zip(params, grads, reference, strict=True):
            p.grad = g * 0.3
            r.grad = g * 0.3
        optimizer.step()
        ref_optimizer.step()
    for p, r in zip(params, reference, strict=True):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-6, atol=1e-6)


def test_unsupported_optimizers_are_named():
    params = _params(2)
    with pytest.raises(UndoUnsupported, match="amsgrad"):
        StepUndo.before_step(torch.optim.Adam(params, amsgrad=True), {})
    with pytest.raises(UndoUnsupported, match="RMSprop"):
        StepUndo.before_step(torch.optim.RMSprop(params), {})
