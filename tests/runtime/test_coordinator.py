"""The coordinator against a real TCPStore, without rank processes: requests, exits, heartbeats.

The launcher's side (starts, exits, the kill callback) is played by the test; the trainers' side
(requests, epochs) by a store client, as runtime/shared/keys.py describes it, and their heartbeats (with their
iteration times) by beat files in the node's beat directory.
Then the node's watch (``NodeWatch``: the node's store, with its copy of the changes) and the
trainers' failure watchers on it. At the end, a node's agent link (``NodeLink``) against the same
kind of store: its lease, the kill orders for its node, and its fence.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta

import psutil
import pytest
import torch.distributed as dist

from ds_recycle.runtime.control.coordinator import UNSEALED, Coordinator, HeartbeatPolicy, NodeLayout, RankExit
from ds_recycle.runtime.node.link import KILL_CHECK_SECONDS, NodeLink
from ds_recycle.runtime.node.node_watch import NodeWatch
from ds_recycle.runtime.shared import keys, records, transport
from ds_recycle.runtime.shared.beats import write_beat
from ds_recycle.runtime.shared.c10d_store import C10dJobStore
from ds_recycle.runtime.shared.policy import moves_under_way, retired_slots
from ds_recycle.runtime.shared.records import KillOrder, Membership, Request

TOKEN = "a" * 32
WORLD = 4


class Harness:
    def __init__(self, policy: HeartbeatPolicy, nodes: NodeLayout | None = None) -> None:
        self.server = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
        )
        self.raw = dist.PrefixStore(keys.prefix(0), self.server)
        """The job's keys on the wire, for what a test checks there."""
        self.store = C10dJobStore(self.raw, TOKEN, 0)
        self.store.open_job(WORLD)
        self.lines: list[str] = []
        self._node_watch: NodeWatch | None = None
        self.events: list[dict] = []
        self.killed: list[tuple[int, int]] = []
        self.beats_dir = tempfile.mkdtemp(prefix="ds_recycle_test_beats_")
        self.coordinator = Coordinator(
            f"127.0.0.1:{self.server.port}",
            0,
            WORLD,
            TOKEN,
            log=self.lines.append,
            kill=lambda slot, incarnation: self.killed.append((slot, incarnation)),
            policy=policy,
            events=lambda event, **fields: self.events.append({"event": event, **fields}),
            beats_dir=self.beats_dir,
            nodes=nodes,
        )
        self.started = time.time()
        for slot in range(WORLD):
            self.coordinator.rank_started(slot, 0, self.started)
        self.coordinator.start()

    def beat(self, slot: int, when: float, iteration_seconds: float | None = None) -> None:
        write_beat(self.beats_dir, slot, records.Beat(when, iteration_seconds))

    def node_watch(self) -> NodeWatch:
        """The node's watch (one node of every slot, as without ``nodes``), started at first use."""
        if self._node_watch is None:
            self._node_watch = NodeWatch(f"127.0.0.1:{self.server.port}", 0, 0, range(WORLD), TOKEN).start()
        return self._node_watch

    def agent(self, slot: int, watch: NodeWatch | None = None):
        """Slot ``slot``'s membership agent, as ``MembershipAgent.from_env`` makes it, on the node of
        ``watch`` (default: one node of every slot)."""
        from ds_recycle.runtime.rank.membership import MembershipAgent

        watch = watch or self.node_watch()
        agent = MembershipAgent(f"127.0.0.1:{self.server.port}", slot, TOKEN, 0, 0)
        agent.node_address = watch.address
        agent.node_slots = tuple(watch.slots)
        agent.store, agent.node_store = agent.connect(), agent.connect_node()
        agent.current = agent.store.membership()
        return agent

    def stop(self) -> None:
        if self._node_watch is not None:
            self._node_watch.stop()
        self.coordinator.stop()
        shutil.rmtree(self.beats_dir, ignore_errors=True)

    def request(self, kind: str, slot: int, token: str = TOKEN, pid: int = 4242, target: int | None = None) -> None:
        """Post a request as a process holding ``token`` would (another token: a stranger)."""
        C10dJobStore(self.raw, token, 0).post_request(Request(kind, slot, pid, time.time(), target))

    def pending(self) -> list[records.Change]:
        return self.store.changes()

    def alerts(self) -> int:
        return self.store.alert_count()

    def wait_for_line(self, fragment: str, timeout: float = 10.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if fragment in line:
                    return line
            time.sleep(0.005)
        raise AssertionError(f"no line with {fragment!r} in {self.lines}")

    def advance(self, members: tuple[int, ...]) -> None:
        """What the members do at a boundary: publish epoch n+1 and advance current_epoch."""
        self.store.publish_epoch(Membership(self.store.current_epoch() + 1, members, 0))


@pytest.fixture
def harness():
    h = Harness(HeartbeatPolicy(enabled=False))
    yield h
    h.stop()


def test_requests_are_validated_and_refused_ones_change_nothing(harness):
    h = harness
    h.request(records.JOIN, 1, token="b" * 32, pid=777)
    assert h.wait_for_line("refused request 1: not sealed with the job token")
    h.request("explode", 1)
    h.wait_for_line("unknown kind 'explode'")
    h.request(records.LEAVE, WORLD)
    h.wait_for_line(f"slot out of range (0..{WORLD - 1})")
    h.request(records.JOIN, 2)
    h.wait_for_line("refused join request for slot 2 from pid 4242: still a member")
    assert h.pending() == [] and h.alerts() == 0, "a refused request must change nothing"

    h.request(records.LEAVE, 3)
    h.wait_for_line("accepted leave of slot 3")
    h.request(records.LEAVE, 3)
    h.wait_for_line("refused leave request for slot 3 from pid 4242: already leaving")
    h.advance((0, 1, 2))
    h.request(records.LEAVE, 3)
    h.wait_for_line("refused leave request for slot 3 from pid 4242: not a member")
    h.request(records.JOIN, 3)
    h.wait_for_line("accepted join of slot 3")
    h.request(records.JOIN, 3)
    h.wait_for_line("refused join request for slot 3 from pid 4242: a join of this slot is already pending")
    assert [(c.seq, c.kind, c.slot) for c in h.pending()] == [(0, records.LEAVE, 3), (1, records.JOIN, 3)]
    assert h.alerts() == len(h.pending()), "every accepted change wakes the watchers: alert is the length of pending"


def test_waitpid_exit_of_a_member_is_published_once_as_a_failure(harness):
    h = harness
    h.coordinator.rank_exited(RankExit(slot=2, incarnation=0, returncode=-9, observed=time.time()))
    line = h.wait_for_line("published failure of slot 2 (signal SIGKILL)")
    assert "ms after waitpid saw the exit" in line
    (change,) = h.pending()
    assert (change.seq, change.kind, change.slot, change.detail) == (0, records.FAILED, 2, "signal SIGKILL")
    assert h.alerts() == len(h.pending())
    # A failed slot joins again (its respawn) once an epoch without it is decided, not before.
    h.request(records.JOIN, 2)
    h.wait_for_line("refused join request for slot 2 from pid 4242: still a member")
    h.advance((0, 1, 3))
    h.coordinator.rank_started(2, 1, time.time())  # the respawn
    h.request(records.JOIN, 2)
    h.wait_for_line("accepted join of slot 2")
    # An exit 0, an exit 75 or a non-member's exit is no failure.
    h.coordinator.rank_exited(RankExit(slot=0, incarnation=0, returncode=0, observed=time.time()))
    h.coordinator.rank_exited(RankExit(slot=1, incarnation=0, returncode=keys.RESTART_EXIT_CODE, observed=time.time()))
    h.coordinator.rank_exited(RankExit(slot=2, incarnation=0, returncode=-9, observed=time.time()))  # reaped late
    h.request(records.LEAVE, 1)
    h.wait_for_line("accepted leave of slot 1")
    assert [(c.kind, c.slot) for c in h.pending()] == [(records.FAILED, 2), (records.JOIN, 2), (records.LEAVE, 1)]
    assert h.alerts() == len(h.pending())
    # A leaver that dies before its boundary is a failure: its peers may be waiting on it.
    h.coordinator.rank_exited(RankExit(slot=1, incarnation=0, returncode=-15, observed=time.time()))
    h.wait_for_line("published failure of slot 1 (signal SIGTERM while leaving) in epoch 1")
    assert [(c.kind, c.slot) for c in h.pending()][-1] == (records.FAILED, 1)
    assert h.alerts() == len(h.pending())
    # A joiner that dies before its join is decided: failed too, so the admitting decision removes it.
    h.coordinator.rank_exited(RankExit(slot=2, incarnation=1, returncode=-9, observed=time.time()))
    h.wait_for_line("published failure of slot 2 (signal SIGKILL while its join was pending) in epoch 1")
    assert [(c.kind, c.slot) for c in h.pending()][-1] == (records.FAILED, 2)
    assert h.alerts() == len(h.pending())


def test_a_move_is_accepted_only_into_a_retired_slot_that_no_other_move_fills(harness):
    """Migration (``ds-recycle launch --rebalance``): the launcher retires a slot it gave up; a
    member may then move into it, once; a mover that dies before its move is decided is a failure
    and voids the move; a decided mover's slot is what the launcher asks ``moved_to`` about."""
    h = harness
    h.coordinator.rank_exited(RankExit(slot=3, incarnation=0, returncode=-9, observed=time.time()))
    h.wait_for_line("published failure of slot 3")
    h.advance((0, 1, 2))
    h.request(records.MOVE, 1, target=3)
    h.wait_for_line("refused move request for slot 1 from pid 4242: slot 3 is not retired")
    h.coordinator.retire(3, "given up after 1 quick failures")
    h.wait_for_line("slot 3 retired (given up after 1 quick failures): a migration may fill it")
    h.request(records.MOVE, 3, target=3)
    h.wait_for_line("refused move request for slot 3 from pid 4242: not a member")
    h.request(records.MOVE, 1, target=WORLD)
    h.wait_for_line(f"move target {WORLD} out of range")
    h.request(records.MOVE, 1, target=3, token="b" * 32)
    h.wait_for_line("not sealed with the job token")
    assert [c.kind for c in h.pending()] == [records.FAILED, records.RETIRED], "a refused move changes nothing"
    h.request(records.MOVE, 1, target=3)
    h.wait_for_line("accepted move of slot 1 to slot 3")
    h.request(records.MOVE, 2, target=3)
    h.wait_for_line("refused move request for slot 2 from pid 4242: slot 3 is not retired, or another move fills it")
    h.request(records.LEAVE, 1)
    h.wait_for_line("refused leave request for slot 1 from pid 4242: already moving")
    assert h.coordinator.moved_to(1) is None, "not decided: slot 1 is still a member"
    # The mover dies before its boundary: a failure (its peers may wait on it); the move is void.
    h.coordinator.rank_exited(RankExit(slot=1, incarnation=0, returncode=-9, observed=time.time()))
    h.wait_for_line("published failure of slot 1 (signal SIGKILL while moving to slot 3)")
    assert retired_slots(h.pending()) == {3}
    h.advance((0, 2))
    h.request(records.MOVE, 2, target=3)
    h.wait_for_line("accepted move of slot 2 to slot 3")
    assert moves_under_way(h.pending(), (0, 2)) == {2: 3}
    h.advance((0,))  # the boundary that takes the move: slot 2 leaves, its device serves slot 3
    assert h.coordinator.moved_to(2) == 3
    assert moves_under_way(h.pending(), (0,)) == {}
    kinds = [(c.kind, c.slot, c.target) for c in h.pending()]
    assert kinds[-1] == (records.MOVE, 2, 3) and h.alerts() == len(h.pending())


def _decide_at_boundary(h: Harness, members: tuple[int, ...], taken: int) -> None:
    """What the members do at a boundary: the decision (the pending changes from index ``taken``
    on), then the epoch."""
    epoch = h.store.current_epoch()
    pending = h.pending()
    h.store.propose_decision(
        records.Decision(epoch, 0, len(pending), tuple(pending[taken:]), Membership(epoch + 1, members, 0))
    )
    h.advance(members)


def test_a_retirement_is_published_after_the_exit_queued_before_it(harness):
    """The launcher queues a rank's exit, then its retirement; the coordinator drains exits, then
    retirements. An exit queued between the two drains was published after the retirement, so the
    slot's last change was its failure and no migration could fill it (test_migration saw the lowest
    member find 'retired slots [1, 5]', slot 4 retired before its failure was published)."""
    h = harness
    h.coordinator.stop()  # this test is the coordinator's thread, at the moment between the drains
    h.coordinator.rank_exited(RankExit(slot=3, incarnation=0, returncode=-9, observed=time.time()))
    h.coordinator.retire(3, "given up after 1 quick failures")
    h.coordinator._drain_retired()
    assert [(c.kind, c.slot) for c in h.pending()] == [(records.FAILED, 3), (records.RETIRED, 3)]
    assert retired_slots(h.pending()) == {3}


def test_a_leaver_that_dies_after_its_leave_was_decided_is_a_failure_of_its_last_iteration(harness):
    """The members that reach a boundary first decide it: a leaver taken out there may still be in
    the iteration that boundary closes, with a peer sending to it. Its death is published (the peer
    and the new epoch's members take it up); its exit 0, or its death an epoch later, is not."""
    h = harness
    h.request(records.LEAVE, 3)
    h.wait_for_line("accepted leave of slot 3")
    _decide_at_boundary(h, (0, 1, 2), 0)
    h.coordinator.rank_exited(RankExit(slot=3, incarnation=0, returncode=-9, observed=time.time()))
    h.wait_for_line("published failure of slot 3 (signal SIGKILL while leaving (its leave was decided")
    assert [(c.kind, c.slot) for c in h.pending()] == [(records.LEAVE, 3), (records.FAILED, 3)]
    assert h.alerts() == len(h.pending())
    h.request(records.LEAVE, 2)
    h.wait_for_line("accepted leave of slot 2")
    _decide_at_boundary(h, (0, 1), 2)
    h.coordinator.rank_exited(RankExit(slot=2, incarnation=0, returncode=0, observed=time.time()))
    _decide_at_boundary(h, (0, 1), 3)  # one epoch later, the same process killed in its teardown
    h.coordinator.rank_exited(RankExit(slot=2, incarnation=0, returncode=-9, observed=time.time()))
    h.request(records.LEAVE, 1)  # exits are taken before requests: once this is accepted, they were
    h.wait_for_line("accepted leave of slot 1")
    kinds = [(c.kind, c.slot) for c in h.pending()]
    assert kinds == [(records.LEAVE, 3), (records.FAILED, 3), (records.LEAVE, 2), (records.LEAVE, 1)], kinds
    assert h.alerts() == len(h.pending())


def test_every_decision_it_logs_is_also_a_structured_event(harness):
    h = harness
    h.request(records.JOIN, 1, token="b" * 32, pid=777)
    h.wait_for_line("refused request 1: not sealed")
    h.request(records.LEAVE, 3)
    h.wait_for_line("accepted leave of slot 3")
    h.coordinator.rank_exited(RankExit(slot=3, incarnation=0, returncode=-9, observed=time.time()))
    h.wait_for_line("published failure of slot 3 (signal SIGKILL while leaving)")
    h.coordinator.rank_exited(RankExit(slot=2, incarnation=0, returncode=1, observed=time.time()))
    h.wait_for_line("published failure of slot 2 (code 1)")
    events = [{k: v for k, v in e.items() if k != "latency_ms"} for e in h.events]
    assert events == [
        {"event": "refused", "index": 1, "kind": None, "slot": None, "pid": None, "reason": UNSEALED},
        {"event": "accepted", "kind": "leave", "slot": 3, "pid": 4242},
        {"event": "published_failure", "slot": 3, "cause": "exit", "why": "signal SIGKILL while leaving", "epoch": 0},
        {"event": "published_failure", "slot": 2, "cause": "exit", "why": "code 1", "epoch": 0},
    ]
    assert all(e["latency_ms"] >= 0 for e in h.events if e["event"] == "published_failure")


def test_a_probe_publishes_members_that_ended_without_a_failure(harness):
    """A survivor's peer stopped answering and no failure was published: a member that exited 0
    before the job finished is found by the probe; one whose process runs is not."""
    h = harness
    h.coordinator.rank_exited(RankExit(slot=3, incarnation=0, returncode=0, observed=time.time()))
    h.request(records.PROBE, 0, token="b" * 32)
    h.wait_for_line("refused request 1: not sealed with the job token")
    assert h.pending() == [] and h.alerts() == 0
    h.request(records.PROBE, 0)
    line = h.wait_for_line("probe from slot 0 (pid 4242) in epoch 0")
    assert line.endswith("published failure of ended members [3]"), line
    assert [(c.kind, c.slot, c.detail) for c in h.pending()] == [(records.FAILED, 3, "ended while still a member")]
    assert h.alerts() == len(h.pending())
    h.request(records.PROBE, 1)
    line = h.wait_for_line("probe from slot 1 (pid 4242) in epoch 0")
    assert line.endswith("every member's process is running"), line
    assert h.alerts() == len(h.pending())


def test_stale_heartbeat_is_a_failure_and_the_process_is_killed():
    h = Harness(HeartbeatPolicy(min_timeout=0.3, factor=3.0, startup_timeout=60.0))
    try:
        # Slots 0-2 beat; slot 3 never has (it is still starting): it is not checked. Slot 0's
        # iteration time sets the timeout: max(0.3, 3 * 0.2) = 0.6 s.
        beats = {slot: time.time() for slot in range(3)}
        stopped = time.time()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not h.killed:
            now = time.time()
            for slot in (0, 1):  # slot 2 stops beating
                beats[slot] = now
            for slot, beat in beats.items():
                h.beat(slot, beat, 0.2 if slot == 0 else None)
            time.sleep(0.05)
        line = h.wait_for_line("published failure of slot 2: heartbeat stale")
        assert "(timeout 0.60 s)" in line, line
        assert h.killed == [(2, 0)]
        (change,) = h.pending()
        assert (change.kind, change.slot) == (records.FAILED, 2)
        assert 0.6 <= change.time - stopped < 3.0
        assert h.alerts() == len(h.pending())
        # The node's lease carries its ranks' beats (what the status page reads).
        lease = h.store.lease(0)
        assert sorted(lease.beats) == [0, 1, 2] and lease.beats[0].iteration_seconds == 0.2
    finally:
        h.stop()


def test_a_heartbeat_of_an_earlier_incarnation_does_not_count():
    h = Harness(HeartbeatPolicy(min_timeout=0.2, startup_timeout=0.5))
    try:
        h.beat(1, time.time() - 100)  # left by incarnation 0
        h.coordinator.rank_started(1, 1, time.time())
        for slot in (0, 2, 3):
            h.beat(slot, time.time() + 100)  # fresh for the whole test
        line = h.wait_for_line("published failure of slot 1: no heartbeat")
        assert "after start" in line
        assert h.killed == [(1, 1)]
    finally:
        h.stop()


def test_a_silent_node_is_failed_by_its_lease_as_a_whole_not_by_its_ranks_heartbeats():
    """Node 1's agent relayed its ranks' beats, then went silent: its ranks' beats look ever older,
    but they are judged at the lease's time; the lease lapses and fails both ranks in one change."""
    h = Harness(HeartbeatPolicy(min_timeout=0.3, startup_timeout=60.0), NodeLayout(2, 2, 1.0))
    try:
        now = time.time()
        beats = {slot: records.Beat(now) for slot in (2, 3)}
        h.store.renew_lease(1, records.Lease(1, now, beats))
        for slot in (0, 1):
            h.beat(slot, now + 100)  # fresh for the whole test: node 0's ranks must never look stale
        line = h.wait_for_line("published failure of node 1: slots [2, 3] in one change")
        assert "lease of node 1 (incarnation 1) lapsed" in line, line
        assert not [line for line in h.lines if "heartbeat stale" in line], h.lines
        assert [(c.kind, c.slot) for c in h.pending()] == [(records.FAILED, 2), (records.FAILED, 3)]
    finally:
        h.stop()


def test_a_stopped_beat_is_not_checked():
    """A rank that stops beating on purpose (it finished, or left and is exiting) is not hung.
    (A 1 s floor: with 0.2 s, slot 0's beats every 50 ms were once 0.33 s apart under the suite's
    load, and slot 0 was declared hung too.)"""
    h = Harness(HeartbeatPolicy(min_timeout=1.0, startup_timeout=60.0))
    try:
        for slot in range(3):
            h.beat(slot, time.time())  # 1 and 2 never again
        write_beat(h.beats_dir, 3, records.Beat(time.time(), None, stopped=True))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and len(h.killed) < 2:
            h.beat(0, time.time())
            time.sleep(0.05)
        for _ in range(10):
            h.beat(0, time.time())
            time.sleep(0.05)
        assert sorted(h.killed) == [(1, 0), (2, 0)], h.lines
    finally:
        h.stop()


def test_policy_timeout_follows_the_slowest_iteration():
    policy = HeartbeatPolicy(min_timeout=1.0, factor=3.0)
    assert policy.timeout(None) == 1.0
    assert policy.timeout(0.1) == 1.0
    assert policy.timeout(2.0) == 6.0


def test_policy_timeout_follows_the_heartbeat_jitter():
    policy = HeartbeatPolicy(min_timeout=1.0, factor=3.0, jitter_factor=4.0)
    assert policy.timeout(0.1, worst_gap=0.1) == 1.0
    assert policy.timeout(0.1, worst_gap=0.8) == pytest.approx(3.2)
    assert policy.timeout(2.0, worst_gap=0.8) == 6.0


def test_late_heartbeats_raise_the_timeout_instead_of_killing_a_slow_member():
    """Beats 0.2 s apart raise the 0.3 s floor to 4 x 0.2 s; then beats 0.6 s apart (a host under
    load) are not a hang, and raise it to 4 x 0.6 s: a member silent for 1.5 s is not hung, one
    silent for far longer is."""
    h = Harness(HeartbeatPolicy(min_timeout=0.3, factor=3.0, startup_timeout=60.0, jitter_factor=4.0))
    try:
        for gap, beats in ((0.2, 6), (0.6, 3)):
            for _ in range(beats):
                now = time.time()
                for slot in range(WORLD):
                    h.beat(slot, now)
                time.sleep(gap)
        time.sleep(1.5 - 0.6)
        assert h.killed == [], h.lines
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not h.killed:
            time.sleep(0.05)
        assert h.killed, "a member silent for far longer than 4 x the worst gap is hung"
        assert any("(timeout 2." in line for line in h.lines), h.lines
    finally:
        h.stop()


def _watchers(h: Harness, slots: range) -> list:
    from ds_recycle.runtime.rank.waiting import FailureWatcher
    from ds_recycle.testing.scale import CountingStore

    watchers = []
    for slot in slots:
        agent = h.agent(slot)
        client = C10dJobStore(CountingStore(agent.connect_node().client), TOKEN, 0)
        watchers.append(FailureWatcher(client, slot, agent.node_store, agent.note_changes).start())
    return watchers


def _wait(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


def test_failure_watchers_block_without_store_traffic_and_all_wake_on_a_published_failure():
    h = Harness(HeartbeatPolicy(enabled=False))
    try:
        watchers = _watchers(h, range(WORLD))
        started = [w.store.client.ops for w in watchers]  # the count and the rank's first look at pending
        time.sleep(1.0)
        # The one wait each is still blocked (counted when it returns): no polling.
        assert [w.store.client.ops for w in watchers] == started
        # A leave wakes every watcher (the ranks learn of it without reading at their boundaries)
        # and raises none.
        h.request(records.LEAVE, 3)
        assert _wait(lambda: all(w.seen == 1 for w in watchers)), "every watcher takes the leave in"
        assert all([c.kind for c in w.on_changes.__self__._known] == [records.LEAVE] for w in watchers)
        assert not any(w.flag.is_set() for w in watchers)
        h.coordinator.rank_exited(RankExit(2, 0, -9, time.time()))
        assert _wait(lambda: all(w.flag.is_set() for w in watchers)), "every watcher wakes on the one alert write"
        for w in watchers:
            w.acknowledge(2)
        time.sleep(0.3)
        assert not any(w.flag.is_set() for w in watchers), "an acknowledged failure is not raised again"
        for w in watchers:
            w.stop()
            assert not w._thread.is_alive(), "a stopping watcher wakes itself"
    finally:
        h.stop()


def test_a_watcher_key_left_by_a_stopped_process_neither_raises_nor_spins_in_its_successor():
    h = Harness(HeartbeatPolicy(enabled=False))
    try:
        (first,) = _watchers(h, range(1, 2))
        first.stop()  # sets alert/1/1 in the node's store to wake itself: no failure behind it
        assert transport.connect(h.node_watch().address, 0).check([keys.alert_key(1, 1)])
        (successor,) = _watchers(h, range(1, 2))
        time.sleep(0.5)
        assert not successor.flag.is_set()
        assert successor.store.client.ops <= 12, (
            f"{successor.store.client.ops} store operations: the stale key must not make it spin"
        )
        h.coordinator.rank_exited(RankExit(3, 0, -9, time.time()))
        assert _wait(successor.flag.is_set), "the real alert with the same number still wakes it"
        successor.stop()
    finally:
        h.stop()


# ---- the other side: a node's agent link (runtime/node/link.py) ----------------------------------------


@pytest.fixture
def two_nodes():
    """The harness with two nodes of two slots, each with its node's watch."""
    h = Harness(HeartbeatPolicy(enabled=False), NodeLayout(2, 2, 60.0))
    address = f"127.0.0.1:{h.server.port}"
    watches = [NodeWatch(address, 0, node, range(2 * node, 2 * node + 2), TOKEN).start() for node in (0, 1)]
    yield h, watches
    for watch in watches:
        watch.stop()
    h.stop()


def test_each_node_copies_the_changes_and_the_latest_epoch_once_and_wakes_its_own_slots_only(two_nodes):
    """Two nodes of two slots. The coordinator wakes one key per node, not per slot; each node's
    watch copies the changes, the epoch a boundary decided (with the decision, for its leavers) and
    ``current_epoch`` into the node's store, then sets its own slots' alert keys there; after a
    failure, the recovery decision of the epoch and the entry into the epoch it makes too."""
    h, watches = two_nodes
    address = f"127.0.0.1:{h.server.port}"
    local = [C10dJobStore.connect(w.address, 0, TOKEN) for w in watches]
    listening = {(c.laddr.ip, c.laddr.port) for c in psutil.net_connections("tcp") if c.status == "LISTEN"}
    for watch in watches:
        port = int(watch.address.rpartition(":")[2])
        assert {ip for ip, p in listening if p == port} == {"127.0.0.1"}, "a node's store is on loopback only"
    h.request(records.LEAVE, 3)
    h.wait_for_line("accepted leave of slot 3")
    _decide_at_boundary(h, (0, 1, 2), 0)
    h.request(records.JOIN, 3)
    h.wait_for_line("accepted join of slot 3")
    assert _wait(lambda: all(w.seen == 2 for w in watches)), "every node copies both changes"
    assert not h.raw.check([keys.alert_key(0, 1)]), "no per-slot key in the job's store"
    assert all(h.raw.check([keys.node_alert_key(node, 2)]) for node in (0, 1))
    for node, store in enumerate(local):
        assert store.changes() == h.pending()
        assert store.current_epoch() == 1
        assert store.membership().members == (0, 1, 2)
        assert store.left_at_boundary(store.membership()) == {3}, "the decision is copied"
        own, other = range(2 * node, 2 * node + 2), range(2 - 2 * node, 4 - 2 * node)
        assert all(store.client.check([keys.alert_key(s, k)]) for s in own for k in (1, 2))
        assert not any(store.client.check([keys.alert_key(s, 1)]) for s in other)
    # A stopped watch wakes itself with its next key; its successor on the node skips that key
    # and still wakes for the real change with the same number.
    watches[1].stop()
    successor = NodeWatch(address, 0, 1, range(2, 4), TOKEN).start()
    watches[1] = successor
    time.sleep(0.3)
    assert successor.seen == 2 and successor._thread.is_alive()
    h.coordinator.rank_exited(RankExit(0, 0, -9, time.time()))
    assert _wait(lambda: successor.seen == 3), "the real third change still wakes the successor"
    node_store = C10dJobStore.connect(successor.address, 0, TOKEN)
    assert node_store.changes()[-1].kind == records.FAILED
    # With a failure the watch also awaits the recovery decision of the epoch it copied.
    decision = records.Decision(1, 0, 3, tuple(h.pending()[2:]), Membership(2, (1, 2), 0))
    h.store.propose_recovery(decision)
    assert _wait(lambda: node_store.recovery(1) is not None), "the recovery decision is copied"
    assert node_store.recovery(1) == decision
    h.store.mark_entered(2)  # then the entry into the epoch it makes
    assert _wait(lambda: node_store.entered(2)), "the entry is copied"


def test_a_node_whose_watch_lost_the_jobs_store_wakes_its_ranks_watchers():
    """The job's store is a process of its own, killed from outside: the node's watch closes the
    node's store, and a watcher blocked on it raises its flag (its rank stops and finds out)."""
    from ds_recycle.runtime.rank.waiting import FailureWatcher

    serve = "import sys, time, torch.distributed as d; s = d.TCPStore('127.0.0.1', 0, is_master=True, "
    serve += "wait_for_workers=False); print(s.port, flush=True); time.sleep(120)"
    server = subprocess.Popen([sys.executable, "-c", serve], stdout=subprocess.PIPE, text=True)
    try:
        address = f"127.0.0.1:{int(server.stdout.readline())}"
        C10dJobStore.connect(address, 0, TOKEN).open_job(2)
        lines: list[str] = []
        watch = NodeWatch(address, 0, 0, range(2), TOKEN, lines.append).start()
        watcher = FailureWatcher(
            C10dJobStore.connect(watch.address, 0, TOKEN), 0, C10dJobStore.connect(watch.address, 0, TOKEN)
        )
        watcher.start()
        time.sleep(0.3)
        assert not watcher.flag.is_set()
        server.kill()
        assert _wait(watcher.flag.is_set, 10.0), "the watcher must not stay blocked on a node store without a job"
        assert any("lost the job's store" in line for line in lines), lines
    finally:
        server.kill()
        server.wait(timeout=10)


def test_the_link_renews_its_lease_with_its_ranks_beats_and_carries_out_its_nodes_kill_orders_only(tmp_path):
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    store = C10dJobStore(dist.PrefixStore(keys.prefix(0), server), TOKEN, 0)
    killed: list[tuple[int, int]] = []
    write_beat(tmp_path, 5, records.Beat(123.5, 0.75))
    write_beat(tmp_path, 9, records.Beat(124.0))  # another node's slot: not this link's to relay
    link = NodeLink(
        f"127.0.0.1:{server.port}",
        0,
        1,
        TOKEN,
        2.0,
        log=lambda line: None,
        kill=lambda s, i: killed.append((s, i)),
        fence=lambda why: None,
        beats_dir=str(tmp_path),
        slots=range(4, 8),
    )
    assert link.register() == 1
    link.start()
    try:
        first = store.lease(1).time
        assert _wait(lambda: store.lease(1).time > first, 1.0), "lease not renewed"
        assert store.lease(1).beats == {5: records.Beat(123.5, 0.75)}
        write_beat(tmp_path, 4, records.Beat(125.0))
        assert _wait(lambda: 4 in store.lease(1).beats, 1.0), "beat not relayed"
        for node, slot, incarnation in ((1, 5, 2), (0, 1, 0), (1, 4, 0)):  # the coordinator's writes
            store.order_kill(node, KillOrder(slot, incarnation))
        # Read once a second (a hang is judged after seconds), in order; node 0's order is not its own.
        assert _wait(lambda: len(killed) == 2, KILL_CHECK_SECONDS + 1.0), killed
        assert killed == [(5, 2), (4, 0)]
    finally:
        link.stop()


def test_a_link_whose_renewals_stop_fences_its_node():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    fenced: list[str] = []
    link = NodeLink(
        f"127.0.0.1:{server.port}",
        0,
        2,
        TOKEN,
        0.5,
        log=lambda line: None,
        kill=lambda s, i: None,
        fence=fenced.append,
    )
    link.register()
    link.last_renewal = time.time() - 1.0  # as after a freeze longer than the lease
    link.start()
    try:
        assert _wait(lambda: fenced, 2.0) and link.fenced
        assert "no lease renewal" in fenced[0]
    finally:
        link.stop()


def _claimer(node_store) -> bytes:
    """The slot that claimed the copy of its node's progress, as sealed on the node's store."""
    return node_store.get(keys.progress_forwarder_key(0)).split(b"\n")[0]


class _Survivors:
    """Slots 0, 1 and 2 as trainers' membership agents (real clients of the harness's store), each
    recovering from slot 3's failure in a thread of its own."""

    def __init__(self, h: Harness, watches: list[NodeWatch] | None = None) -> None:
        """``watches``: each node's, of two slots each (default: one node of every slot)."""
        self.agents = {slot: h.agent(slot, watches[slot // 2] if watches else None) for slot in (0, 1, 2)}
        self.decisions: dict[int, object] = {}
        self.threads: list[threading.Thread] = []

    def recover(self, slot: int, done: int) -> None:
        """Slot ``slot`` recovers, having finished ``done`` iterations."""

        def run() -> None:
            try:
                progress = records.Progress(done, False)
                self.decisions[slot] = self.agents[slot].recover(progress, (0, 1, 2, 3), 10.0, 8.0)
            except Exception as error:  # reported by one_decision
                self.decisions[slot] = error

        thread = threading.Thread(target=run)
        thread.start()
        self.threads.append(thread)

    def one_decision(self) -> records.Decision:
        """The decision all three hold (each recovery is bounded at 8 s)."""
        for thread in self.threads:
            thread.join(timeout=20)
        decisions = self.decisions
        assert sorted(decisions) == [0, 1, 2], decisions
        assert all(isinstance(d, records.Decision) for d in decisions.values()), decisions
        assert len({d.to_json() for d in decisions.values()}) == 1, decisions
        return decisions[0]


def test_a_survivor_waiting_in_an_epoch_a_boundary_superseded_recovers_in_the_new_one(harness):
    """Slot 3's leave is accepted. Slot 0 is stopped by a failure before the boundary and looks at
    the membership first (epoch 0); slots 1 and 2 then reach the boundary and decide epoch 1 without
    slot 3, which dies in its last iteration. Slots 1 and 2 recover in epoch 1, slot 0 posted in
    epoch 0, whose decision nobody else will make: it must see epoch 1 and recover there, so that all
    three hold one decision (seen in a fault campaign: the survivors waited for each other in two
    epochs until the timeout)."""
    h = harness
    survivors = _Survivors(h)
    h.request(records.LEAVE, 3)
    h.wait_for_line("accepted leave of slot 3")
    survivors.recover(0, 5)
    time.sleep(0.5)  # slot 0 looked at the membership (epoch 0) and waits for the failure
    _decide_at_boundary(h, (0, 1, 2), 0)
    h.coordinator.rank_exited(RankExit(slot=3, incarnation=0, returncode=-9, observed=time.time()))
    h.wait_for_line("published failure of slot 3")
    for slot in (1, 2):
        survivors.recover(slot, 6)
    decision = survivors.one_decision()
    assert decision.epoch == 1 and decision.iteration == 5 and decision.next.members == (0, 1, 2)


def test_an_epoch_whose_decider_died_before_publishing_it_is_published_by_the_survivors_that_took_it(harness):
    """Slot 3 fixes the boundary decision making epoch 1 and is killed before it publishes the
    epoch. Slots 1 and 2 took the decision (epoch 1); slot 0 was stopped before the boundary and is
    in epoch 0. Unless a survivor that took epoch 1 publishes it, slot 0 recovers in epoch 0 and
    slots 1 and 2 in epoch 1, each side waiting for the other until the timeout."""
    h = harness
    survivors = _Survivors(h)
    epoch_1 = Membership(1, (0, 1, 2, 3), 4)
    h.store.propose_decision(records.Decision(0, 4, 0, (), epoch_1))  # slot 3's, unpublished
    for slot in (1, 2):
        assert survivors.agents[slot].decide(4).next == epoch_1
    h.coordinator.rank_exited(RankExit(slot=3, incarnation=0, returncode=-9, observed=time.time()))
    h.wait_for_line("published failure of slot 3")
    for slot in (0, 1, 2):
        survivors.recover(slot, 3 if slot == 0 else 4)
    decision = survivors.one_decision()
    assert decision.epoch == 1 and decision.iteration == 3 and decision.next.members == (0, 1, 2)


def _node_store(watch: NodeWatch):
    """The node's store on the wire (which slot claimed the copy is no typed operation)."""
    return transport.connect(watch.address, 0)


def test_each_nodes_survivors_progress_reaches_the_jobs_store_in_one_copy(two_nodes):
    """Slot 3 dies. Slots 0 and 1 (node 0) and slot 2 (node 1) post their progress on their node's
    store; the survivor whose post completes its node's copies the node's posts to the job's store
    and counts them there once: the job's count is the survivors', and the decision is theirs."""
    h, watches = two_nodes
    survivors = _Survivors(h, watches)
    h.coordinator.rank_exited(RankExit(slot=3, incarnation=0, returncode=-9, observed=time.time()))
    h.wait_for_line("published failure of slot 3")
    for slot, done in ((0, 5), (1, 6), (2, 6)):
        survivors.recover(slot, done)
    decision = survivors.one_decision()
    assert decision.epoch == 0 and decision.iteration == 5 and decision.next.members == (0, 1, 2)
    assert h.store.count_progress(0) == 3, "each node counted its survivors once"
    assert [post.done for post in h.store.progress_of(0, [0, 1, 2]).values()] == [5, 6, 6]
    node_0, node_1 = (_node_store(w) for w in watches)
    assert _claimer(node_0) in (b"0", b"1")
    assert _claimer(node_1) == b"2"
    assert int(node_0.add(keys.progress_count_key(0), 0)) == 2 and int(node_1.add(keys.progress_count_key(0), 0)) == 1


def test_a_nodes_survivor_that_dies_before_it_posts_leaves_the_copy_to_its_node_mate(two_nodes):
    """Slot 3 dies; slot 0 posts on node 0's store, where slot 1 never posts: it dies too. Slot 0
    sees slot 1's failure, finds its node's remaining survivors posted, and copies them: slots 0
    and 2 decide without slots 1 and 3."""
    h, watches = two_nodes
    survivors = _Survivors(h, watches)
    h.coordinator.rank_exited(RankExit(slot=3, incarnation=0, returncode=-9, observed=time.time()))
    h.wait_for_line("published failure of slot 3")
    survivors.recover(0, 5)
    survivors.recover(2, 5)
    node_0 = _node_store(watches[0])
    assert _wait(lambda: node_0.check([keys.progress_key(0, 0)]))
    time.sleep(0.3)
    assert not h.store.progress_posted(0, [0]), "node 0's copy waits for slot 1"
    h.coordinator.rank_exited(RankExit(slot=1, incarnation=0, returncode=-9, observed=time.time()))
    for thread in survivors.threads:
        thread.join(timeout=20)
    decisions = {slot: survivors.decisions[slot] for slot in (0, 2)}
    assert all(isinstance(d, records.Decision) for d in decisions.values()), decisions
    assert decisions[0] == decisions[2] and decisions[0].next.members == (0, 2)
    assert _claimer(node_0) == b"0"


def test_a_forwarder_that_died_before_copying_is_taken_over(two_nodes):
    """Slot 1 posted on node 0's store and claimed the copy, and died before it made it (its post
    and its claim are written here as it left them). Slot 0 finds the claimer gone, claims the copy
    from it and makes it: slots 0 and 2 decide without slots 1 and 3."""
    h, watches = two_nodes
    survivors = _Survivors(h, watches)
    node_0 = _node_store(watches[0])
    as_slot_1 = C10dJobStore(node_0, TOKEN, 0)
    as_slot_1.post_progress(0, 1, records.Progress(5, False))
    as_slot_1.count_progress(0, 1)
    assert as_slot_1.claim_forwarding(0, 1, [1])
    for slot in (3, 1):
        h.coordinator.rank_exited(RankExit(slot=slot, incarnation=0, returncode=-9, observed=time.time()))
        h.wait_for_line(f"published failure of slot {slot}")
    survivors.recover(0, 5)
    survivors.recover(2, 5)
    for thread in survivors.threads:
        thread.join(timeout=20)
    decisions = {slot: survivors.decisions[slot] for slot in (0, 2)}
    assert all(isinstance(d, records.Decision) for d in decisions.values()), decisions
    assert decisions[0] == decisions[2] and decisions[0].next.members == (0, 2)
    assert _claimer(node_0) == b"0", "slot 0 took the copy over"
    assert h.store.progress_posted(0, [0]) and not h.store.progress_posted(0, [1])
