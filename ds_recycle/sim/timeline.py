"""Replay node events against a system: piecewise-constant throughput over wall time.

A system answers every change of its nodes with a list of :class:`Phase` (a pause, a slowed
stretch, ...) ending in its steady rate (an infinite phase). When the next change comes while
pauses are still pending, the pending pauses are kept and the new phases follow them; the steady
rate is replaced. A system with ``cancels_pending = True`` answers with every phase from the change
on instead (what it keeps of its pending ones included): checkpoint-restart, whose restart and redo
a new failure cancels. Lost work (an iteration rolled back, the work since a checkpoint) is a phase at
rate 0 of the lost duration: it is done again and yields no new sample.

Time is conserved: every second of ``[0, horizon)`` is spent in exactly one phase, so
``samples = sum(duration x rate)`` over the run's segments and ``downtime`` is the time at rate 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Event:
    time: float
    """Seconds from the start."""
    kind: str
    """``add`` or ``remove``."""
    node: str


@dataclass(frozen=True)
class Phase:
    duration: float
    """Seconds; ``math.inf`` for the steady phase that ends a list."""
    rate: float
    """Samples per second."""
    what: str = "run"


class System(Protocol):
    name: str
    notes: list[str]

    def start(self, nodes: Sequence[str]) -> list[Phase]: ...

    def change(self, now: float, removed: Sequence[str], added: Sequence[str]) -> list[Phase]: ...


@dataclass
class Run:
    """One system over one event sequence."""

    name: str
    duration: float
    samples: float = 0.0
    downtime: float = 0.0
    """Seconds at rate 0 (pauses, lost work, waiting, out of memory)."""
    segments: list[tuple[float, float, float]] = field(default_factory=list)
    """(start, end, samples/s), times from the start of the replay; contiguous."""
    pauses: dict[str, float] = field(default_factory=dict)
    """Seconds spent in each kind of phase other than the steady run."""
    notes: list[str] = field(default_factory=list)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.duration if self.duration > 0 else 0.0

    def to_dict(self, segments: bool = False) -> dict:
        out = {
            "samples_per_s": self.samples_per_s,
            "samples": self.samples,
            "downtime_s": self.downtime,
            "pauses_s": dict(sorted(self.pauses.items())),
            "notes": _summarize(self.notes),
        }
        if segments:
            out["segments"] = [list(s) for s in self.segments]
        return out


class CheckpointClock:
    """When a system last checkpointed: running time since then is the work a restart loses.

    A checkpoint starts every ``interval`` seconds of running time (its blocking cost is part of
    the interval and is charged as the rate factor ``1 - cost/interval``); ``offset`` is the
    running time since the last checkpoint at the start. Pauses do not count as running time."""

    def __init__(self, interval: float, offset: float = 0.0):
        self.interval = interval
        self.offset = offset
        self.running_since = 0.0
        """Wall time at which the current running stretch began (after its pauses)."""
        self.banked = offset
        """Running time since the last checkpoint, accumulated before ``running_since``."""

    def lost(self, now: float) -> float:
        """Running seconds since the last completed checkpoint, at ``now`` (at most one interval)."""
        run = max(0.0, now - self.running_since)
        return (self.banked + run) % self.interval

    def roll_back(self, now: float, restart_s: float) -> float:
        """A failure at ``now``: the job restarts (``restart_s`` from ``now``, cancelling any restart
        or redo still under way) and redoes the running time since the last checkpoint, which it
        returns. The redo counts towards the next checkpoint, so a failure during the restart or the
        redo loses the same work again."""
        owed = self.lost(now)
        self.banked = owed
        self.running_since = now + restart_s + owed
        return owed

    def pause(self, now: float, seconds: float, restart: bool) -> None:
        """``seconds`` of pauses begin at ``now`` (after any still pending); ``restart``: the state
        rolls back to the last checkpoint, so the running time since it starts again at 0."""
        self.banked = 0.0 if restart else self.lost(now)
        self.running_since = max(now, self.running_since) + seconds


def group_events(events: Iterable[Event]) -> list[tuple[float, list[str], list[str]]]:
    """(time, removed, added) per distinct time, in time order."""
    groups: dict[float, tuple[list[str], list[str]]] = {}
    for e in sorted(events, key=lambda e: e.time):
        removed, added = groups.setdefault(e.time, ([], []))
        (removed if e.kind == "remove" else added).append(e.node)
    return [(t, r, a) for t, (r, a) in groups.items()]


def replay(system: System, initial: Sequence[str], events: Iterable[Event], horizon: float) -> Run:
    """Run ``system`` from time 0 with ``initial`` nodes, apply ``events`` (times in seconds from
    0) until ``horizon``."""
    run = Run(system.name, horizon)
    pending = system.start(list(initial))
    now = 0.0
    for time, removed, added in group_events(events):
        if time >= horizon:
            break
        pending = _advance(run, pending, now, time)
        now = time
        if getattr(system, "cancels_pending", False):
            pending = system.change(now, removed, added)
        else:
            pending = pending[:-1] + system.change(now, removed, added)
    _advance(run, pending, now, horizon)
    run.notes = list(getattr(system, "notes", []))
    return run


def _advance(run: Run, phases: list[Phase], now: float, until: float) -> list[Phase]:
    """Spend [now, until) on ``phases``; return what is left of them (always ends in the steady
    phase)."""
    left = list(phases)
    while now < until and left:
        phase = left[0]
        span = min(phase.duration, until - now)
        if span > 0:
            run.samples += span * phase.rate
            if phase.rate == 0:
                run.downtime += span
            if phase.what != "run":
                run.pauses[phase.what] = run.pauses.get(phase.what, 0.0) + span
            if run.segments and run.segments[-1][2] == phase.rate and run.segments[-1][1] == now:
                run.segments[-1] = (run.segments[-1][0], now + span, phase.rate)
            else:
                run.segments.append((now, now + span, phase.rate))
        now += span
        if math.isinf(phase.duration) or span < phase.duration:
            left[0] = Phase(phase.duration - span, phase.rate, phase.what)
            if math.isinf(phase.duration):
                break
        else:
            left.pop(0)
    if not left or not math.isinf(left[-1].duration):
        left.append(Phase(math.inf, 0.0, "idle"))
    return left


def _summarize(notes: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for note in notes:
        counts[note] = counts.get(note, 0) + 1
    return dict(sorted(counts.items()))
