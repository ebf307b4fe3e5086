"""The job store's typed operations on a real TCPStore: the records they write come back, what is
absent reads as None, and a watcher's alert loop yields each new count once and stops when woken."""

from __future__ import annotations

import threading

import pytest

from ds_recycle.runtime.shared import transport
from ds_recycle.runtime.shared.c10d_store import C10dJobStore, C10dStoreRoot
from ds_recycle.runtime.shared.records import FAILED, JOIN, Change, CheckIn, Decision, KillOrder, Membership, Request


@pytest.fixture
def address():
    server = transport.serve("127.0.0.1", 0, timeout=10.0)
    yield f"127.0.0.1:{server.port}"


def test_an_evaluation_is_committed_once_and_read_back(address):
    job = C10dJobStore.connect(address, 0, timeout=10.0)
    assert job.committed_evaluation() is None
    job.commit_evaluation('["0", 1, 4, 2]', 2.5)
    assert job.committed_evaluation() == ('["0", 1, 4, 2]', 2.5)
    assert C10dJobStore.connect(address, 1, timeout=10.0).committed_evaluation() is None, "per generation"


def test_domain_labels_wait_for_every_node(address):
    job = C10dJobStore.connect(address, 0, timeout=10.0)
    job.set_domain(0, "rack-a")
    threading.Timer(0.2, lambda: C10dJobStore.connect(address, 0, timeout=10.0).set_domain(1, "")).start()
    assert job.domain_labels(2, 10.0) == {0: "rack-a", 1: ""}


def test_the_first_proposal_is_the_decision_and_the_epoch_it_makes_is_published_once(address):
    job = C10dJobStore.connect(address, 0, timeout=10.0)
    job.open_job(4, 2)
    assert (job.world_size(), job.node_count(), job.current_epoch()) == (4, 2, 0)
    first = Decision(0, 3, 0, (), Membership(1, (0, 1, 2), 3))
    assert job.propose_decision(first) == first
    assert job.propose_decision(Decision(0, 3, 0, (), Membership(1, (0, 1), 3))) == first
    assert job.decision(0, 3) == first and job.decision(0, 4) is None and job.recovery(0) is None
    for _ in range(2):
        job.publish_epoch(first.next)
    assert job.membership() == first.next and job.current_epoch() == 1


def test_changes_wake_the_nodes_and_a_woken_watcher_stops(address):
    job = C10dJobStore.connect(address, 0, timeout=10.0)
    job.open_job(2)
    seen, stop, counts = [0], threading.Event(), []

    def watch():
        for count in C10dJobStore.connect(address, 0, timeout=10.0).node_alerts(1, lambda: seen[0], stop):
            counts.append(count)
            seen[0] = count

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    changes = [Change(0, FAILED, 1, 1.0, "exited"), Change(1, JOIN, 1, 2.0)]
    assert job.append_changes(0, changes, 2) == 2
    assert job.changes() == changes and job.changes(changes[:1]) == changes
    for _ in range(100):
        if counts:
            break
        threading.Event().wait(0.02)
    stop.set()
    job.wake_node_watch(1, seen[0])
    thread.join(5.0)
    assert not thread.is_alive() and counts == [2]


def test_requests_reports_kills_and_check_ins_read_back_in_order(address):
    job = C10dJobStore.connect(address, 0, timeout=10.0)
    job.open_inboxes()
    assert job.inbox_counts() == (0, 0)
    request = Request(JOIN, 3, "t" * 32, 42, 1.0)
    assert job.post_request(request) == 1
    assert Request.from_json(job.posted_request(1)) == request and job.posted_request(2) is None
    job.order_kill(1, KillOrder(5, 2))
    assert job.kill_count(1) == 1 and job.kill_order(1, 1) == KillOrder(5, 2) and job.kill_order(1, 2) is None
    assert job.node_end(1) is None
    job.end_node(1, 0)
    assert job.node_end(1) == 0
    root = C10dStoreRoot.connect(address, timeout=10.0)
    assert root.running_generation() is None and root.check_in_of(1) is None
    root.check_in(CheckIn(1, 3, "t" * 32))
    assert root.check_in_of(1) == CheckIn(1, 3, "t" * 32)
    root.withdraw_check_in(1)
    assert root.check_in_of(1) is None
