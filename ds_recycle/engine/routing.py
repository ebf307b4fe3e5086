"""Routed p2p: activations and gradients between any two workers, in any pipeline.

DeepSpeed's ``p2p`` module only reaches the adjacent stage of the caller's own pipeline. After a
failure a micro-batch may come from, or go to, another pipeline, so ReCycle sends to global ranks,
each pair of workers on a two-rank group of its own (:class:`~ds_recycle.runtime.rank.groups.PairLinks`),
which every worker connects before the iteration (or re-sync) that first uses it
(:meth:`PeerChannel.connect`). Sends are asynchronous (their handles are kept until the iteration
ends); receives wait, failure-aware (:class:`~ds_recycle.runtime.rank.waiting.Waiter`), so a dead peer
never blocks a survivor.

No message carries a tag of its own: NCCL has none, and gloo and NCCL both match the sends and
receives between two ranks in the order they were posted (on gloo a pair's messages carry the
epoch, so that a pair kept into a new epoch never matches a message a failure abandoned in an
older one: ``PairLinks``). The protocol is therefore an order: on every directed pair of workers,
both sides post the pair's messages in one order, which is

1. the routed transfers of the iteration's instruction stream (activations from stage ``s`` to
   ``s + 1``, gradients from ``s + 1`` to ``s``), in the order the lowering derives from the plan
   (:func:`ds_recycle.planner.lowering.lower` makes the sender's and the receiver's streams agree;
   :func:`ds_recycle.planner.lowering.check_pair_order` checks it for a lowered plan);
2. then the messages of the optimizer step, in the order shown in
   :mod:`ds_recycle.engine.staggered_step`.

A channel lives for one epoch (the engine makes a new one on every new world). Both sides number
the messages of each directed pair from 0. A *header* (int64: kind, home, mb, the message's number,
then the tensors' count, dtypes and shapes) goes right before the first activation on each directed
pair: the receiver takes the activation shapes from it and checks that the message is the one it
expects. With ``DS_RECYCLE_P2P_CHECK=1`` in every rank's environment a header goes before every
message and the receiver checks each one (kind, micro-batch, number, dtypes and shapes): one small
extra message per transfer, to debug an order. ``kind``, ``home`` and ``mb`` never reach torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from ds_recycle.errors import PeerFailure
from ds_recycle.runtime.rank.waiting import Waiter

Worker = tuple[int, int]

ACTIVATION = 1
GRADIENT = 2
TIED_GRADIENT = 4
TIED_WEIGHT = 5
LOSS = 6
GRAD_NORM = 7

_KINDS = {
    ACTIVATION: "activation",
    GRADIENT: "gradient",
    TIED_GRADIENT: "tied gradient",
    TIED_WEIGHT: "tied weight",
    LOSS: "loss",
    GRAD_NORM: "partial norm",
}

CHECK_ENV = "DS_RECYCLE_P2P_CHECK"
"""Set to 1 (on every rank) to send and check a header before every message."""

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8]
_HEADER_LEN = 64
_HEADER_FIELDS = 4  # kind, home, mb, number; the tensors' description follows

TensorMeta = list[tuple[torch.dtype, tuple[int, ...]]]


class P2POrderError(RuntimeError):
    """The two sides of a worker pair posted its messages in different orders: a bug in the
    schedule or the protocol, not a failure (a recovery could not repair it)."""


@dataclass
class PeerChannel:
    """Asynchronous-send p2p to workers named by (pipeline, stage), matched in posting order."""

    grid: object
    device: torch.device
    waiter: Waiter = field(default_factory=Waiter)
    pending_sends: list = field(default_factory=list)
    checked: bool = field(default_factory=lambda: os.environ.get(CHECK_ENV, "") == "1")
    _sent: dict[int, int] = field(default_factory=dict)
    """Messages posted to each destination rank so far."""
    _received: dict[int, int] = field(default_factory=dict)
    _activations_to: set[int] = field(default_factory=set)
    """Destination ranks that have had their first activation (and its header)."""
    _activation_meta: dict[int, TensorMeta] = field(default_factory=dict)
    """By source rank: the activation description its first header gave."""

    def rank_of(self, worker: Worker) -> int:
        pipeline, stage = worker
        return self.grid.stage_to_global(stage_id=stage, data=pipeline)

    def connect(self, peers: set[Worker], iteration: int) -> None:
        """Connect this worker to ``peers`` (those not connected yet). Every worker calls it at the
        same point of the program (the start of iteration ``iteration``, or of a re-sync) with the
        peers the same plan gives it, so that each pair is connected by both of its workers at once."""
        self.grid.links.connect({self.rank_of(peer) for peer in peers}, self.waiter, iteration)

    def send(self, tensors: tuple[torch.Tensor, ...], peer: Worker, kind: int, home: int, mb: int) -> None:
        dst = self.rank_of(peer)
        number = _count(self._sent, dst)
        first_activation = kind == ACTIVATION and dst not in self._activations_to
        if first_activation:
            self._activations_to.add(dst)
        if first_activation or self.checked:
            self._isend(_encode_header(kind, home, mb, number, tensors, self.device), dst)
        for tensor in tensors:
            self._isend(tensor.detach().contiguous(), dst)

    def recv_activation(self, peer: Worker, home: int, mb: int) -> tuple[torch.Tensor, ...]:
        src = self.rank_of(peer)
        number = _count(self._received, src)
        if src not in self._activation_meta or self.checked:
            self._activation_meta[src] = self._recv_header(peer, src, number, ACTIVATION, home, mb)
        tensors = tuple(
            torch.empty(shape, dtype=dtype, device=self.device) for dtype, shape in self._activation_meta[src]
        )
        self._recv_tensors(tensors, peer, src, ACTIVATION, home, mb)
        return tensors

    def recv_into(
        self, tensors: tuple[torch.Tensor, ...], peer: Worker, kind: int, home: int = 0, mb: int = 0
    ) -> tuple[torch.Tensor, ...]:
        src = self.rank_of(peer)
        number = _count(self._received, src)
        if self.checked:
            meta = self._recv_header(peer, src, number, kind, home, mb)
            if meta != _meta_of(tensors):
                raise P2POrderError(
                    f"worker {self.grid.worker} receives {_describe(kind, home, mb)} from {peer} (message {number} "
                    f"on that pair) into {_meta_of(tensors)}, but {peer} sent {meta}"
                )
        self._recv_tensors(tensors, peer, src, kind, home, mb)
        return tensors

    def wait_sends(self) -> None:
        for work, _tensor in self.pending_sends:
            self.waiter.p2p(lambda work=work: work, "completing the iteration's sends")
        self.pending_sends.clear()

    # ---- wire ----------------------------------------------------------------------------------

    def _recv_header(self, peer: Worker, src: int, number: int, kind: int, home: int, mb: int) -> TensorMeta:
        buf = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.device)
        expected = _describe(kind, home, mb)
        self.waiter.p2p(lambda: self.grid.links.irecv(buf, src), f"receiving the header of {expected} from {peer}")
        values = buf.tolist()
        got_kind, got_home, got_mb, got_number = values[:_HEADER_FIELDS]
        if (got_kind, got_home, got_mb, got_number) != (kind, home, mb, number):
            me = self.grid.worker
            raise P2POrderError(
                f"workers {peer} and {me} post their messages in different orders: {me} receives {expected} "
                f"as message {number} from {peer}, but {peer} sent {_describe(got_kind, got_home, got_mb)} "
                f"as message {got_number} to it"
            )
        return _decode_meta(values[_HEADER_FIELDS:])

    def _recv_tensors(
        self, tensors: tuple[torch.Tensor, ...], peer: Worker, src: int, kind: int, home: int, mb: int
    ) -> None:
        what = f"receiving {_describe(kind, home, mb)} from {peer}"
        for tensor in tensors:
            self.waiter.p2p(lambda tensor=tensor: self.grid.links.irecv(tensor, src), what)

    def _isend(self, tensor: torch.Tensor, dst: int) -> None:
        self.waiter.check(f"sending to rank {dst}")
        try:
            work = self.grid.links.isend(tensor, dst)
        except RuntimeError as error:
            raise PeerFailure(f"sending to rank {dst}: {error}") from error
        self.pending_sends.append((work, tensor))


def _count(counters: dict[int, int], rank: int) -> int:
    """This message's number on its pair; counts it."""
    number = counters.get(rank, 0)
    counters[rank] = number + 1
    return number


def _describe(kind: int, home: int, mb: int) -> str:
    name = _KINDS.get(kind, f"unknown kind {kind}")
    if kind in (ACTIVATION, GRADIENT):
        return f"{name} of micro-batch ({home},{mb})"
    if kind in (TIED_GRADIENT, TIED_WEIGHT):
        return f"{name} {mb}"
    return name


def _meta_of(tensors: tuple[torch.Tensor, ...]) -> TensorMeta:
    return [(t.dtype, tuple(t.shape)) for t in tensors]


def _encode_header(
    kind: int, home: int, mb: int, number: int, tensors: tuple[torch.Tensor, ...], device
) -> torch.Tensor:
    values = [kind, home, mb, number, len(tensors)]
    for t in tensors:
        if t.dtype not in _DTYPES:
            raise TypeError(f"routed p2p cannot send dtype {t.dtype}; allowed: {_DTYPES}")
        values += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
    if len(values) > _HEADER_LEN:
        raise ValueError(f"routed p2p: a message header needs {len(values)} slots, at most {_HEADER_LEN}")
    header = torch.zeros(_HEADER_LEN, dtype=torch.int64, device=device)
    header[: len(values)] = torch.tensor(values, dtype=torch.int64)
    return header


def _decode_meta(values: list[int]) -> TensorMeta:
    out, pos = [], 1
    for _ in range(values[0]):
        dtype, ndim = _DTYPES[values[pos]], values[pos + 1]
        out.append((dtype, tuple(values[pos + 2 : pos + 2 + ndim])))
        pos += 2 + ndim
    return out
