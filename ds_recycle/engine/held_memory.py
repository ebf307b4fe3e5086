"""What one micro-batch keeps alive on a stage: after F, between B and W, and after W.

Counted as the bytes of distinct storages (parameters and their gradients excluded) reachable
from the micro-batch: the tensors its autograd graph saved (read from the nodes' ``_saved_*``
fields, and ``saved_tensors`` of custom functions), the layer inputs the W path holds for its
deferred GEMMs, the stage outputs (after F), and the tensors the W work holds (between B and W).
A graph that B freed (the W path frees it unless a module needs the generic split) holds nothing.
The count is device-agnostic, so it runs on CPU.

:func:`measure_held_bytes` runs one micro-batch through a stage and returns :class:`HeldBytes`.
The benchmark (bench/backward_split.py) reports the ratio between B and W over after F, for the
W path and for the generic graph split.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from ds_recycle.engine.backward_split import backward_input, backward_weight
from ds_recycle.engine.weight_grad import WeightGradPath


@dataclass(frozen=True)
class HeldBytes:
    after_forward: int
    between_b_and_w: int
    after_w: int

    @property
    def ratio(self) -> float:
        """Bytes held between B and W over bytes held after F."""
        return self.between_b_and_w / self.after_forward if self.after_forward else 0.0


def measure_held_bytes(
    stage: nn.Module,
    stage_input: torch.Tensor,
    path: WeightGradPath | None = None,
    autocast_dtype: torch.dtype | None = None,
    loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    seed: int = 0,
) -> HeldBytes:
    """Run F, B and W of one micro-batch through ``stage``. A floating ``stage_input`` requires
    grad (a middle stage); ``loss_fn`` makes it a last stage; otherwise the output gradient is
    random. ``path`` is the W path installed on ``stage``, or None for the generic graph split."""
    params = [p for p in stage.parameters() if p.requires_grad]
    for p in params:  # accumulate in place, so that gradients are not counted as held
        p.grad = torch.zeros_like(p)
    excluded = {storage_of(p) for p in params} | {storage_of(p.grad) for p in params}
    x = stage_input.detach().clone().requires_grad_(stage_input.is_floating_point())
    probe: list[torch.Tensor] = []
    if path is not None:
        path.probe = probe
    autocast = (
        torch.autocast(x.device.type, dtype=autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()
    )
    try:
        with autocast:
            out = stage(x)
    finally:
        if path is not None:
            path.probe = None
    if loss_fn is not None:
        outputs, grads = [loss_fn(out)], None
    else:
        generator = torch.Generator(device=out.device).manual_seed(seed)
        outputs = [out]
        grads = [torch.randn(out.shape, generator=generator, device=out.device).to(out.dtype)]
    root = outputs[0].grad_fn
    after_forward = storage_bytes([*saved_by_graph(root), *probe, *outputs], excluded)
    probe.clear()
    _, work = backward_input(outputs, grads, [x], params, path=path)
    del out, outputs, grads
    between = storage_bytes([*saved_by_graph(root), *work.tensors()], excluded)
    backward_weight(work)
    after_w = storage_bytes(work.tensors(), excluded)
    return HeldBytes(after_forward, between, after_w)


def storage_of(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def storage_bytes(tensors: Iterable[torch.Tensor], excluded: set[int]) -> int:
    sizes: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in excluded and ptr != 0:
            sizes[ptr] = storage.nbytes()
    return sum(sizes.values())


def saved_by_graph(root) -> list[torch.Tensor]:
    """The tensors saved by every node reachable from ``root`` whose buffers are not freed."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    stack = [root] if root is not None else []
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        for name in dir(node):
            if name.startswith("_saved_") or name == "saved_tensors":
                try:
                    value = getattr(node, name)
                except RuntimeError:  # freed by a backward that did not retain the graph
                    continue
                found.extend(tensors_in(value))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def tensors_in(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    return []
