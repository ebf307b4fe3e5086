"""The protocol's records round-trip, and the ones every rank reads at every change stay small."""

from __future__ import annotations

import random

from ds_recycle.runtime import protocol as proto
from ds_recycle.runtime.protocol import Beat, Change, Decision, Lease, Membership


def test_a_membership_round_trips_whatever_its_members():
    rng = random.Random(17)
    for _ in range(200):
        world = rng.randint(0, 300)
        members = tuple(sorted(rng.sample(range(world), rng.randint(0, world))))
        membership = Membership(rng.randint(0, 9), members, rng.randint(0, 99))
        assert Membership.from_json(membership.to_json()) == membership


def test_a_membership_of_thousands_with_a_few_out_is_a_few_numbers():
    members = tuple(slot for slot in range(16384) if slot not in {9, 16, 17, 18, 4000})
    text = Membership(7, members, 120).to_json()
    assert len(text) < 100, text
    assert Membership.from_json(text).members == members


def test_changes_decisions_and_leases_round_trip():
    changes = (
        Change(0, proto.FAILED, 3, 12.5, "signal SIGKILL"),
        Change(1, proto.MOVE, 1, 13.0, "to slot 3", target=3),
    )
    for change in changes:
        assert Change.from_json(change.to_json()) == change
    decision = Decision(2, 40, 2, changes, Membership(3, (0, 2), 40))
    assert Decision.from_json(decision.to_json()) == decision
    lease = Lease(2, 99.5, {4: Beat(99.4, 0.8), 5: Beat(99.3, None, stopped=True)})
    assert Lease.from_json(lease.to_json()) == lease
