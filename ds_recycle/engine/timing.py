"""Instruction events and timing emulation.

Every instruction the engine runs is recorded as an event with wall-clock start and end (on one
host, ``time.time()`` is comparable across ranks). With ``recycle.emulate_timing`` set, F, B and W
(and a fused stock backward, as B + W) are padded by sleeping until their configured duration,
so that a few CPU cores can stand in for parallel devices; a straggler of
``emulate_timing.slowdown`` is padded to its factor times that.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from deepspeed.runtime.pipe import schedule

from ds_recycle.config import TimingEmulation
from ds_recycle.planner.actions import BackwardInput, BackwardWeight, ForwardPass

_PADDED_KIND = {
    ForwardPass: "F",
    schedule.ForwardPass: "F",
    BackwardInput: "B",
    BackwardWeight: "W",
    schedule.BackwardPass: "BW",
}


@dataclass(frozen=True)
class InstructionEvent:
    name: str
    home: int
    mb: int
    start: float
    end: float


def pad_to(instruction, started: float, emulation: TimingEmulation | None, worker: tuple[int, int] = (0, 0)) -> None:
    """Sleep until ``instruction`` has taken its emulated duration since ``started``: its stage's
    F, B or W, and for a worker of ``emulation.slowdown`` ``factor`` times the longer of that and
    the op's real duration. ``worker`` is ``(pipeline, stage)``."""
    if emulation is None:
        return
    kind = _PADDED_KIND.get(type(instruction))
    if kind is None:
        return
    elapsed = time.time() - started
    target = emulation.seconds(kind, worker[1])
    factor = emulation.factor(*worker)
    if factor != 1.0:
        target = factor * max(target, elapsed)
    remaining = target - elapsed
    if remaining > 0:
        time.sleep(remaining)


def event_of(instruction, started: float, ended: float) -> InstructionEvent:
    kwargs = instruction.kwargs
    return InstructionEvent(instruction.name, kwargs.get("home", -1), kwargs.get("mb", -1), started, ended)
