"""Instruction events and timing emulation.

Every instruction the engine runs is recorded as an event with wall-clock start and end (on one
host, ``time.time()`` is comparable across ranks). With ``recycle.emulate_timing`` set, F, B and W
(and a fused stock backward, as B + W) are padded by sleeping until their configured duration,
so that a few CPU cores can stand in for parallel devices.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from deepspeed.runtime.pipe import schedule

from ds_recycle.config import TimingEmulation
from ds_recycle.instructions import BackwardInput, BackwardWeight, ForwardPass

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


def pad_to(instruction, started: float, emulation: TimingEmulation | None) -> None:
    """Sleep until ``instruction`` has taken its emulated duration since ``started``."""
    if emulation is None:
        return
    kind = _PADDED_KIND.get(type(instruction))
    if kind is None:
        return
    remaining = emulation.seconds(kind) - (time.time() - started)
    if remaining > 0:
        time.sleep(remaining)


def event_of(instruction, started: float, ended: float) -> InstructionEvent:
    kwargs = instruction.kwargs
    return InstructionEvent(instruction.name, kwargs.get("home", -1), kwargs.get("mb", -1), started, ended)
