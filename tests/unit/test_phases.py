"""The phase table of a rank's runtime: every documented move is allowed, anything else is a bug."""

import itertools

import pytest

from ds_recycle.errors import PhaseError
from ds_recycle.runtime.rank.phases import TRANSITIONS, Phase, PhaseTracker, allowed_after

FIRST_START = [Phase.TRAINING, Phase.DECIDING, Phase.TRAINING, Phase.RECOVERING, Phase.ENTERING, Phase.BUILDING]
"""A first start, one boundary without change, a failure recovered."""
JOIN_SUPERSEDED = [Phase.JOINING, Phase.ENTERING, Phase.ENTERING, Phase.BUILDING, Phase.TRAINING]
"""A joiner whose first epoch was superseded while it entered."""
RECOVERY_INTERRUPTED = [Phase.TRAINING, Phase.RECOVERING, Phase.ENTERING, Phase.RECOVERING, Phase.ENTERING]


@pytest.mark.parametrize("walk", [FIRST_START, JOIN_SUPERSEDED, RECOVERY_INTERRUPTED])
def test_the_walks_of_the_protocol_are_in_the_table_and_reach_the_listeners(walk):
    tracker = PhaseTracker(slot=3)
    seen = []
    tracker.listeners.append(seen.append)
    for phase in walk:
        tracker.enter(phase)
    assert seen == walk and tracker.phase is walk[-1]


def test_every_phase_but_the_ends_may_stop_and_nothing_follows_an_end():
    for phase in Phase:
        assert (Phase.STOPPED in allowed_after(phase)) == (phase not in (Phase.LEFT, Phase.STOPPED))
    assert not allowed_after(Phase.LEFT) and not allowed_after(Phase.STOPPED)
    assert set(TRANSITIONS) == set(Phase)


@pytest.mark.parametrize(
    "before, after",
    [(a, b) for a, b in itertools.product(Phase, Phase) if b not in allowed_after(a)],
)
def test_a_move_outside_the_table_is_named_as_a_bug(before, after):
    tracker = PhaseTracker(slot=5)
    tracker.phase = before
    with pytest.raises(PhaseError, match=rf"slot 5: {before.name} -> {after.name} is not in the phase table.*a bug"):
        tracker.enter(after)
    assert tracker.phase is before
