"""Memory caps from measured bytes: how many micro-batches a worker may hold between F and W.

A worker's memory is its static bytes (parameters, gradients, optimizer state, as allocated) plus
what each micro-batch it holds between the start of its F and the end of its W keeps alive
(:mod:`ds_recycle.engine.held_memory`'s count, the larger of after F and between B and W). Against
a budget per worker (``recycle.memory_limit_gb``, or on a GPU the device's memory) that gives each
stage a cap::

    cap_s = floor((budget_s - static_s) / per_microbatch_s)

Each worker measures its own first training micro-batch as it runs (:class:`HeldMeter`: no extra
F or B, no random numbers drawn) and its static bytes at the first agreement; the live workers
then agree on one table (:func:`agree_budget`, an all-reduce over the world at the start of an
iteration, every epoch), so every rank derives the same caps.

The planner takes one cap for every worker, so it gets the least stage cap (at most P, its
default; None when memory does not bind): a worker of any stage then holds at most its own cap.
A re-routed worker whose own stage could hold more gets fewer in flight than it could, never
more; the cap must be one number on every rank, or the ranks would lower different plans.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ds_recycle.engine.held_memory import saved_by_graph, storage_bytes, storage_of, tensors_in
from ds_recycle.engine.profile import exchange
from ds_recycle.engine.timing import InstructionEvent
from ds_recycle.planner.plan import BACKWARD_WEIGHT, FORWARD, Plan, Worker

GIB = 2**30
UNBOUNDED = 2**31
"""The cap of a stage whose micro-batches hold nothing measurable."""
AUDIT_ENV = "DS_RECYCLE_MEMORY_AUDIT"
"""Set to 1: every micro-batch is measured and each iteration logs its peak (tests)."""


@dataclass(frozen=True)
class StageMemory:
    per_microbatch: int
    """Bytes one micro-batch holds between F and W (the larger of after F and between B and W)."""
    static: int
    """Parameters, gradients and optimizer state."""
    limit: int
    """The budget of each of the stage's workers (the least over its live replicas)."""

    @property
    def cap(self) -> int:
        """Micro-batches that fit beside the static bytes (below 1: not even one)."""
        room = self.limit - self.static
        if self.per_microbatch <= 0:
            return UNBOUNDED if room >= 0 else 0
        return min(UNBOUNDED, room // self.per_microbatch)

    def bytes_with(self, microbatches: int) -> int:
        return self.static + microbatches * self.per_microbatch


@dataclass(frozen=True)
class MemoryBudget:
    stages: tuple[StageMemory, ...]

    @property
    def caps(self) -> tuple[int, ...]:
        return tuple(stage.cap for stage in self.stages)

    @property
    def least(self) -> int:
        """The least stage cap (below 1: some stage cannot hold one micro-batch)."""
        return min(self.caps)

    def planner_cap(self) -> int | None:
        """The one cap the planner gets: the least stage cap when it is below P (the planner's
        default, the peak of stock 1F1B), None when memory does not bind. Below 1 no plan fits."""
        least = self.least
        return None if least >= len(self.stages) else least

    def over(self, peaks: Mapping[Worker, int]) -> list[tuple[Worker, int, int]]:
        """(worker, micro-batches it holds, its stage's cap) for every worker of ``peaks`` above its cap."""
        return [(w, n, self.stages[w[1]].cap) for w, n in sorted(peaks.items()) if n > self.stages[w[1]].cap]

    def describe(self) -> str:
        parts = [
            f"stage {s}: {m.static} static + {m.per_microbatch} per micro-batch of {m.limit} -> cap {_cap(m.cap)}"
            for s, m in enumerate(self.stages)
        ]
        return "; ".join(parts)

    def shortfall(self, stage: int, microbatches: int) -> str:
        """What ``microbatches`` in flight on ``stage`` would take, against its limit, in words."""
        m = self.stages[stage]
        return (
            f"stage {stage} needs {m.static} static + {microbatches} x {m.per_microbatch} bytes = "
            f"{m.bytes_with(microbatches)} bytes of its {m.limit}"
        )


def _cap(cap: int) -> str:
    return "unbounded" if cap >= UNBOUNDED else str(cap)


def peak_in_flight(plan: Plan) -> dict[Worker, int]:
    """The most micro-batches each worker of ``plan`` holds between the start of F and the end of
    W (the validator's rule: a W's end releases before an F starting at the same time)."""
    peaks = {}
    for worker, ops in plan.workers.items():
        events = [(op.start, 1, 1) for op in ops if op.kind == FORWARD]
        events += [(op.end, 0, -1) for op in ops if op.kind == BACKWARD_WEIGHT]
        peaks[worker] = _peak(events)
    return peaks


def executed_peak(events: Iterable[InstructionEvent]) -> int:
    """The most micro-batches held between the start of an executed F and the end of its W."""
    timeline = []
    for event in events:
        if event.name == "ForwardPass":
            timeline.append((event.start, 1, 1))
        elif event.name == "BackwardWeight":
            timeline.append((event.end, 0, -1))
    return _peak(timeline)


def _peak(events: list[tuple[float, int, int]]) -> int:
    held = peak = 0
    for _time, _order, delta in sorted(events):
        held += delta
        peak = max(peak, held)
    return peak


def static_bytes(module: torch.nn.Module, optimizer: object, device: torch.device) -> int:
    """Parameters, buffers, gradients and optimizer state as allocated; a trainable parameter
    without a gradient now counts one of its size (every iteration allocates it). On a GPU, at
    least what the allocator has handed out (measured at an iteration boundary, when no
    micro-batch is held)."""
    params = list(module.parameters())
    tensors = [*params, *module.buffers(), *(p.grad for p in params if p.grad is not None)]
    state = getattr(optimizer, "state", {})
    for value in state.values() if isinstance(state, Mapping) else ():
        tensors += tensors_in(list(value.values()) if isinstance(value, Mapping) else value)
    counted = storage_bytes(tensors, set())
    counted += sum(p.numel() * p.element_size() for p in params if p.requires_grad and p.grad is None)
    if device.type == "cuda":
        counted = max(counted, torch.cuda.memory_allocated(device))
    return counted


def device_budget(device: torch.device) -> int | None:
    """On a GPU, the bytes this process can have: what is free on the device and what its own
    allocator already reserved. None elsewhere."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device))


def agree_budget(
    row: BudgetRow, worker: Worker, pipelines: int, stages: int, all_reduce: Callable, device: object = "cpu"
) -> MemoryBudget | None:
    """Every live worker's row (one all-reduce), read by :func:`budget_from_table`."""
    return budget_from_table(exchange(row.values(), worker, pipelines, stages, all_reduce, device), pipelines, stages)


def budget_from_table(table: list[list[float]], pipelines: int, stages: int) -> MemoryBudget | None:
    """The budget of every worker's :class:`BudgetRow`: a stage's per-micro-batch and static bytes are
    the largest of its measured replicas', its limit the least. None while some stage has no
    measured replica (every rank sees the same table, so every rank returns the same)."""
    budget = []
    for s in range(stages):
        rows = [BudgetRow(*table[p * stages + s]) for p in range(pipelines)]
        present = [r for r in rows if r.present]
        measured = [r for r in present if r.measured]
        if not measured:
            return None
        budget.append(
            StageMemory(
                int(max(r.per_microbatch for r in measured)),
                int(max(r.static for r in present)),
                int(min(r.limit for r in present)),
            )
        )
    return MemoryBudget(tuple(budget))


@dataclass(frozen=True)
class BudgetRow:
    """One worker's part of :func:`agree_budget`'s table (float64 holds bytes exactly below 2^53)."""

    present: float = 1.0
    measured: float = 0.0
    per_microbatch: float = 0.0
    static: float = 0.0
    limit: float = 0.0

    def values(self) -> list[float]:
        return [self.present, self.measured, self.per_microbatch, self.static, self.limit]


@dataclass
class _InFlight:
    roots: list
    probe: list[torch.Tensor]
    tensors: Callable[[], list[torch.Tensor]]
    work: object = None


@dataclass
class HeldMeter:
    """Measures what micro-batches hold on this worker, from the engine's own buffers and graphs.

    ``first``: the first training micro-batch this worker ran (after F, between B and W), all the
    cap needs. With ``audit``, every micro-batch is followed and :attr:`peak` is the most bytes
    the in-flight micro-batches held together, counted after every F, B and W (distinct storages,
    parameters and gradients excluded, as :mod:`held_memory` counts)."""

    params: Sequence[torch.nn.Parameter]
    audit: bool = False
    first: tuple[int, int] | None = None
    """(after F, between B and W) in bytes."""
    peak: int = 0
    _first_after_forward: int | None = None
    _first_buffer: int | None = None
    _in_flight: dict[int, _InFlight] = field(default_factory=dict)

    def wants(self) -> bool:
        """Whether the next F should be followed (the engine sets the W path's probe for it)."""
        return self.audit or self._first_buffer is None

    def after_forward(self, buffer_id: int, roots: list, probe: list[torch.Tensor], tensors) -> None:
        """``tensors()``: the micro-batch's buffers (inputs, outputs, labels, ...) as they are now."""
        record = _InFlight([r for r in roots if r is not None], list(probe), tensors)
        self._in_flight[buffer_id] = record
        if self._first_buffer is None:
            self._first_buffer = buffer_id
            self._first_after_forward = self._bytes([record])
        self._audit()

    def after_backward_input(self, buffer_id: int, work) -> None:
        record = self._in_flight.get(buffer_id)
        if record is None:
            return
        record.probe, record.work = [], work
        if buffer_id == self._first_buffer and self.first is None:
            self.first = (self._first_after_forward, self._bytes([record]))
        self._audit()

    def after_backward_weight(self, buffer_id: int) -> None:
        if self._in_flight.pop(buffer_id, None) is not None:
            self._audit()

    @property
    def per_microbatch(self) -> int | None:
        return None if self.first is None else max(self.first)

    def take_peak(self) -> int:
        peak, self.peak = self.peak, 0
        return peak

    def drop(self) -> None:
        """An interrupted iteration: forget what was in flight (a first measurement not finished
        is taken again)."""
        self._in_flight.clear()
        if self.first is None:
            self._first_buffer = None

    def _audit(self) -> None:
        if self.audit:
            self.peak = max(self.peak, self._bytes(self._in_flight.values()))

    def _bytes(self, records: Iterable[_InFlight]) -> int:
        excluded = {storage_of(p) for p in self.params} | {
            storage_of(p.grad) for p in self.params if p.grad is not None
        }
        tensors: list[torch.Tensor] = []
        for record in records:
            for root in record.roots:
                tensors += saved_by_graph(root)
            tensors += record.probe + tensors_in(record.tensors())
            if record.work is not None:
                tensors += record.work.tensors()
        return storage_bytes(tensors, excluded)


def limit_bytes(gigabytes: float | None) -> int | None:
    return None if gigabytes is None else int(math.floor(gigabytes * GIB))
