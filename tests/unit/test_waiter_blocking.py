"""``Waiter.blocking``, which runs a call that ReCycle does not own (a DeepSpeed or HF save) in a
thread of its own: a failure announced while it runs stops the caller at once, and the abandoned
call goes no further than its next ``Waiter.stop_if_abandoned`` (the point before its next
collective), while a call nobody gave up on runs to its end."""

from __future__ import annotations

import threading
import time

import pytest

from ds_recycle.errors import PeerFailure
from ds_recycle.runtime.rank.waiting import Waiter

WRITE_SECONDS = 0.3
"""How long the test's save 'writes its files' (sleeps, outside Python, as a file write does)."""


def save_then_barrier(writing: threading.Event, passed: list[str], stopped: list[str]) -> str:
    writing.set()
    time.sleep(WRITE_SECONDS)
    try:
        Waiter.stop_if_abandoned("the test's save")
    except PeerFailure as error:
        stopped.append(str(error))
        raise
    passed.append("the barrier")
    return "saved"


def test_a_call_abandoned_while_it_writes_stops_before_its_next_collective():
    waiter = Waiter()
    writing, passed, stopped = threading.Event(), [], []
    flagger = threading.Thread(target=lambda: writing.wait(5) and waiter.failed.set())
    flagger.start()
    began = time.monotonic()
    with pytest.raises(PeerFailure, match="a failure was announced during the test's save"):
        waiter.blocking(lambda: save_then_barrier(writing, passed, stopped), "the test's save")
    assert time.monotonic() - began < WRITE_SECONDS, "the caller does not wait for the write"
    flagger.join()
    deadline = time.monotonic() + 5
    while not stopped and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stopped == ["the test's save: abandoned after a failure was announced"]
    assert passed == [], "the abandoned call reached its next collective"


def test_a_call_nobody_gave_up_on_runs_to_its_end_and_knows_it_is_inside_one():
    waiter = Waiter()
    writing, passed, stopped = threading.Event(), [], []
    inside: list[bool] = []

    def call() -> str:
        inside.append(Waiter.inside_blocking_call())
        return save_then_barrier(writing, passed, stopped)

    assert waiter.blocking(call, "the test's save") == "saved"
    assert (inside, passed, stopped) == ([True], ["the barrier"], [])
    assert not Waiter.inside_blocking_call()
    Waiter.stop_if_abandoned("outside any blocking call")  # a no-op in the caller's thread
