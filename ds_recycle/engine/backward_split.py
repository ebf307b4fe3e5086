"""Decoupled backprop: BackwardInput (grads of the stage inputs) and BackwardWeight (grads of
the parameters, later).

B uses torch's reference graph split (``torch.distributed.pipelining._backward``): it finds,
for every parameter, the autograd nodes where the parameter's subgraph joins the path from the
stage input to its output, captures the gradients that flow into those nodes, and computes only
the input gradients. W then back-propagates the captured gradients from those nodes to the
parameters through ``AccumulateGrad``, so parameter hooks fire as in a fused backward.

W pins the captured gradients on *every* intermediate node with a node pre-hook. Without that,
tensor hooks on the stage output (DeepSpeed's 1/GAS hook on the last stage) would run a second
time when an intermediate is the output's own grad_fn (see research/deepspeed-internals.md §2.2).

When no stage input requires grad (the first stage, whose input is data), there is no input
gradient to compute early: B records the outputs and their gradients and W runs the whole
backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge
from torch.distributed.pipelining._backward import stage_backward_input


@dataclass
class WeightGradWork:
    """What BackwardWeight needs from BackwardInput for one micro-batch."""

    param_groups: list[dict] = field(default_factory=list)
    deferred_outputs: list[torch.Tensor] = field(default_factory=list)
    deferred_grads: list[torch.Tensor] = field(default_factory=list)


def backward_input(
    outputs: Sequence[torch.Tensor],
    output_grads: Sequence[torch.Tensor] | None,
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.nn.Parameter],
) -> tuple[tuple[torch.Tensor | None, ...], WeightGradWork]:
    """Gradients of ``inputs`` only. ``output_grads=None`` means ``outputs`` is the loss.

    Returns the input gradients (None where an input needs none) and the work for W.
    """
    outputs = [t for t in outputs if t.requires_grad or t.grad_fn is not None]
    if output_grads is not None:
        output_grads = list(output_grads)
        if len(output_grads) != len(outputs):
            raise ValueError(f"backward_input: {len(outputs)} outputs need grads but {len(output_grads)} were given")
    if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
        grads = output_grads if output_grads is not None else [torch.ones_like(t) for t in outputs]
        return tuple(None for _ in inputs), WeightGradWork(deferred_outputs=outputs, deferred_grads=list(grads))
    input_grads, param_groups = stage_backward_input(outputs, output_grads, list(inputs), iter(params))
    return input_grads, WeightGradWork(param_groups=param_groups)


def backward_weight(work: WeightGradWork) -> None:
    """Accumulate the parameter gradients of one micro-batch into ``param.grad``."""
    if work.deferred_outputs:
        torch.autograd.backward(work.deferred_outputs, work.deferred_grads)
    for group in work.param_groups:
        edges, grads, handles = [], [], []
        captured = group.get("grads")
        if captured is None:
            continue
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
    work.param_groups.clear()
    work.deferred_outputs.clear()
    work.deferred_grads.clear()
