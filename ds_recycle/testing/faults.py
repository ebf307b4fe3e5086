"""Fault injection from inside a rank: park at an exact point of an iteration, so that a signal
sent from outside (by a test or a benchmark) lands exactly there while the rank's peers wait on it.

Points: ``F``, ``B``, ``W`` (before the iteration's first instruction of that kind), ``allreduce``
(before the data-parallel all-reduce), ``loss`` (the last stage: before its loss all-reduce, after
the data-parallel one and before its optimizer step), ``stepped`` (right after the stage's StaggeredStep),
``recovery`` (when the rank's runtime enters ``Phase.RECOVERING``, at or after the iteration),
``building`` (when it enters ``Phase.BUILDING``: every member of the new epoch counted itself in,
no group of it exists yet; at or after the iteration) and
``checkpoint`` (inside DeepSpeed's ``save_checkpoint`` after its first barrier, before this rank
writes its files; the iteration is the one just finished).

Traps come from the rank's command line (``SLOT:POINT:ITERATION[:until-failure]``, see :meth:`Trap.parse`) or from
a file the driver rewrites while the job runs (``out/trap<slot>``: ``POINT:ITERATION:TOKEN[:stay]``,
re-read at every boundary by :meth:`FaultPlan.refresh`). A parked rank writes ``out/trapped<slot>``
(a file trap: ``out/trapped<slot>.<TOKEN>``) and waits; each trap fires once. A rank parked at a
command-line trap, or at a file trap marked ``stay``, stays parked when it is asked to leave
(SIGTERM), so that the driver can kill a leaver before its boundary; at other file traps it stops
parking and goes on to its boundary. A command-line trap marked ``until-failure`` also stops
parking once the rank's failure watcher has raised its flag: it holds a rank back from an exchange
(a joiner's state transfer) until another rank's failure is announced, whatever the timing.

Only the given engine instance is changed: the wrappers shadow its instruction map and its
``allreduce_bucket``, ``aggregate_last_stage_loss`` and ``_save_checkpoint``, and a listener is
added to its runtime's ``phase_listeners``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

POINTS = ("F", "B", "W", "allreduce", "loss", "stepped", "recovery", "building", "checkpoint")
AT_OR_AFTER = ("recovery", "building")
"""Points armed from their iteration on (they happen only when the membership changes)."""
UNTIL_FAILURE = "until-failure"
PARK_SECONDS = 120.0
"""A parked rank goes on by itself after this long (the driver's signal normally ends it first)."""


@dataclass(frozen=True)
class Trap:
    point: str
    iteration: int
    token: str = ""
    """Names a file trap's ``trapped`` file; "" for a command-line trap."""
    release_on_leave: bool = False
    """A SIGTERM (the rank is asked to leave) ends the parking."""
    until_failure: bool = False
    """An announced failure (the rank's failure flag) ends the parking."""

    def __post_init__(self) -> None:
        if self.point not in POINTS:
            raise ValueError(f"a trap's point must be one of {POINTS}, got {self.point!r}")

    @classmethod
    def parse(cls, text: str) -> tuple[int, Trap]:
        """``SLOT:POINT:ITERATION[:until-failure]`` (a rank script's ``--trap``): the slot and its trap."""
        slot, point, iteration, *mode = text.split(":")
        if mode not in ([], [UNTIL_FAILURE]):
            raise ValueError(f"a trap's mode must be {UNTIL_FAILURE!r} or absent, got {':'.join(mode)!r} in {text!r}")
        return int(slot), cls(point, int(iteration), until_failure=bool(mode))

    @classmethod
    def read(cls, path: Path) -> Trap | None:
        """The trap in ``path`` (``POINT:ITERATION:TOKEN[:stay]``), or None if there is none."""
        try:
            point, iteration, token, *mode = path.read_text().strip().split(":")
        except (FileNotFoundError, ValueError):
            return None
        return cls(point, int(iteration), token, release_on_leave=mode != ["stay"])

    def armed(self, point: str, iteration: int) -> bool:
        if point != self.point:
            return False
        return iteration >= self.iteration if point in AT_OR_AFTER else iteration == self.iteration


class FaultPlan:
    """The traps of one rank (see the module docstring).

    ``save`` is called before the rank parks, so that a rank killed there leaves its records."""

    def __init__(
        self,
        engine: Any,
        out: Path,
        slot: int,
        save: Callable[[], None],
        traps: list[Trap] | None = None,
        trap_file: bool = False,
    ) -> None:
        self.engine, self.out, self.slot, self.save = engine, out, slot, save
        self.static = list(traps or [])
        self.trap_file = trap_file
        self.requested: Trap | None = None
        self.fired: set[Trap] = set()
        points = set(POINTS) if trap_file else {trap.point for trap in self.static}
        if points:
            self._install(points)

    def refresh(self) -> None:
        """Re-read the trap file (at an iteration boundary)."""
        if self.trap_file:
            self.requested = Trap.read(self.out / f"trap{self.slot}")

    def _traps(self) -> list[Trap]:
        return self.static + ([self.requested] if self.requested is not None else [])

    def _check(self, point: str) -> None:
        for trap in self._traps():
            if trap not in self.fired and trap.armed(point, self.engine.global_steps):
                self._park(trap)
                return

    def _park(self, trap: Trap) -> None:
        self.fired.add(trap)
        self.save()
        name = f"trapped{self.slot}" + (f".{trap.token}" if trap.token else "")
        partial = self.out / f"{name}.partial"
        partial.write_text(json.dumps({"point": trap.point, "iteration": trap.iteration, "time": time.time()}))
        os.replace(partial, self.out / name)
        deadline = time.monotonic() + PARK_SECONDS
        while time.monotonic() < deadline and not (trap.release_on_leave and _leave_requested()):
            if trap.until_failure and self.engine.waiter.failed.is_set():
                return
            time.sleep(0.005)

    def _install(self, points: set[str]) -> None:
        from ds_recycle.planner.actions import BackwardInput, BackwardWeight, ForwardPass, StaggeredStep
        from ds_recycle.runtime.rank.phases import Phase

        engine = self.engine

        def after(point: str, run: Callable) -> Callable:
            def trapped(owner, *args, **kwargs):
                result = run(owner, *args, **kwargs)
                self._check(point)
                return result

            return trapped

        table = dict(engine._INSTRUCTION_MAP)
        for point, kind in (("F", ForwardPass), ("B", BackwardInput), ("W", BackwardWeight)):
            if point in points:
                table[kind] = self._checked_first(point, table[kind])
        if "stepped" in points:
            table[StaggeredStep] = after("stepped", table[StaggeredStep])
        engine._INSTRUCTION_MAP = table
        for point, method in (
            ("allreduce", "allreduce_bucket"),
            ("loss", "aggregate_last_stage_loss"),
            ("checkpoint", "_save_checkpoint"),
        ):
            if point in points:
                setattr(engine, method, self._checked_first(point, getattr(engine, method)))
        for point, phase in (("recovery", Phase.RECOVERING), ("building", Phase.BUILDING)):
            if point in points:
                engine.runtime.phase_listeners.append(
                    lambda entered, point=point, phase=phase: self._check(point) if entered is phase else None
                )

    def _checked_first(self, point: str, run: Callable) -> Callable:
        """``run`` (an instruction's function or an engine's bound method), after the trap check of
        ``point``."""

        def trapped(*args, **kwargs):
            self._check(point)
            return run(*args, **kwargs)

        return trapped


def _leave_requested() -> bool:
    from ds_recycle.runtime.rank.distributed import membership_agent

    agent = membership_agent()
    return agent is not None and agent.leave_requested
