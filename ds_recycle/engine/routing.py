"""Routed p2p: activations and gradients between any two workers, in any pipeline.

DeepSpeed's ``p2p`` module only reaches the adjacent stage of the caller's own pipeline. After a
failure a micro-batch may come from, or go to, another pipeline, so ReCycle sends on the world
group with global ranks. Sends are asynchronous (their handles are kept until the iteration
ends); receives wait, failure-aware (:class:`~ds_recycle.runtime.waiting.Waiter`), so a dead peer
never blocks a survivor. Every message is tagged with its kind and micro-batch, so transfers
between the same two workers never depend on matching order. The first transfer of a kind to a
peer carries the tensor metadata (count, dtypes, shapes); the receiver caches it per peer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ds_recycle.runtime.waiting import PeerFailure, Waiter

Worker = tuple[int, int]

ACTIVATION = 1
GRADIENT = 2
ACTIVATION_META = 3
TIED_GRADIENT = 4
TIED_WEIGHT = 5
LOSS = 6
GRAD_NORM = 7

_KINDS = {
    ACTIVATION: "activation",
    GRADIENT: "gradient",
    ACTIVATION_META: "activation metadata",
    TIED_GRADIENT: "tied gradient",
    TIED_WEIGHT: "tied weight",
    LOSS: "loss",
    GRAD_NORM: "partial norm",
}

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8]
_META_LEN = 64


def message_tag(kind: int, home: int = 0, mb: int = 0) -> int:
    """A non-negative 31-bit tag (torch passes tags as a C int): 3 bits of kind, 12 of home
    pipeline, 16 of micro-batch."""
    if not (0 < kind < 8 and 0 <= home < 4096 and 0 <= mb < 65536):
        raise ValueError(f"message tag: kind={kind}, home={home} and mb={mb} must be in (0, 8), [0, 4096), [0, 65536)")
    return (kind << 28) | (home << 16) | mb


@dataclass
class PeerChannel:
    """Tagged, asynchronous-send p2p to workers named by (pipeline, stage)."""

    grid: object
    device: torch.device
    waiter: Waiter = field(default_factory=Waiter)
    pending_sends: list = field(default_factory=list)
    _meta_sent: set = field(default_factory=set)
    _meta_received: dict = field(default_factory=dict)

    def rank_of(self, worker: Worker) -> int:
        pipeline, stage = worker
        return self.grid.stage_to_global(stage_id=stage, data=pipeline)

    def send(self, tensors: tuple[torch.Tensor, ...], peer: Worker, kind: int, home: int, mb: int) -> None:
        dst = self.rank_of(peer)
        if kind == ACTIVATION and dst not in self._meta_sent:
            self._meta_sent.add(dst)
            self._isend(_encode_meta(tensors, self.device), dst, message_tag(ACTIVATION_META))
        tag = message_tag(kind, home, mb)
        for tensor in tensors:
            self._isend(tensor.detach().contiguous(), dst, tag)

    def recv_activation(self, peer: Worker, home: int, mb: int) -> tuple[torch.Tensor, ...]:
        src = self.rank_of(peer)
        meta = self._meta_received.get(src)
        if meta is None:
            buf = torch.empty(_META_LEN, dtype=torch.int64, device=self.device)
            tag = message_tag(ACTIVATION_META)
            self.waiter.p2p(lambda: dist.irecv(buf, src=src, tag=tag), f"receiving activation metadata from {peer}")
            meta = self._meta_received[src] = _decode_meta(buf)
        tensors = tuple(torch.empty(shape, dtype=dtype, device=self.device) for dtype, shape in meta)
        self.recv_into(tensors, peer, ACTIVATION, home, mb)
        return tensors

    def recv_into(self, tensors: tuple[torch.Tensor, ...], peer: Worker, kind: int, home: int = 0, mb: int = 0):
        src = self.rank_of(peer)
        tag = message_tag(kind, home, mb)
        for tensor in tensors:
            self.waiter.p2p(
                lambda tensor=tensor: dist.irecv(tensor, src=src, tag=tag),
                f"receiving {_KINDS[kind]} ({home},{mb}) from {peer}",
            )
        return tensors

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        self.waiter.check(f"sending to rank {dst}")
        try:
            work = dist.isend(tensor, dst=dst, tag=tag)
        except RuntimeError as error:
            raise PeerFailure(f"sending to rank {dst}: {error}") from error
        self.pending_sends.append((work, tensor))

    def wait_sends(self) -> None:
        for work, _tensor in self.pending_sends:
            self.waiter.p2p(lambda work=work: work, "completing the iteration's sends")
        self.pending_sends.clear()


def _encode_meta(tensors: tuple[torch.Tensor, ...], device) -> torch.Tensor:
    values = [len(tensors)]
    for t in tensors:
        if t.dtype not in _DTYPES:
            raise TypeError(f"routed p2p cannot send dtype {t.dtype}; allowed: {_DTYPES}")
        values += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
    if len(values) > _META_LEN:
        raise ValueError(f"routed p2p: activation metadata needs {len(values)} slots, at most {_META_LEN}")
    meta = torch.zeros(_META_LEN, dtype=torch.int64, device=device)
    meta[: len(values)] = torch.tensor(values, dtype=torch.int64)
    return meta


def _decode_meta(meta: torch.Tensor) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    values = meta.tolist()
    out, pos = [], 1
    for _ in range(values[0]):
        dtype, ndim = _DTYPES[values[pos]], values[pos + 1]
        out.append((dtype, tuple(values[pos + 2 : pos + 2 + ndim])))
        pos += 2 + ndim
    return out
