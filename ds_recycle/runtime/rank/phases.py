"""The phases of a rank's membership protocol, and the table of the transitions between them.

:class:`~ds_recycle.runtime.rank.recovery.RankRuntime` enters every phase through one
:class:`PhaseTracker`, which checks the move against :data:`TRANSITIONS`: a move the table does not
allow is a bug in ds_recycle (:class:`~ds_recycle.errors.PhaseError`), never a failure to recover from.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from ds_recycle.errors import PhaseError


class Phase(enum.Enum):
    """Where a rank stands in the membership protocol (:data:`TRANSITIONS` is the table):

    - ``STARTING`` -> ``TRAINING`` (a first start: heartbeat, failure watcher, leave signals) or
      ``JOINING`` (a respawned process, waiting to be admitted).
    - ``JOINING`` -> ``ENTERING`` once a decision admitted it. A failure announced among the members
      before its state arrived: ``LEFT`` (it gives up its join, exit 77, and the launcher respawns
      it); an epoch superseded while entering (a failure among the members): ``ENTERING`` the next.
    - ``TRAINING`` -> ``DECIDING`` at every iteration boundary; -> ``RECOVERING`` when a peer
      failure interrupts the iteration (or an evaluation); -> ``LEFT`` when a helper process died.
    - ``DECIDING`` -> ``TRAINING`` (no change), ``ENTERING`` (members changed), ``LEFT`` (this
      slot left) or ``RECOVERING`` (a failure while deciding).
    - ``RECOVERING`` -> ``ENTERING`` (the survivors agreed on the restart iteration and this rank
      rolled back to it) or ``LEFT`` (this slot's leave was decided with the failure).
    - ``ENTERING`` -> ``BUILDING`` once every member counted itself in: the world and the groups
      are made (they connect lazily, in ops waited for against the failure flag), joiners get
      their state.
    - ``BUILDING`` -> ``TRAINING``. ``ENTERING`` or ``BUILDING`` -> ``RECOVERING`` when a failure
      interrupts it.
    - any phase but ``LEFT`` -> ``STOPPED`` when a stage has no live worker left (or the plan of a
      failure set cannot fit in memory). ``LEFT`` and ``STOPPED`` end the process.
    """

    STARTING = "starting"
    JOINING = "joining"
    TRAINING = "training"
    DECIDING = "deciding"
    RECOVERING = "recovering"
    ENTERING = "entering"
    BUILDING = "building"
    LEFT = "left"
    STOPPED = "stopped"


TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.STARTING: frozenset({Phase.TRAINING, Phase.JOINING}),
    Phase.JOINING: frozenset({Phase.ENTERING, Phase.LEFT}),
    Phase.TRAINING: frozenset({Phase.DECIDING, Phase.RECOVERING, Phase.LEFT}),
    Phase.DECIDING: frozenset({Phase.TRAINING, Phase.ENTERING, Phase.RECOVERING, Phase.LEFT}),
    Phase.RECOVERING: frozenset({Phase.ENTERING, Phase.LEFT}),
    Phase.ENTERING: frozenset({Phase.BUILDING, Phase.RECOVERING, Phase.ENTERING, Phase.LEFT}),
    Phase.BUILDING: frozenset({Phase.TRAINING, Phase.RECOVERING, Phase.ENTERING, Phase.LEFT}),
    Phase.LEFT: frozenset(),
    Phase.STOPPED: frozenset(),
}
"""The phases each phase may go to, besides ``STOPPED`` (:func:`allowed_after`)."""


class PhaseTracker:
    """One rank's phase, checked at every change, and the listeners told of each change."""

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.phase = Phase.STARTING
        self.listeners: list[Callable[[Phase], None]] = []
        """Called at every phase change (tests and benches park a rank at a phase)."""

    def enter(self, phase: Phase) -> None:
        allowed = allowed_after(self.phase)
        if phase not in allowed:
            raise PhaseError(
                f"slot {self.slot}: {self.phase.name} -> {phase.name} is not in the phase table (from "
                f"{self.phase.name}: {', '.join(sorted(p.name for p in allowed)) or 'none'}); "
                "this is a bug in ds_recycle"
            )
        self.phase = phase
        for listener in self.listeners:
            listener(phase)


def allowed_after(phase: Phase) -> frozenset[Phase]:
    """The phases ``phase`` may go to: its row of :data:`TRANSITIONS`, and ``STOPPED`` from any but ``LEFT``."""
    return TRANSITIONS[phase] | (frozenset() if phase in (Phase.LEFT, Phase.STOPPED) else frozenset({Phase.STOPPED}))
