"""The job store's typed operations on a real TCPStore: the records they write come back, what is
absent reads as None, and a watcher's alert loop yields each new count once and stops when woken.
Every record is sealed with the job token: the token is nowhere in the store, and a record written
by a client with another token (a stranger who reached the port) is refused, ignored with one log
line, or stops the reader with an error naming the key, never taken."""

from __future__ import annotations

import logging
import threading

import pytest
import torch.distributed as dist

from ds_recycle.log import logger
from ds_recycle.runtime.shared import keys, transport
from ds_recycle.runtime.shared.c10d_store import C10dJobStore, C10dStoreRoot
from ds_recycle.runtime.shared.records import (
    FAILED,
    JOIN,
    AgentEnd,
    Change,
    CheckIn,
    Decision,
    KillOrder,
    Lease,
    Membership,
    Request,
)
from ds_recycle.runtime.shared.seal import ForgedRecord

TOKEN = "t0k3n-of-the-job-0123456789abcdef"
STRANGER = "not-the-job-token-0123456789abcde"


@pytest.fixture
def address():
    server = transport.serve("127.0.0.1", 0, timeout=10.0)
    yield f"127.0.0.1:{server.port}"


def test_an_evaluation_is_committed_once_and_read_back(address):
    job = C10dJobStore.connect(address, 0, TOKEN, timeout=10.0)
    assert job.committed_evaluation() is None
    job.commit_evaluation('["0", 1, 4, 2]', 2.5)
    assert job.committed_evaluation() == ('["0", 1, 4, 2]', 2.5)
    assert C10dJobStore.connect(address, 1, TOKEN, timeout=10.0).committed_evaluation() is None, "per generation"


def test_domain_labels_wait_for_every_node(address):
    job = C10dJobStore.connect(address, 0, TOKEN, timeout=10.0)
    job.set_domain(0, "rack-a")
    threading.Timer(0.2, lambda: C10dJobStore.connect(address, 0, TOKEN, timeout=10.0).set_domain(1, "")).start()
    assert job.domain_labels(2, 10.0) == {0: "rack-a", 1: ""}


def test_the_first_proposal_is_the_decision_and_the_epoch_it_makes_is_published_once(address):
    job = C10dJobStore.connect(address, 0, TOKEN, timeout=10.0)
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
    job = C10dJobStore.connect(address, 0, TOKEN, timeout=10.0)
    job.open_job(2)
    seen, stop, counts = [0], threading.Event(), []

    def watch():
        for count in C10dJobStore.connect(address, 0, TOKEN, timeout=10.0).node_alerts(1, lambda: seen[0], stop):
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
    job = C10dJobStore.connect(address, 0, TOKEN, timeout=10.0)
    job.open_inboxes()
    assert job.inbox_counts() == (0, 0)
    request = Request(JOIN, 3, 42, 1.0)
    assert job.post_request(request) == 1
    assert Request.from_json(job.posted_request(1)) == request and job.posted_request(2) is None
    job.order_kill(1, KillOrder(5, 2))
    assert job.kill_count(1) == 1 and job.kill_order(1, 1) == KillOrder(5, 2) and job.kill_order(1, 2) is None
    assert job.node_end(1) is None
    job.end_node(1, AgentEnd(2, 0))
    assert job.node_end(1) == AgentEnd(2, 0)
    root = C10dStoreRoot.connect(address, TOKEN, timeout=10.0)
    assert root.running_generation() is None and root.check_in_of(1) is None
    root.check_in(CheckIn(1, 3))
    assert root.check_in_of(1) == CheckIn(1, 3)
    root.withdraw_check_in(1)
    assert root.check_in_of(1) is None


def _raw(address: str, generation: int | None = 0):
    return transport.connect(address, generation, 10.0)


def test_the_token_is_nowhere_in_the_store(address):
    job = C10dJobStore.connect(address, 0, TOKEN, timeout=10.0)
    job.open_job(2)
    job.open_inboxes()
    job.post_request(Request(JOIN, 1, 42, 1.0))
    job.renew_lease(0, Lease(1, 2.0))
    C10dStoreRoot.connect(address, TOKEN, timeout=10.0).check_in(CheckIn(1, -1))
    values = _raw(address, None).multi_get([keys.check_in_key(1)])
    values += _raw(address).multi_get([keys.request_key(1), keys.lease_key(0), keys.epoch_key(0)])
    for value in values:
        assert TOKEN.encode() not in value and b"token" not in value


def test_a_strangers_request_check_in_and_report_are_refused(address):
    job = C10dJobStore.connect(address, 0, TOKEN, timeout=10.0)
    stranger = C10dJobStore.connect(address, 0, STRANGER, timeout=10.0)
    job.open_inboxes()
    stranger.post_request(Request(JOIN, 1, 42, 1.0))
    with pytest.raises(ForgedRecord, match="request 1 is not sealed with this job's token"):
        job.posted_request(1)
    C10dStoreRoot.connect(address, STRANGER, timeout=10.0).check_in(CheckIn(1, 5))
    with pytest.raises(ForgedRecord, match="check-in of node 1"):
        C10dStoreRoot.connect(address, TOKEN, timeout=10.0).check_in_of(1)
    # A sealed record copied under another key (or into another generation) is no longer sealed.
    job.post_request(Request(JOIN, 2, 43, 1.0))
    raw = _raw(address)
    raw.set(keys.request_key(3), raw.get(keys.request_key(2)))
    with pytest.raises(ForgedRecord):
        job.posted_request(3)
    _raw(address, 1).set(keys.request_key(2), raw.get(keys.request_key(2)))
    with pytest.raises(ForgedRecord):
        C10dJobStore.connect(address, 1, TOKEN, timeout=10.0).posted_request(2)


def test_a_strangers_lease_and_kill_order_are_ignored_with_one_line(address):
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger.addHandler(handler)
    try:
        job = C10dJobStore.connect(address, 0, TOKEN, timeout=10.0)
        stranger = C10dJobStore.connect(address, 0, STRANGER, timeout=10.0)
        stranger.renew_lease(1, Lease(7, 1.0))
        stranger.order_kill(1, KillOrder(3, 0))
        for _ in range(3):
            assert job.lease(1) is None and job.leases([1]) == {} and job.kill_order(1, 1) is None
        job.renew_lease(1, Lease(2, 5.0))
        assert job.leases([1]) == {1: Lease(2, 5.0)}
    finally:
        logger.removeHandler(handler)
    assert len(lines) == 2, lines
    assert all("not sealed with this job's token" in line for line in lines)


def test_a_strangers_change_or_decision_stops_the_reader_with_the_key(address):
    job = C10dJobStore.connect(address, 0, TOKEN, timeout=10.0)
    stranger = C10dJobStore.connect(address, 0, STRANGER, timeout=10.0)
    job.open_job(4)
    stranger.append_changes(0, [Change(0, FAILED, 2, 1.0, "forged")], 1)
    with pytest.raises(ForgedRecord, match="'change/0'"):
        job.changes()
    forged = Decision(0, 3, 0, (), Membership(1, (0, 1), 3))
    assert stranger.propose_decision(forged) == forged
    with pytest.raises(ForgedRecord, match="decision/0/3"):
        job.propose_decision(Decision(0, 3, 0, (), Membership(1, (0, 1, 2, 3), 3)))


def test_a_reader_without_the_token_reads_unchecked_and_cannot_write():
    store = C10dJobStore(dist.HashStore(), None, 0)
    C10dJobStore(store.client, TOKEN, 0).open_job(3)
    assert store.membership() == Membership(0, (0, 1, 2), 0)
    with pytest.raises(PermissionError, match="without the job token"):
        store.open_job(3)
