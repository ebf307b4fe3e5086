"""The status record (``status``) that the ranks publish and the status page reads: its fields and
its JSON round trip."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

WorkerPair = tuple[int, int]
"""``(pipeline, stage)``, as the planner names a worker."""


def _workers(items) -> tuple[WorkerPair, ...]:
    return tuple((int(p), int(s)) for p, s in items)


@dataclass(frozen=True)
class ChangeReport:
    """One membership change as the ranks logged it (a :class:`~ds_recycle.runtime.shared.events.MembershipChange`)."""

    epoch: int
    iteration: int
    """The first iteration of the new epoch."""
    left: tuple[WorkerPair, ...]
    failed: tuple[WorkerPair, ...]
    joined: tuple[WorkerPair, ...]
    detection_seconds: float | None
    switch_seconds: float
    recovery_seconds: float | None
    """From the failure to running on the new plan (None for a leave or a join)."""
    rolled_back: bool
    time: float

    @classmethod
    def from_dict(cls, data: dict) -> ChangeReport:
        def seconds(value) -> float | None:
            return None if value is None else float(value)

        return cls(
            int(data["epoch"]),
            int(data["iteration"]),
            _workers(data["left"]),
            _workers(data["failed"]),
            _workers(data["joined"]),
            seconds(data["detection_seconds"]),
            float(data["switch_seconds"]),
            seconds(data["recovery_seconds"]),
            bool(data["rolled_back"]),
            float(data["time"]),
        )


@dataclass(frozen=True)
class GanttOp:
    """One op of the plan on worker ``(pipeline, stage)``, from ``start`` to ``end``."""

    pipeline: int
    stage: int
    kind: str
    home: int
    mb: int
    start: float
    end: float

    def to_list(self) -> list:
        return [self.pipeline, self.stage, self.kind, self.home, self.mb, self.start, self.end]

    @classmethod
    def from_list(cls, row: list) -> GanttOp:
        p, s, kind, home, mb, start, end = row
        return cls(int(p), int(s), str(kind), int(home), int(mb), float(start), float(end))


@dataclass(frozen=True)
class PlanReport:
    """The plan the members run: its predicted iteration time against fault-free and the lower
    bound (in ``unit``), the workers it routes around, and its Gantt chart."""

    plan_id: str
    unit: str
    """``ms`` for a cost model of measured (or emulated) durations, ``cost units`` before one."""
    failed: tuple[WorkerPair, ...]
    slow: tuple[tuple[int, int, float], ...]
    """Stragglers the plan routes around: ``(pipeline, stage, factor)``."""
    predicted_iteration_time: float
    fault_free_iteration_time: float
    lower_bound: float
    rerouted_microbatches: int
    gantt: tuple[GanttOp, ...]
    gantt_omitted: int = 0
    """Ops left out of ``gantt`` to keep the record small (the last workers' ops)."""

    @classmethod
    def from_dict(cls, data: dict) -> PlanReport:
        return cls(
            str(data["plan_id"]),
            str(data["unit"]),
            _workers(data["failed"]),
            tuple((int(p), int(s), float(f)) for p, s, f in data["slow"]),
            float(data["predicted_iteration_time"]),
            float(data["fault_free_iteration_time"]),
            float(data["lower_bound"]),
            int(data["rerouted_microbatches"]),
            tuple(GanttOp.from_list(row) for row in data["gantt"]),
            int(data.get("gantt_omitted", 0)),
        )


@dataclass(frozen=True)
class StatusReport:
    """What the ranks publish for the status page (``status``): written at start, at every
    membership change and at every change of the plan's cost model, by one member (the lowest
    that ran the change), which carries the previous record's changes over."""

    epoch: int
    iteration: int
    pipelines: int
    stages: int
    microbatches: int
    samples_per_iteration: int
    workers: tuple[WorkerPair, ...]
    """Each slot's worker, by slot."""
    plan: PlanReport
    changes: tuple[ChangeReport, ...]
    """The last few, oldest first."""
    writer: int
    time: float

    def to_json(self) -> str:
        data = asdict(self)
        data["plan"]["gantt"] = [op.to_list() for op in self.plan.gantt]
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> StatusReport:
        data = json.loads(text)
        return cls(
            int(data["epoch"]),
            int(data["iteration"]),
            int(data["pipelines"]),
            int(data["stages"]),
            int(data["microbatches"]),
            int(data["samples_per_iteration"]),
            _workers(data["workers"]),
            PlanReport.from_dict(data["plan"]),
            tuple(ChangeReport.from_dict(c) for c in data["changes"]),
            int(data["writer"]),
            float(data["time"]),
        )
