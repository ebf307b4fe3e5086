"""Undo an optimizer step in place, without a copy of the parameters or the optimizer state.

SWIFT undoes an update to make replicas consistent after a failure, and Zero Bubble's
post-validation reverts a step when clipping turns out to be needed; both invert the update
arithmetic instead of restoring a snapshot, which at scale would cost three times the parameter
memory. :class:`StepUndo` keeps only the gradients the step used (the reduced gradients, which
post-validation keeps anyway) and which parameters had no optimizer state before the step.

Supported: ``torch.optim.SGD`` (momentum, dampening, Nesterov, weight decay), ``torch.optim.Adam``
and ``torch.optim.AdamW`` (L2 or decoupled weight decay), without ``amsgrad`` or ``maximize``.
Inverting is exact in real arithmetic; in fp32 each restored value carries a rounding error of a
few ulps of the values involved (measured in tests/unit/test_undo.py against a copy-based
reference): ``p`` and Adam's first moment within about 1e-7 relative, the second moment within
about 1e-7 of ``v_t`` in absolute terms (its subtraction can cancel).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch


class UndoUnsupported(ValueError):
    pass


def unsupported_reason(optimizer) -> str | None:
    """Why ``optimizer``'s step cannot be undone in place, or None if it can."""
    if type(optimizer) not in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
        return f"{type(optimizer).__name__} is not one of torch.optim.SGD, Adam, AdamW"
    for group in optimizer.param_groups:
        for flag in ("amsgrad", "maximize", "capturable", "differentiable"):
            if group.get(flag, False):
                return f"{type(optimizer).__name__} with {flag}=True"
        if isinstance(group["lr"], torch.Tensor):
            return "a tensor learning rate"
    return None


def hyperparameters(optimizer) -> list[dict]:
    """Every param group's settings but its parameters (learning rate, betas, momentum, ...): what
    an LR scheduler changes between steps."""
    return [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]


def restore_hyperparameters(optimizer, saved: list[dict]) -> None:
    for group, settings in zip(optimizer.param_groups, saved, strict=True):
        group.update(settings)


@dataclass
class StepUndo:
    """Made just before ``optimizer.step()``; ``undo()`` reverts that step, with the hyperparameters
    it was taken with (an LR scheduler may have changed the optimizer's since)."""

    optimizer: torch.optim.Optimizer
    grads: dict[torch.nn.Parameter, torch.Tensor]
    """The gradient each stepped parameter had at the step (kept, not shared)."""
    fresh: set[torch.nn.Parameter] = field(default_factory=set)
    """Parameters without optimizer state before the step: their state is dropped on undo."""
    groups: list[dict] = field(default_factory=list)
    """Each param group's hyperparameters at the step (:func:`hyperparameters`)."""

    @classmethod
    def before_step(cls, optimizer, grads: dict) -> StepUndo:
        reason = unsupported_reason(optimizer)
        if reason is not None:
            raise UndoUnsupported(reason)
        fresh = {p for p in grads if not optimizer.state.get(p)}
        return cls(optimizer, grads, fresh, hyperparameters(optimizer))

    @torch.no_grad()
    def undo(self) -> None:
        adam = isinstance(self.optimizer, (torch.optim.Adam, torch.optim.AdamW))
        for group, used in zip(self.optimizer.param_groups, self.groups, strict=True):
            for p in group["params"]:
                if p in self.grads:
                    if adam:
                        self._undo_adam(p, used)
                    else:
                        self._undo_sgd(p, used)

    def _undo_adam(self, p, group) -> None:
        state = self.optimizer.state[p]
        beta1, beta2 = group["betas"]
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        decoupled = isinstance(self.optimizer, torch.optim.AdamW) or group.get("decoupled_weight_decay", False)
        step = float(state["step"])
        m, v = state["exp_avg"], state["exp_avg_sq"]
        bias1, bias2 = 1 - beta1**step, 1 - beta2**step
        denom = (v.sqrt() / (bias2**0.5)).add_(eps)
        p.addcdiv_(m, denom, value=lr / bias1)
        if wd and decoupled:
            p.div_(1 - lr * wd)
        if p in self.fresh:
            del self.optimizer.state[p]
            return
        grad = self.grads[p]
        if wd and not decoupled:
            grad = grad.add(p, alpha=wd)
        m.sub_(grad, alpha=1 - beta1).div_(beta1)
        v.sub_(grad * grad, alpha=1 - beta2).div_(beta2).clamp_(min=0)
        state["step"] -= 1

    def _undo_sgd(self, p, group) -> None:
        lr, wd = group["lr"], group["weight_decay"]
        momentum, dampening, nesterov = group["momentum"], group["dampening"], group["nesterov"]
        grad = self.grads[p]
        buf = self.optimizer.state.get(p, {}).get("momentum_buffer") if momentum else None
        if buf is None:
            # p_t = p - lr (g + wd p)
            p.add_(grad, alpha=lr).div_(1 - lr * wd)
        elif nesterov:
            # p_t = p - lr (d + momentum buf_t), d = g + wd p
            p.add_(grad, alpha=lr).add_(buf, alpha=lr * momentum).div_(1 - lr * wd)
        else:
            p.add_(buf, alpha=lr)
        if buf is None:
            return
        if p in self.fresh:
            del self.optimizer.state[p]
            return
        d_p = grad.add(p, alpha=wd) if wd else grad
        buf.sub_(d_p, alpha=1 - dampening).div_(momentum)


@dataclass
class SnapshotUndo:
    """The fallback for optimizers :class:`StepUndo` does not cover: a copy of the parameters and
    the optimizer state, taken before the step (three times the parameter memory for Adam)."""

    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    saved_params: list[torch.Tensor]
    saved_state: dict

    @classmethod
    def before_step(cls, optimizer, params) -> SnapshotUndo:
        params = list(params)
        return cls(optimizer, params, [p.detach().clone() for p in params], copy.deepcopy(optimizer.state_dict()))

    @torch.no_grad()
    def undo(self) -> None:
        for p, saved in zip(self.params, self.saved_params, strict=True):
            p.copy_(saved)
        self.optimizer.load_state_dict(self.saved_state)


def undo_before_step(optimizer, grads: dict, params) -> StepUndo | SnapshotUndo:
    """The in-place undo where it applies, else a snapshot of ``params`` and the optimizer state."""
    if unsupported_reason(optimizer) is None:
        return StepUndo.before_step(optimizer, grads)
    return SnapshotUndo.before_step(optimizer, params)
