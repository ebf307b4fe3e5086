"""Decoupled backprop: BackwardInput (grads of the stage inputs) and BackwardWeight (grads of
the parameters, later).

B follows torch's reference graph split (``torch.distributed.pipelining._backward``; the graph
helpers are ours, :mod:`ds_recycle.engine.autograd_graph`): it finds, for every parameter, the
autograd nodes where the parameter's subgraph joins the path from the stage input to its output,
captures the gradients that flow into those nodes, and computes only the input gradients. Unlike
torch's ``stage_backward_input`` it does not detach the outputs in place, which fails when an
output is a view (a Linear on 3-D input); the engine drops its references to the outputs instead.
W then back-propagates the captured gradients from those nodes to the parameters through
``AccumulateGrad``, so parameter hooks fire as in a fused backward.

W pins the captured gradients on *every* intermediate node with a node pre-hook. Without that,
tensor hooks on the stage output (DeepSpeed's 1/GAS hook on the last stage) would run a second
time when an intermediate is the output's own grad_fn (docs/design.md §8, DeepSpeed's output hooks).

When no stage input requires grad (the first stage, whose input is data), there is no input
gradient to compute early: B records the outputs and their gradients and W runs the whole
backward.

With a :class:`~ds_recycle.engine.weight_grad.WeightGradPath` (``path=``, what the engine
installs on its module), B is one ``torch.autograd.backward`` that computes the input gradients
and the gradients of every parameter except the Linear weights, whose GEMMs the Linears queue on
the path's tape, and except the parameters of modules the path does not cover, which keep the
graph split above. B then frees the graph unless such a module is present, and W runs the
queued GEMMs. On the first stage, where no input needs a gradient, the uncovered parameters
take their gradient in B too.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge

from ds_recycle.engine.autograd_graph import consumers, grad_node, param_groups
from ds_recycle.engine.weight_grad import DeferredGemm, WeightGradPath, run_deferred_gemms


@dataclass
class WeightGradWork:
    """What BackwardWeight needs from BackwardInput for one micro-batch."""

    param_groups: list[dict] = field(default_factory=list)
    deferred_outputs: list[torch.Tensor] = field(default_factory=list)
    deferred_grads: list[torch.Tensor] = field(default_factory=list)
    gemms: list[DeferredGemm] = field(default_factory=list)
    """Weight GEMMs queued by the Linears of a :class:`WeightGradPath`."""

    def tensors(self) -> list[torch.Tensor]:
        """The tensors this work keeps alive until W (for memory accounting)."""
        held = [*self.deferred_outputs, *self.deferred_grads]
        for gemm in self.gemms:
            held += [gemm.inputs, gemm.grad_output]
        for group in self.param_groups:
            for node_grads in group.get("grads", ()):
                held += [g for g in node_grads or () if g is not None]
        return held


def backward_input(
    outputs: Sequence[torch.Tensor],
    output_grads: Sequence[torch.Tensor] | None,
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.nn.Parameter],
    *,
    path: WeightGradPath | None = None,
) -> tuple[tuple[torch.Tensor | None, ...], WeightGradWork]:
    """Gradients of ``inputs`` only (with ``path``: and of the parameters W need not wait for).
    ``output_grads=None`` means ``outputs`` is the loss.

    Returns the input gradients (None where an input needs none) and the work for W.
    """
    outputs = [t for t in outputs if t.requires_grad or t.grad_fn is not None]
    grads = list(output_grads) if output_grads is not None else [torch.ones_like(t) for t in outputs]
    if len(grads) != len(outputs):
        raise ValueError(f"backward_input: {len(outputs)} outputs need grads but {len(grads)} were given")
    wanted = [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    if path is not None:
        return _backward_input_with_path(outputs, grads, inputs, wanted, params, path)
    if not wanted:
        return tuple(None for _ in inputs), WeightGradWork(deferred_outputs=outputs, deferred_grads=grads)
    param_groups, handles = _split_points(outputs, [inputs[i] for i in wanted], params)
    try:
        found = torch.autograd.grad(outputs, [inputs[i] for i in wanted], grads, retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    input_grads: list[torch.Tensor | None] = [None] * len(inputs)
    for i, grad in zip(wanted, found, strict=True):
        input_grads[i] = grad
    return tuple(input_grads), WeightGradWork(param_groups=param_groups)


def _split_points(outputs, inputs, params) -> tuple[list[dict], list]:
    """The graph split's parameter groups of ``params``, with hooks capturing the gradients
    that reach their intermediate nodes."""
    input_nodes = [n for n in map(grad_node, inputs) if n is not None]
    weight_nodes = [n for n in (grad_node(p) for p in params if p.requires_grad) if n is not None]
    groups = param_groups(input_nodes, weight_nodes, consumers(map(grad_node, outputs)))
    handles = []
    for group in groups:
        group["intermediates"] = list(group["intermediates"])
        group["grads"] = [None] * len(group["intermediates"])
        for i, node in enumerate(group["intermediates"]):
            handles.append(node.register_prehook(functools.partial(_capture, group["grads"], i)))
    return groups, handles


def _backward_input_with_path(outputs, grads, inputs, wanted, params, path: WeightGradPath):
    fallback_ids = path.fallback_params if wanted else ()
    if fallback_ids:
        fallback = [p for p in params if p.requires_grad and id(p) in fallback_ids]
        in_b = [p for p in params if p.requires_grad and id(p) not in fallback_ids]
    else:
        fallback, in_b = [], [p for p in params if p.requires_grad]
    targets = [inputs[i] for i in wanted]
    param_groups, handles = _split_points(outputs, targets, fallback) if fallback else ([], [])
    saved = [t.grad for t in targets]
    for t in targets:
        t.grad = None
    tape: list[DeferredGemm] = []
    path.tape = tape
    try:
        if targets or in_b:
            torch.autograd.backward(outputs, grads, inputs=targets + in_b, retain_graph=bool(param_groups))
    finally:
        path.tape = None
        for handle in handles:
            handle.remove()
    input_grads: list[torch.Tensor | None] = [None] * len(inputs)
    for i, t, before in zip(wanted, targets, saved, strict=True):
        input_grads[i] = t.grad
        t.grad = before
    return tuple(input_grads), WeightGradWork(param_groups=param_groups, gemms=tape)


def _capture(store: list, index: int, grad_inputs):
    store[index] = grad_inputs


def backward_weight(work: WeightGradWork) -> None:
    """Accumulate the parameter gradients of one micro-batch into ``param.grad``."""
    if work.deferred_outputs:
        torch.autograd.backward(work.deferred_outputs, work.deferred_grads)
    for group in work.param_groups:
        edges, grads, handles = [], [], []
        captured = group["grads"]
        try:
            for node_grads, node in zip(captured, group["intermediates"], strict=True):
                for i, grad in enumerate(node_grads):
                    if grad is not None:
                        edges.append(GradientEdge(node, i))
                        grads.append(grad)
                handles.append(node.register_prehook(lambda _grads, pinned=node_grads: pinned))
            if edges:
                weights = [GradientEdge(p, 0) for p in group["params"]]
                torch.autograd.backward(edges, grads, inputs=weights)
        finally:
            for handle in handles:
                handle.remove()
    run_deferred_gemms(work.gemms)
    work.gemms.clear()
    work.param_groups.clear()
    work.deferred_outputs.clear()
    work.deferred_grads.clear()
