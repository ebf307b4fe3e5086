"""A left world's process groups are kept until every op on them has timed out, then released."""

from __future__ import annotations

import gc
import weakref

import pytest

from ds_recycle.runtime.groups import (
    GROUP_TIMEOUT_SECONDS,
    GROUP_TIMEOUT_VARIABLE,
    Graveyard,
    group_timeout,
    release,
)
from ds_recycle.testing.rebuild import measure_epochs


class Group:
    """Stands for a process group: an object only the graveyard keeps alive."""


def test_a_left_world_is_released_after_the_keep_time_by_a_thread_of_its_own():
    graveyard = Graveyard(keep_seconds=10.0)
    first, second = Group(), Group()
    alive = [weakref.ref(first), weakref.ref(second)]
    graveyard.bury([first])
    graveyard.world_left(now=100.0)
    graveyard.bury([second])  # the next world's, still in use
    del first, second

    assert graveyard.take_expired(now=109.9) == []
    assert alive[0]() is not None and graveyard.worlds_kept == 1
    expired = graveyard.take_expired(now=110.0)
    assert [ref() for ref in alive[:1]] == expired and graveyard.worlds_kept == 0
    del expired[:]
    gc.collect()
    assert alive[0]() is not None, "taken out of the graveyard, it still holds its extra reference"

    first = alive[0]()
    objects = [first]
    del first
    release(objects, "in the test").join(timeout=10)
    gc.collect()
    assert alive[0]() is None, "the left world's group outlived its release"
    assert alive[1]() is not None, "the current world's group was released while in use"


def test_a_left_group_something_else_still_holds_stays_until_it_is_the_last_holder():
    graveyard = Graveyard(keep_seconds=1.0)
    held = Group()
    alive = weakref.ref(held)
    graveyard.bury([held])
    graveyard.world_left(now=0.0)

    assert graveyard.take_expired(now=5.0) == [], "the engine's old grid still holds it"
    assert graveyard.worlds_kept == 1
    del held
    gc.collect()
    expired = graveyard.take_expired(now=6.0)
    assert len(expired) == 1 and expired[0] is alive()
    release(expired, "in the test").join(timeout=10)
    gc.collect()
    assert alive() is None and graveyard.released == 1


def test_the_group_timeout_comes_from_the_environment_and_bad_values_are_named():
    assert group_timeout({}) == GROUP_TIMEOUT_SECONDS
    assert group_timeout({GROUP_TIMEOUT_VARIABLE: ""}) == GROUP_TIMEOUT_SECONDS
    assert group_timeout({GROUP_TIMEOUT_VARIABLE: "7.5"}) == 7.5
    for bad in ("0", "-3", "soon", "nan", "1e9"):
        with pytest.raises(
            ValueError, match=rf"{GROUP_TIMEOUT_VARIABLE}='{bad}': must be a number of seconds from 1 to 86400"
        ):
            group_timeout({GROUP_TIMEOUT_VARIABLE: bad})


@pytest.mark.multiprocess
def test_ranks_going_through_many_epochs_hold_a_bounded_number_of_threads_and_sockets(monkeypatch):
    # A 3 s group timeout (1 s timed out a lazy connection under the suite's load): a left world is
    # kept 6 s, so epochs of at least 0.5 s keep at most 12 left worlds.
    monkeypatch.setenv(GROUP_TIMEOUT_VARIABLE, "3")
    epochs = 24
    rows = measure_epochs(pp=2, dp=2, epochs=epochs, seconds=0.5)

    assert sorted(rows) == [0, 1, 2], "every survivor reports (the last slot ends after epoch 1)"
    for slot, resources in rows.items():
        assert [r.epoch for r in resources] == list(range(2, epochs + 1))
        kept = [r.worlds_kept for r in resources]
        assert max(kept) <= 12 + 2 and kept[-1] < epochs - 2, (slot, kept)  # + the one just left, + one still held
        # One epoch adds about 11 threads and 19 descriptors to a rank while nothing is released.
        assert resources[-1].threads - resources[13].threads < 8, (slot, [r.threads for r in resources])
        assert resources[-1].descriptors - resources[13].descriptors < 12, (slot, [r.descriptors for r in resources])
    store = [r.store_descriptors for r in rows[0]]
    assert store[-1] - store[13] < 3, f"the store's connections grew with the epochs: {store}"
