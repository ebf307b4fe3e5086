"""The protocol's records round-trip, and the ones every rank reads at every change stay small."""

from __future__ import annotations

import random

from ds_recycle.runtime.shared.policy import groups_to_remake
from ds_recycle.runtime.shared.records import FAILED, MOVE, Beat, Change, Decision, Lease, Membership, Progress


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
        Change(0, FAILED, 3, 12.5, "signal SIGKILL"),
        Change(1, MOVE, 1, 13.0, "to slot 3", target=3),
    )
    for change in changes:
        assert Change.from_json(change.to_json()) == change
    decision = Decision(2, 40, 2, changes, Membership(3, (0, 2), 40))
    assert Decision.from_json(decision.to_json()) == decision
    lease = Lease(2, 99.5, {4: Beat(99.4, 0.8), 5: Beat(99.3, None, stopped=True)})
    assert Lease.from_json(lease.to_json()) == lease


def test_progress_and_a_decision_with_the_roles_it_remakes_round_trip():
    progress = Progress(7, True, 3, {"stage1": (2, 40), "pipe0": (3, 0)})
    assert Progress.from_json(progress.to_json()) == progress
    for remade in (None, (), ("pipe2", "stage1")):
        decision = Decision(2, 40, 2, (), Membership(3, (0, 2), 40), remade)
        assert Decision.from_json(decision.to_json()) == decision


def roles(slot: int) -> tuple[str, ...]:
    """Stage x 3 + pipeline, as DeepSpeed's pipe-data topology numbers slots with D = 3."""
    return f"stage{slot // 3}", f"pipe{slot % 3}"


def agreeing(slots, epoch: int = 1) -> dict[int, Progress]:
    return {s: Progress(4, False, epoch, {r: (1, 10) for r in roles(s)}) for s in slots}


def test_a_decider_without_roles_remakes_every_group():
    assert groups_to_remake({5}, None) is None


def test_the_roles_of_changed_slots_are_remade_and_agreeing_survivors_keep_the_rest():
    assert groups_to_remake({5}, roles) == ("pipe2", "stage1")
    assert groups_to_remake({5}, roles, 1, agreeing(range(5)), tuple(range(5))) == ("pipe2", "stage1")
    assert groups_to_remake({0, 6}, roles) == ("pipe0", "stage0", "stage2")


def test_a_group_whose_survivors_posted_different_collectives_is_remade():
    posts = agreeing(range(5))
    posts[0] = Progress(4, False, 1, {"stage0": (1, 11), "pipe0": (1, 10)})
    assert groups_to_remake({5}, roles, 1, posts, tuple(range(5))) == ("pipe2", "stage0", "stage1")
    posts[0] = Progress(4, False, 1, {"stage0": (2, 10), "pipe0": (1, 10)})  # made in another epoch
    assert groups_to_remake({5}, roles, 1, posts, tuple(range(5))) == ("pipe2", "stage0", "stage1")


def test_a_survivor_on_another_epochs_grid_and_a_member_without_a_post_have_their_roles_remade():
    posts = agreeing(range(5))
    posts[4] = Progress(4, False, 0, posts[4].groups)  # stopped while it entered epoch 1
    assert groups_to_remake({5}, roles, 1, posts, tuple(range(5))) == ("pipe1", "pipe2", "stage1")
    del posts[4]  # a member of the next epoch that posted nothing
    assert groups_to_remake({5}, roles, 1, posts, tuple(range(5))) == ("pipe1", "pipe2", "stage1")
