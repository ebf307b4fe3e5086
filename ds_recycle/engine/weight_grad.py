"""The cheap W path: Linear layers queue their weight GEMMs for BackwardWeight.

:func:`install_weight_grad_path` gives every plain ``nn.Linear`` of one module (a stage's
``PipelineModule``) a per-instance ``forward``; the class ``nn.Linear`` is never touched, and
:meth:`WeightGradPath.uninstall` removes the instance attributes. The forward runs the native
``F.linear`` on a *detached* weight, so autograd computes the input and bias gradients in C++ and
no weight gradient, and puts a node pre-hook on the ``addmm`` node that holds the layer input
(flattened to 2-D). While a BackwardInput runs, the hook records (weight, input, output
gradient) on the path's tape; BackwardWeight runs one GEMM per record and accumulates. Outside
BackwardInput (a plain ``loss.backward()``) the hook computes the weight gradient at once.
The pre-hook runs after any tensor hook on the Linear's output, so it sees the final gradient.

Where saved-tensor hooks are active (activation checkpointing, offloading), holding the input
in a hook would defeat them: there the Linear runs :class:`_DeferredLinear`, a custom autograd
function that saves its input through those hooks and records the same tape (bias gradients
included, see below).

Numerics. The weight gradient is autograd's own formula for ``F.linear`` on a contiguous input
(``addmm`` of the input viewed as 2-D and ``W.t()``: ``mm_mat2_backward`` then ``TBackward``, that
is ``g.t() @ x``). Under torch autocast the input is cast to the autocast dtype as autocast
would, and W sums the calls of one weight within a micro-batch in that dtype before the cast to
the parameter's dtype, as autocast's cached weight cast makes a fused backward do. So the
gradients are bitwise those of a fused backward on CPU (tests/unit/test_backward_split.py).
Calls the formulas do not cover (a non-contiguous or 1-D input, a dtype mismatch, an input and
bias that need no gradient) run plain ``F.linear``, and their weight gradient comes in B
through autograd; a Linear called both ways in one micro-batch gets correct gradients, summed
in another order than a fused backward. In a plain ``loss.backward()`` under autocast, a Linear
called twice gets its two weight gradients cast before they are summed.

Every other parameter takes its gradient in B (the engine passes them all as ``inputs=`` to one
``torch.autograd.backward``), except parameters of modules the path does not cover: a parameter
with two or more dimensions that belongs to neither a Linear, an embedding nor a normalization
layer. Those keep the generic graph split of :mod:`ds_recycle.engine.backward_split`, and
:meth:`WeightGradPath.describe` names their modules. A Linear whose weight or bias is shared
with another module (a tied weight) is left as it is, so the tied parameter's gradient keeps
the accumulation order of a fused backward.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

_SMALL_MODULES: tuple[type[nn.Module], ...] = (
    nn.Embedding,
    nn.EmbeddingBag,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
    nn.modules.batchnorm._NormBase,
)
_AUTOCAST_INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(slots=True)
class DeferredGemm:
    """One Linear call's parameter gradients, waiting for W."""

    weight: nn.Parameter
    inputs: torch.Tensor
    """The layer input flattened to 2-D, in the compute dtype."""
    grad_output: torch.Tensor
    """The output gradient flattened to 2-D, in the compute dtype: W runs ``grad_output.t() @ inputs``."""
    bias: nn.Parameter | None = None
    grad_bias: torch.Tensor | None = None
    """Computed in B (a row sum), accumulated in W with the weight's."""


@dataclass
class WeightGradPath:
    """The W path installed on one module: which parameters take which route."""

    linears: list[nn.Linear] = field(default_factory=list)
    """Linears whose weight GEMM is deferred to W."""
    fallback: dict[str, list[nn.Parameter]] = field(default_factory=dict)
    """Module name -> its parameters that keep the generic graph split."""
    tied_linears: list[str] = field(default_factory=list)
    """Linears left alone because their weight is shared with another module."""
    tape: list[DeferredGemm] | None = None
    """Set by BackwardInput while it runs: where the Linears record their deferred GEMMs."""
    probe: list[torch.Tensor] | None = None
    """Set by memory accounting (:mod:`ds_recycle.engine.held_memory`): collects the layer
    inputs the Linears hold for W."""

    @functools.cached_property
    def fallback_params(self) -> frozenset[int]:
        return frozenset(id(p) for params in self.fallback.values() for p in params)

    def describe(self) -> str:
        parts = [f"{len(self.linears)} Linear layers defer their weight GEMM to W"]
        if self.tied_linears:
            parts.append(f"tied Linears keep a fused weight gradient: {', '.join(self.tied_linears)}")
        if self.fallback:
            parts.append(f"generic graph split for: {', '.join(self.fallback)}")
        else:
            parts.append("no module needs the generic graph split")
        return "; ".join(parts)

    def uninstall(self) -> None:
        for linear in self.linears:
            linear.__dict__.pop("forward", None)
        self.linears.clear()


def install_weight_grad_path(module: nn.Module) -> WeightGradPath:
    """Route ``module``'s Linears through :class:`_DeferredLinear` (per instance) and classify
    the other parameters. Idempotent per Linear: a Linear already routed is skipped."""
    path = WeightGradPath()
    owners: dict[int, list[str]] = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        for p in sub.parameters(recurse=False):
            owners.setdefault(id(p), []).append(name)
    seen: set[int] = set()
    for name, sub in module.named_modules():
        direct = [p for p in sub.parameters(recurse=False) if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in direct)
        if _is_plain_linear(sub):
            shared = [p for p in (sub.weight, sub.bias) if p is not None and len(set(owners[id(p)])) > 1]
            if shared:
                path.tied_linears.append(name or type(sub).__name__)
            elif "forward" not in sub.__dict__:
                sub.forward = functools.partial(_linear_forward, sub, path)
                path.linears.append(sub)
            continue
        if isinstance(sub, _SMALL_MODULES):
            continue
        big = [p for p in direct if p.dim() >= 2]
        if big:
            path.fallback[name or type(sub).__name__] = big
    return path


def _is_plain_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


def _linear_forward(module: nn.Linear, path: WeightGradPath, x: torch.Tensor) -> torch.Tensor:
    weight, bias = module.weight, module.bias
    if not (torch.is_grad_enabled() and weight.requires_grad and _covered_input(x)):
        return F.linear(x, weight, bias)
    if not (x.requires_grad or (bias is not None and bias.requires_grad)):
        return F.linear(x, weight, bias)  # the output would have no graph to hang the record on
    device = x.device.type
    dtype = None
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        if x.dtype not in _AUTOCAST_INPUT_DTYPES or weight.dtype not in _AUTOCAST_INPUT_DTYPES:
            return F.linear(x, weight, bias)
    elif x.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        return F.linear(x, weight, bias)
    if _saved_tensors_hooks_active():
        # Activation checkpointing (or offloading) decides what the graph keeps: save the input
        # through its hooks.
        return _DeferredLinear.apply(x, weight, bias, path, dtype)
    if dtype is not None:
        x = x.to(dtype)  # what autocast does to the input (an uncached cast: x is no leaf)
    out = F.linear(x, weight.detach(), bias)
    # F.linear on a contiguous input is addmm (mm without bias) on the input viewed as 2-D, then a
    # view back: hook the addmm node, whose gradient is already 2-D, so W runs one GEMM per record.
    node = out.grad_fn if x.dim() == 2 else out.grad_fn.next_functions[0][0]
    flat = x.view(-1, x.shape[-1])
    node.register_prehook(functools.partial(_record, path, weight, flat))
    if path.probe is not None:
        path.probe.append(flat)
    return out


def _saved_tensors_hooks_active() -> bool:
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return True if top is None else top(False) is not None


def _record(path: WeightGradPath, weight: nn.Parameter, x: torch.Tensor, grad_outputs):
    """Node pre-hook on a Linear's output: queue the weight GEMM (or, outside B, run it now)."""
    grad = grad_outputs[0]
    if grad is None:
        return None
    if path.tape is not None:
        path.tape.append(DeferredGemm(weight, x, grad))
    else:
        _accumulate({weight: _weight_grad(grad, x)})
    return None


def _weight_grad(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``grad`` and ``x`` are 2-D. autograd's mm_mat2_backward for ``W.t()`` (a column-major mat2),
    followed by TBackward."""
    return grad.t().mm(x)


def _covered_input(x: torch.Tensor) -> bool:
    # A (rows, 1) input has ambiguous strides, for which autograd picks another formula.
    return x.dim() >= 2 and x.layout == torch.strided and x.is_contiguous() and x.shape[-1] > 1


class _DeferredLinear(torch.autograd.Function):
    """``F.linear`` whose backward leaves the weight GEMM to W while a tape is active."""

    @staticmethod
    def forward(ctx, x, weight, bias, path: WeightGradPath, dtype: torch.dtype | None):
        param, bias_param = weight, bias
        if dtype is not None:
            x, weight = x.to(dtype), weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
        ctx.save_for_backward(x, weight)
        ctx.path = path
        ctx.param = param
        ctx.bias = bias_param
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1])
        grad_input = rows.mm(weight).view(x.shape) if ctx.needs_input_grad[0] else None
        grad_bias = rows.sum(0) if ctx.needs_input_grad[2] else None
        tape = ctx.path.tape
        if tape is None or not ctx.needs_input_grad[1]:
            grad_weight = rows.t().mm(x.view(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
            return grad_input, grad_weight, grad_bias, None, None
        # Bias gradients go with the weight's: several calls of one Linear under autocast sum
        # them in the compute dtype (autocast caches one cast of the bias per forward).
        tape.append(DeferredGemm(ctx.param, x.view(-1, x.shape[-1]), rows, ctx.bias, grad_bias))
        return grad_input, None, None, None, None


def run_deferred_gemms(gemms: Iterable[DeferredGemm]) -> None:
    """W: accumulate the queued weight (and bias) gradients into ``param.grad``, as
    AccumulateGrad would.

    Several calls of one parameter in a micro-batch are summed in the compute dtype, in the order
    their gradients arrived, before the cast to the parameter's dtype."""
    grads: dict[nn.Parameter, torch.Tensor] = {}
    for gemm in gemms:
        weight = gemm.weight
        grad = gemm.grad_output.t().mm(gemm.inputs)
        earlier = grads.get(weight)
        grads[weight] = grad if earlier is None else earlier + grad
        if gemm.grad_bias is not None:
            earlier = grads.get(gemm.bias)
            grads[gemm.bias] = gemm.grad_bias if earlier is None else earlier + gemm.grad_bias
    _accumulate(grads)


def _accumulate(grads: dict[nn.Parameter, torch.Tensor]) -> None:
    targets, additions = [], []
    with torch.no_grad():
        for param, grad in grads.items():
            if grad.dtype != param.dtype:
                grad = grad.to(param.dtype)
            if param.grad is None:
                param.grad = grad
            else:
                targets.append(param.grad)
                additions.append(grad)
        if targets:
            torch._foreach_add_(targets, additions)
