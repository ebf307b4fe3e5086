"""Activations between stages in the autocast dtype.

With DeepSpeed's ``torch_autocast`` section enabled, a stage sends its fp32 outputs in the
autocast dtype (bf16: half the bytes) and the next stage's input is that bf16 tensor, as if the
stage ended with ``.to(dtype)``. The input gradient the next stage sends back is then bf16 too;
the sender casts it to its outputs' dtype before its backward, which is what autograd does for a
``.to(dtype)`` node. So ReCycle under autocast computes what stock DeepSpeed computes for a model
whose stages end with that cast (tests/engine/test_autocast.py checks this bitwise).

Only fp32 tensors are cast: autocast leaves fp64 alone and fp16/bf16 are already narrow.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def wire_dtype(engine) -> torch.dtype | None:
    """The dtype activations travel in: the autocast dtype, or None without autocast."""
    if not engine.torch_autocast_enabled():
        return None
    return engine.torch_autocast_dtype()


def _on_wire(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and tensor.dtype == torch.float32 else tensor.dtype


def activations_to_wire(outputs: Sequence[torch.Tensor], dtype: torch.dtype | None) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(_on_wire(t, dtype)) if t.is_floating_point() else t for t in outputs)


def grad_buffers(outputs: Sequence[torch.Tensor], dtype: torch.dtype | None) -> tuple[torch.Tensor, ...]:
    """Receive buffers for the gradients of ``outputs``'s floating tensors, in the wire dtype."""
    return tuple(torch.empty_like(t, dtype=_on_wire(t, dtype)) for t in outputs if t.is_floating_point())


def grads_from_wire(grads: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The received gradients in the dtype of the outputs they belong to."""
    floating = [t for t in outputs if t.is_floating_point()]
    return tuple(g if g.dtype == t.dtype else g.to(t.dtype) for g, t in zip(grads, floating, strict=True))
