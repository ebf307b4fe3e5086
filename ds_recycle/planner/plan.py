"""The Plan IR shared by the planner, the simulator, the lowering and the engine.

A plan says, for every live worker ``(pipeline, stage)``, the ordered list of its ops with
their planned start and end times under the cost model it was made with. Routing is implied:
the producer of ``F(h, k, s)``'s input is whichever worker runs ``F(h, k, s - 1)``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

Worker = tuple[int, int]
"""A worker is ``(pipeline, stage)``."""

FORWARD = "F"
BACKWARD_INPUT = "B"
BACKWARD_WEIGHT = "W"
STEP = "S"
OP_KINDS = (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, STEP)


class Op(NamedTuple):
    """One op of a worker. ``S`` concerns a whole stage and has ``home == mb == -1``.

    A named tuple rather than a dataclass: plans hold thousands of ops and a cache hit on a
    relabelled failure set rebuilds all of them, which a tuple does several times faster."""

    kind: str
    home: int
    mb: int
    stage: int
    start: float = 0.0
    end: float = 0.0

    def label(self) -> str:
        if self.kind == STEP:
            return f"S(stage {self.stage})"
        return f"{self.kind}(h={self.home},k={self.mb},s={self.stage})"


@dataclass(frozen=True)
class CostModel:
    """Per-stage durations of F, B and W, the p2p latency between two different workers,
    and the duration of S (the stage's DP all-reduce plus its optimizer step).

    ``slow`` names stragglers: ``(pipeline, stage, factor)``, a worker whose F, B and W each take
    ``factor`` times its stage's duration (S, which waits for the stage's all-reduce, does not
    change). Empty for a model of identical replicas; then the model is that of before stragglers
    (its dict and every cache key are unchanged)."""

    F: tuple[float, ...]
    B: tuple[float, ...]
    W: tuple[float, ...]
    comm: float = 0.0
    step: float = 0.0
    slow: tuple[tuple[int, int, float], ...] = ()

    def __post_init__(self) -> None:
        if not (len(self.F) == len(self.B) == len(self.W)) or not self.F:
            raise ValueError("cost model: F, B and W need one duration per stage, all of the same length")
        for name in ("F", "B", "W"):
            for s, value in enumerate(getattr(self, name)):
                if value < 0:
                    raise ValueError(f"cost model: {name}[{s}] = {value} is negative; durations must be >= 0")
        if self.comm < 0 or self.step < 0:
            raise ValueError(f"cost model: comm={self.comm} and step={self.step} must be >= 0")
        slow = tuple(sorted((int(p), int(s), float(f)) for p, s, f in self.slow))
        seen = set()
        for p, s, f in slow:
            if p < 0 or not 0 <= s < len(self.F) or (p, s) in seen:
                raise ValueError(f"cost model: straggler ({p}, {s}) is outside the stages or named twice")
            if not f > 0:
                raise ValueError(f"cost model: straggler ({p}, {s}) has factor {f}; factors must be > 0")
            seen.add((p, s))
        object.__setattr__(self, "slow", slow)

    @classmethod
    def uniform(
        cls, stages: int, F: float = 1.0, B: float = 1.0, W: float = 1.0, comm: float = 0.0, step: float = 0.0
    ) -> CostModel:
        return cls((F,) * stages, (B,) * stages, (W,) * stages, comm, step)

    @property
    def stages(self) -> int:
        return len(self.F)

    def duration(self, kind: str, stage: int) -> float:
        if kind == STEP:
            return self.step
        return {FORWARD: self.F, BACKWARD_INPUT: self.B, BACKWARD_WEIGHT: self.W}[kind][stage]

    def factor(self, worker: Worker) -> float:
        """How many times its stage's F, B and W durations ``worker``'s take (1 unless it straggles)."""
        for p, s, f in self.slow:
            if (p, s) == worker:
                return f
        return 1.0

    def op_duration(self, kind: str, worker: Worker) -> float:
        """The duration of ``kind`` on ``worker``: its stage's, times the worker's straggler factor."""
        if kind == STEP:
            return self.step
        return self.duration(kind, worker[1]) * self.factor(worker) if self.slow else self.duration(kind, worker[1])

    def stragglers(self) -> dict[Worker, float]:
        return {(p, s): f for p, s, f in self.slow}

    def without_stragglers(self) -> CostModel:
        return CostModel(self.F, self.B, self.W, self.comm, self.step)

    def to_dict(self) -> dict:
        data = {"F": list(self.F), "B": list(self.B), "W": list(self.W), "comm": self.comm, "step": self.step}
        if self.slow:
            data["slow"] = [list(entry) for entry in self.slow]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        slow = tuple(tuple(entry) for entry in data.get("slow", ()))
        return cls(
            tuple(data["F"]), tuple(data["B"]), tuple(data["W"]), data.get("comm", 0.0), data.get("step", 0.0), slow
        )


@dataclass
class Plan:
    """An adapted schedule for one (topology, failure set, costs, memory cap)."""

    pipelines: int
    stages: int
    microbatches: int
    failed: tuple[Worker, ...]
    costs: CostModel
    memory_cap: int
    workers: dict[Worker, list[Op]]
    iteration_time: float = 0.0
    steady_state_period: float = 0.0
    lower_bound: float = 0.0
    solver: str = "heuristic"
    solve_seconds: float = 0.0
    gap: float | None = None
    extra: dict = field(default_factory=dict)

    @property
    def live_workers(self) -> list[Worker]:
        return sorted(self.workers)

    def runners(self) -> dict[tuple[str, int, int, int], Worker]:
        """``(kind, home, mb, stage) -> worker`` for every F, B and W of the plan."""
        return {
            (op.kind, op.home, op.mb, op.stage): worker
            for worker, ops in self.workers.items()
            for op in ops
            if op.kind != STEP
        }

    @property
    def ratio(self) -> float:
        return self.iteration_time / self.lower_bound if self.lower_bound else float("nan")

    def to_dict(self) -> dict:
        return {
            "pipelines": self.pipelines,
            "stages": self.stages,
            "microbatches": self.microbatches,
            "failed": [list(w) for w in self.failed],
            "costs": self.costs.to_dict(),
            "memory_cap": self.memory_cap,
            "workers": {
                f"{p},{s}": [
                    {"op": op.kind, "home": op.home, "mb": op.mb, "start": op.start, "end": op.end} for op in ops
                ]
                for (p, s), ops in sorted(self.workers.items())
            },
            "iteration_time": self.iteration_time,
            "steady_state_period": self.steady_state_period,
            "lower_bound": self.lower_bound,
            "solver": self.solver,
            "solve_seconds": self.solve_seconds,
            "gap": self.gap,
            "extra": self.extra,
        }

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        workers: dict[Worker, list[Op]] = {}
        for key, ops in data["workers"].items():
            p, s = (int(x) for x in key.split(","))
            workers[(p, s)] = [Op(o["op"], o["home"], o["mb"], s, o["start"], o["end"]) for o in ops]
        return cls(
            pipelines=data["pipelines"],
            stages=data["stages"],
            microbatches=data["microbatches"],
            failed=tuple(tuple(w) for w in data["failed"]),
            costs=CostModel.from_dict(data["costs"]),
            memory_cap=data["memory_cap"],
            workers=workers,
            iteration_time=data.get("iteration_time", 0.0),
            steady_state_period=data.get("steady_state_period", 0.0),
            lower_bound=data.get("lower_bound", 0.0),
            solver=data.get("solver", "heuristic"),
            solve_seconds=data.get("solve_seconds", 0.0),
            gap=data.get("gap"),
            extra=data.get("extra", {}),
        )

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=1)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> Plan:
        path = Path(text_or_path)
        text = path.read_text() if not str(text_or_path).lstrip().startswith("{") else str(text_or_path)
        return cls.from_dict(json.loads(text))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Plan) and self.to_dict() == other.to_dict()
