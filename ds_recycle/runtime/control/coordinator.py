"""The coordinator: the one writer of ``pending`` (the job's list of membership changes).

``ds-recycle launch`` runs one :class:`Coordinator` per generation, in a thread of its own with its
own store client (a blocking call on a TCPStore client blocks every other thread using that client).
Each tick it:

1. takes the rank exits that the launcher observed through waitpid (:meth:`Coordinator.rank_exited`):
   a member of the current epoch that ended non-zero or by a signal and is not already failed in
   ``pending`` (a leaver whose boundary has not come yet included), or a joiner whose accepted join
   is still pending, is appended as a ``failed`` change (an exit 0 or 75 is never a failure);
2. reads the new requests (``request_count``, ``request/<k>``, k = 1, 2, ...) and appends the valid
   ones: the job token's seal holds, the kind is ``join``, ``leave`` or ``probe``, the slot is in range, a
   ``leave`` comes from a member that is not already on its way out, a ``join`` is for a slot that
   is not a member of the current epoch and has no join pending. A ``probe`` (a member's peer stopped
   answering and no failure was published) publishes as failed every member whose process ended.
   A ``move`` (a migration, proposed by the lowest member) is accepted from a member that is not
   on its way out, into a retired slot of the same node that no other move fills (the launcher
   that ran the mover starts the target on its device). A refused request changes nothing; both
   outcomes are logged;
3. checks heartbeats (each node's agent relays its ranks' beats in its lease; this host's own ranks'
   are read from their beat files, and written in this node's lease for the status page): a member
   whose last heartbeat (of its current incarnation) is older than the timeout is appended as
   ``failed`` and its process is killed through the launcher's callback, so a hung (SIGSTOPped)
   process can never come back as a member. A slot whose last beat is ``stopped`` (it finished or
   left on purpose) is not checked. The timeout is derived from the iteration time the trainers send
   with their beats: ``max(min_timeout, factor * max iteration_seconds)``. A slot
   is not checked before its first heartbeat, except that once the job is seen to heartbeat at all,
   a member with no heartbeat ``startup_timeout`` seconds after its start is declared failed too.

The coordinator never decides membership itself: the members do, at iteration boundaries, from
``pending`` (see keys.py). "Member" here always means a member of the epoch in
``current_epoch``, read fresh from the store.
"""

from __future__ import annotations

import collections
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ds_recycle.runtime.shared import keys, policy
from ds_recycle.runtime.shared.beats import read_beats
from ds_recycle.runtime.shared.c10d_store import C10dJobStore
from ds_recycle.runtime.shared.job_store import JobStore
from ds_recycle.runtime.shared.records import (
    FAILED,
    JOIN,
    LEAVE,
    MOVE,
    OUT_KINDS,
    PROBE,
    REQUEST_KINDS,
    RETIRED,
    AgentReport,
    Beat,
    Change,
    KillOrder,
    Lease,
    Membership,
    Request,
)
from ds_recycle.runtime.shared.seal import ForgedRecord

RENEW_MAX_SECONDS = 0.25
"""An agent renews its node's lease every fifth of the lease timeout, at least every 0.25 s: a node's
lease is also how a dead node (no agent left to waitpid its ranks) is told from a live one, and it
carries the node's heartbeats."""


def renew_seconds(lease_seconds: float) -> float:
    return min(RENEW_MAX_SECONDS, 0.2 * lease_seconds)


STORE_OP_SECONDS = 30.0
"""Bound on any single store operation of the coordinator (the store is local; a healthy op takes µs)."""
TICK_SECONDS = 0.01
"""How often requests and other nodes' reports are polled (one read of both counters); an exit
observed here wakes the coordinator at once."""
HEARTBEAT_CHECK_SECONDS = 0.05
LEASE_CHECK_SECONDS = 0.1
JOIN_BATCH_SECONDS = 30.0
"""How long a node's first join waits for the node's other slots to ask too."""
GAP_WINDOW = 100
"""Heartbeat gaps remembered per member (about 10 s of beats at 0.1 s)."""
UNSEALED = "not sealed with the job token (written by a process without it)"
MISSING_REQUEST_SECONDS = 5.0
"""``request_count`` was incremented but ``request/<k>`` never written (the poster died in between):
after this long the index is skipped, so one dead poster cannot stall every later request."""


@dataclass(frozen=True)
class HeartbeatPolicy:
    """When a member's heartbeat is stale. Trainers beat every 0.1 s (membership.HEARTBEAT_SECONDS)."""

    min_timeout: float = keys.HEARTBEAT_MIN_TIMEOUT_SECONDS
    """T_min: never declare a member dead sooner than this after its last heartbeat. A heartbeat is
    a Python thread: a rank whose main thread holds the GIL in a long C call (pickling a checkpoint,
    importing a large package) or a host under load can skip beats for seconds without being hung."""
    factor: float = 3.0
    """k: the timeout is at least k times the slowest published iteration time."""
    startup_timeout: float = 120.0
    """A member must heartbeat this long after its process started (once the job heartbeats at all)."""
    enabled: bool = True
    jitter_factor: float = 4.0
    """j: the timeout is at least j times the longest gap seen between two heartbeats of any member
    lately: on a loaded host beats arrive late, and a floor that fits a quiet machine would kill
    healthy ranks there."""

    def timeout(self, iteration_seconds: float | None, worst_gap: float | None = None) -> float:
        timeout = self.min_timeout
        if iteration_seconds is not None:
            timeout = max(timeout, self.factor * iteration_seconds)
        if worst_gap is not None:
            timeout = max(timeout, self.jitter_factor * worst_gap)
        return timeout


@dataclass(frozen=True)
class NodeLayout:
    """``count`` nodes of ``per_node`` contiguous slots each (node k owns slots k*G .. k*G+G-1)."""

    count: int
    per_node: int
    lease_seconds: float
    """A node whose agent has not renewed its lease for this long is failed as a whole."""

    def node_of(self, slot: int) -> int:
        return slot // self.per_node

    def slots(self, node: int) -> range:
        return range(node * self.per_node, (node + 1) * self.per_node)


@dataclass(frozen=True)
class RankExit:
    """One process end observed by the launcher's waitpid."""

    slot: int
    incarnation: int
    returncode: int
    """Popen's convention: >= 0 an exit code, < 0 the negated signal number."""
    observed: float
    """Wall time (time.time()) when waitpid returned it."""

    def describe(self) -> str:
        return describe_returncode(self.returncode)


def describe_returncode(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"code {returncode}"


@dataclass
class _Incarnation:
    number: int
    started: float
    """Wall time at spawn; a heartbeat older than this belongs to an earlier incarnation."""
    running: bool = True


class Coordinator:
    """Owns ``pending`` for one generation of the job (see the module docstring)."""

    def __init__(
        self,
        address: str,
        generation: int,
        world_size: int,
        token: str,
        log: Callable[[str], None],
        kill: Callable[[int, int], None],
        policy: HeartbeatPolicy | None = None,
        nodes: NodeLayout | None = None,
        events: Callable[..., None] | None = None,
        local_node: int | None = 0,
        beats_dir: str | None = None,
    ) -> None:
        """``kill(slot, incarnation)`` must SIGKILL that process if it is still the slot's current one
        (for a slot of ``local_node``, whose agent runs this coordinator; other nodes' agents, every
        node's with a standalone ``ds-recycle coordinator`` (``local_node=None``), get kill orders).
        ``events(event, **fields)`` gets each logged decision as a structured event (the launcher's
        ``--events`` stream). ``beats_dir``: the beat directory of ``local_node``'s ranks."""
        self.address, self.generation = address, generation
        self.world_size = world_size
        self.nodes = nodes or NodeLayout(1, world_size, 5.0)
        self.local_node = local_node
        self.exit_codes: dict[int, int] = {}
        """Each slot's last observed exit code (Popen's convention), here or on its node."""
        self.beats_dir = beats_dir
        self._leases: dict[int, Lease] = {}
        """Every other node's last lease read (their ranks' beats come with it)."""
        self._membership: Membership | None = None
        self._last_local_lease = 0.0
        self._dead_nodes: set[tuple[int, int]] = set()
        """(node, node incarnation) pairs whose lease lapsed: their reports are refused."""
        self._next_report = 1
        self._last_lease_check = 0.0
        self._probed: set[tuple[int, int]] = set()
        self._leases_read_at = time.time()
        self._held_joins: dict[int, dict[int, tuple[Request, float]]] = {}
        """Per node, the joins waiting for the node's other slots (see _hold_join)."""
        self._last_beat: dict[int, tuple[int, float]] = {}
        self._gaps: dict[int, collections.deque[float]] = {}
        self.token = token
        self.policy = policy or HeartbeatPolicy()
        self._log = log
        self._emit = events or _ignore
        self._kill = kill
        self._exits: queue.Queue[RankExit] = queue.Queue()
        self._retired: queue.Queue[tuple[int, str]] = queue.Queue()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._retry: RankExit | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # guards _incarnations and _pending (read by other threads)
        self._incarnations: dict[int, _Incarnation] = {}
        self._pending: list[Change] = []
        self._next_request = 1
        self._saved_cursor = (1, 1)
        self._missing_since: float | None = None
        self._job_heartbeats = False
        self._last_heartbeat_check = 0.0
        self._heartbeat_scan_seconds = HEARTBEAT_CHECK_SECONDS
        self._store: JobStore | None = None
        self._query = C10dJobStore.connect(address, generation, token, STORE_OP_SECONDS)
        """For :meth:`membership` from other threads."""
        self._query_lock = threading.Lock()
        self.error: BaseException | None = None
        """The last error of a tick (the coordinator logs it and retries)."""
        self._last_error_log = 0.0

    # ---- the launcher's side -------------------------------------------------------------------

    def start(self, resume: bool = False) -> None:
        """Start the thread; ``resume``: take over the generation from a coordinator that ran it
        before (on etcd, after its host died): go on from the requests and reports it had read, with
        the ranks' incarnations and exits its reports tell."""
        if self._thread is not None:
            raise RuntimeError(f"the coordinator of generation {self.generation} is running already")
        self._store = C10dJobStore.connect(self.address, self.generation, self.token, STORE_OP_SECONDS)
        self._pending = self._store.changes()
        self._store.open_inboxes()  # each tick reads both counters in one go
        if resume:
            self._resume()
        self._thread = threading.Thread(target=self._run, name=f"recycle-coordinator-{self.generation}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Process what is queued, then end the thread (bounded by ``timeout``)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def rank_started(self, slot: int, incarnation: int, wall_time: float) -> None:
        with self._lock:
            self._incarnations[slot] = _Incarnation(incarnation, wall_time)

    def rank_exited(self, exit: RankExit) -> None:
        """Called by the launcher right after waitpid; the failure (if any) is published by the thread."""
        with self._lock:
            current = self._incarnations.get(exit.slot)
            if current is not None and current.number == exit.incarnation:
                current.running = False
            self.exit_codes[exit.slot] = exit.returncode
        self._exits.put(exit)
        self._wake.set()

    def retire(self, slot: int, why: str) -> None:
        """The launcher will not start ``slot`` again: published as ``retired`` by the thread, so
        that a migration may fill it (``ds-recycle launch --rebalance``)."""
        self._retired.put((slot, why))
        self._wake.set()

    def moved_to(self, slot: int) -> int | None:
        """The slot that ``slot``'s device now serves, if ``slot`` left by a decided move (its last
        change is a ``move`` and the current epoch no longer has it); else None."""
        last = self._last_change(slot)
        if last is None or last.kind != MOVE or slot in self.membership().members:
            return None
        return last.target

    def all_ended(self) -> bool:
        """Every slot that ever started has ended (seen by waitpid here or on its node)."""
        with self._lock:
            return all(not incarnation.running for incarnation in self._incarnations.values())

    def membership(self) -> Membership:
        """The current epoch's membership, read fresh from the store."""
        with self._query_lock:
            return self._query.membership()

    def pending(self) -> list[Change]:
        with self._lock:
            return list(self._pending)

    # ---- the thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            stopping = self._stop.is_set()
            try:
                self._tick()
            except Exception as exc:  # a store hiccup must not end coordination; report and go on
                self.error = exc
                now = time.monotonic()
                if now - self._last_error_log > 1.0:
                    self._last_error_log = now
                    self._log(f"coordinator error (retrying): {type(exc).__name__}: {exc}")
                    self._emit("coordinator_error", error=f"{type(exc).__name__}: {exc}")
                time.sleep(0.05)
            if stopping:
                return
            self._wake.wait(TICK_SECONDS)  # an observed exit wakes the coordinator at once
            self._wake.clear()

    def _resume(self) -> None:
        self._next_request, next_report = self._saved_cursor = self._store.cursor()
        for index in range(1, next_report):
            try:
                report = self._store.report(index)
            except ForgedRecord:
                continue
            if report is None or self._report_refusal(report):
                continue
            if report.kind == "started":
                self.rank_started(report.slot, report.incarnation, report.time)
                continue
            with self._lock:
                current = self._incarnations.get(report.slot)
                if current is not None and current.number == report.incarnation:
                    current.running = False
                self.exit_codes[report.slot] = report.code
        self._next_report = next_report
        self._log(
            f"took over generation {self.generation}: {len(self._pending)} changes so far, requests from "
            f"{self._next_request} and reports from {next_report} on"
        )
        self._emit("coordinator_resumed", generation=self.generation, changes=len(self._pending))

    def _tick(self) -> None:
        self._tick_inboxes()
        cursor = (self._next_request, self._next_report)
        if cursor != self._saved_cursor:
            self._store.save_cursor(*cursor)
            self._saved_cursor = cursor

    def _tick_inboxes(self) -> None:
        requests, reports = self._store.inbox_counts()
        if self.nodes.count > 1:
            self._poll_reports(reports)
            if time.monotonic() - self._last_lease_check >= LEASE_CHECK_SECONDS:
                self._last_lease_check = time.monotonic()
                self._check_leases()
                for node in list(self._held_joins):
                    self._release_joins(node)
        self._drain_exits()
        self._drain_retired()
        self._poll_requests(requests)
        self._renew_local_lease()
        if self.policy.enabled and time.monotonic() - self._last_heartbeat_check >= self._heartbeat_scan_seconds:
            began = self._last_heartbeat_check = time.monotonic()
            self._check_heartbeats()
            # A scan reads every member's keys: with thousands of members it takes a while, and the
            # coordinator must keep most of its time for exits and requests.
            self._heartbeat_scan_seconds = max(HEARTBEAT_CHECK_SECONDS, 4 * (time.monotonic() - began))

    def _drain_exits(self) -> None:
        while True:
            if self._retry is None:
                try:
                    self._retry = self._exits.get_nowait()
                except queue.Empty:
                    return
            self._on_exit(self._retry)  # if it raises, the same exit is retried next tick
            self._retry = None

    def _drain_retired(self) -> None:
        while True:
            # The launcher queues a rank's exit before its retirement: published first, so that the
            # slot's last change is its retirement (policy.retired_slots), even for an exit queued
            # after this tick drained the exits.
            self._drain_exits()
            try:
                slot, why = self._retired.get_nowait()
            except queue.Empty:
                return
            self._append(RETIRED, slot, time.time(), why)
            self._log(f"slot {slot} retired ({why}): a migration may fill it")
            self._emit("retired", slot=slot, why=why)

    def _on_exit(self, exit: RankExit) -> None:
        if exit.returncode == 0 or exit.returncode == keys.RESTART_EXIT_CODE:
            return
        with self._lock:
            latest = self._incarnations.get(exit.slot)
        if latest is not None and latest.number != exit.incarnation:
            return  # an earlier process of the slot, reaped after its successor started
        membership = self._store.membership()
        last = self._last_change(exit.slot)
        joining = exit.slot not in membership.members and last is not None and last.kind == JOIN
        # A leaver taken out by the latest decision may not have finished the iteration that
        # decision closed (the members that reached the boundary first decided it): a peer may still
        # be sending to it or waiting for it. Its death (not exit 0) is a failure of that iteration,
        # which the members of the new epoch take up too (MembershipAgent._concerned). Only the process
        # that left: its respawn's death while its join is pending is a joiner's, as ever.
        left_last = (
            exit.slot not in membership.members
            and last is not None
            and last.kind == LEAVE
            and exit.slot in self._store.left_at_boundary(membership)
        )
        if not joining and not left_last and exit.slot not in membership.members:
            return
        if last is not None and last.kind == FAILED and exit.slot in membership.members:
            return
        # A leaver that dies before its boundary is failed like any other member: its peers may be
        # waiting on it in the iteration it was to finish. A joiner that dies before its join is
        # decided is failed too: the decision that admits it also removes it (the members may have
        # decided the join already, hence the alert; members not running with it ignore it).
        why = exit.describe() + (" while leaving" if last is not None and last.kind == LEAVE else "")
        why += " (its leave was decided; its last iteration may not have been finished)" if left_last else ""
        why += f" while moving to slot {last.target}" if last is not None and last.kind == MOVE else ""
        why += ": it gave up its join" if exit.returncode == keys.JOIN_GIVEN_UP_EXIT_CODE else ""
        why += " while its join was pending" if joining else ""
        self._append(FAILED, exit.slot, exit.observed, why)
        latency_ms = 1000 * (time.time() - exit.observed)
        self._log(
            f"published failure of slot {exit.slot} ({why}) in epoch {membership.epoch}, "
            f"{latency_ms:.1f} ms after waitpid saw the exit"
        )
        self._emit(
            "published_failure", slot=exit.slot, cause="exit", why=why, epoch=membership.epoch, latency_ms=latency_ms
        )

    def _poll_requests(self, count: int) -> None:
        while self._next_request <= count:
            try:
                text = self._store.posted_request(self._next_request)
            except ForgedRecord:
                self._log(f"refused request {self._next_request}: {UNSEALED}")
                self._emit("refused", index=self._next_request, kind=None, slot=None, pid=None, reason=UNSEALED)
                self._missing_since = None
                self._next_request += 1
                continue
            if text is None:
                now = time.monotonic()
                if self._missing_since is None:
                    self._missing_since = now
                if now - self._missing_since < MISSING_REQUEST_SECONDS:
                    return
                self._log(f"skipped request {self._next_request}: counted but never written")
                self._emit("skipped_request", index=self._next_request)
            else:
                self._handle_request(self._next_request, text)
            self._missing_since = None
            self._next_request += 1

    def _handle_request(self, index: int, text: bytes) -> None:
        try:
            request = Request.from_json(text)
        except (ValueError, KeyError, TypeError) as exc:
            self._log(f"refused request {index}: malformed ({type(exc).__name__}: {exc})")
            self._emit("refused", index=index, kind=None, slot=None, pid=None, reason=f"malformed: {exc}")
            return
        reason = self._refusal(request)
        who = f"{request.kind} request for slot {request.slot} from pid {request.pid}"
        if reason:
            self._log(f"refused {who}: {reason}")
            self._emit("refused", index=index, kind=request.kind, slot=request.slot, pid=request.pid, reason=reason)
            return
        if request.kind == PROBE:
            self._answer_probe(request)
            return
        if request.kind == JOIN and self.nodes.count > 1:
            self._hold_join(request)
            return
        if request.kind == MOVE:
            self._append(MOVE, request.slot, request.time, f"to slot {request.target}", target=request.target)
            self._log(f"accepted move of slot {request.slot} to slot {request.target} (pid {request.pid})")
            self._emit("accepted", kind=MOVE, slot=request.slot, pid=request.pid, target=request.target)
            return
        self._append(request.kind, request.slot, request.time, f"pid {request.pid}")
        self._log(f"accepted {request.kind} of slot {request.slot} (pid {request.pid})")
        self._emit("accepted", kind=request.kind, slot=request.slot, pid=request.pid)

    def _hold_join(self, request: Request) -> None:
        """With several nodes, a node's joins are taken together: a re-admitted node's slots then
        enter in one decision (one rebuild for the survivors), not one each."""
        node = self.nodes.node_of(request.slot)
        self._held_joins.setdefault(node, {})[request.slot] = (request, time.monotonic())
        self._release_joins(node)

    def _release_joins(self, node: int, now: float | None = None) -> None:
        held = self._held_joins.get(node)
        if not held:
            return
        members = self._store.membership().members
        waiting_for = [s for s in self.nodes.slots(node) if s not in members and s not in held]
        first = min(since for _, since in held.values())
        if waiting_for and (now or time.monotonic()) - first < JOIN_BATCH_SECONDS:
            return
        requests = [request for request, _ in held.values()]
        del self._held_joins[node]
        self._append_all([(JOIN, r.slot, r.time, f"pid {r.pid}") for r in requests])
        for r in requests:
            self._log(f"accepted join of slot {r.slot} (pid {r.pid})")
            self._emit("accepted", kind=JOIN, slot=r.slot, pid=r.pid)
        if len(requests) > 1:
            self._log(f"node {node}: joins of slots {sorted(r.slot for r in requests)} accepted in one change")

    def _refusal(self, request: Request) -> str:
        """Why ``request`` is refused, or "" if it is valid."""
        if request.kind not in REQUEST_KINDS:
            return f"unknown kind {request.kind!r} (allowed: {', '.join(REQUEST_KINDS)})"
        if not 0 <= request.slot < self.world_size:
            return f"slot out of range (0..{self.world_size - 1})"
        member = request.slot in self._store.membership().members
        if request.kind == PROBE:
            return "" if member else "not a member of the current epoch"
        last = self._last_change(request.slot)
        leaving = last is not None and last.kind in OUT_KINDS
        out = {FAILED: "failed", LEAVE: "leaving", MOVE: "moving"}
        if request.kind in (LEAVE, MOVE):
            if not member:
                return "not a member of the current epoch"
            if leaving:
                return f"already {out[last.kind]}"
            return self._move_refusal(request) if request.kind == MOVE else ""
        if member:
            # Even when its failure or leave is pending: the joiner would see its slot in the current
            # epoch and take the epoch of its predecessor for its own. It joins once that is decided.
            return "still a member of the current epoch (post the join once an epoch without it is decided)"
        if (last is not None and last.kind == JOIN) or request.slot in self._held_joins.get(
            self.nodes.node_of(request.slot), {}
        ):
            return "a join of this slot is already pending"
        return ""

    def _move_refusal(self, request: Request) -> str:
        target = request.target
        if target is None or not 0 <= target < self.world_size:
            return f"move target {target} out of range (0..{self.world_size - 1})"
        with self._lock:
            retired = policy.retired_slots(self._pending)
        if target not in retired:
            return f"slot {target} is not retired, or another move fills it (retired: {sorted(retired)})"
        node, target_node = self.nodes.node_of(request.slot), self.nodes.node_of(target)
        if target_node != node:
            return f"slot {target} is on node {target_node}, the mover on node {node} (moves stay on a node)"
        return ""

    # ---- other nodes ---------------------------------------------------------------------------

    def _poll_reports(self, count: int) -> None:
        """Starts and exits that other nodes' agents saw (their waitpid), as if seen here."""
        while self._next_report <= count:
            try:
                report = self._store.report(self._next_report)
            except ForgedRecord:
                self._log(f"refused report {self._next_report}: {UNSEALED}")
                self._emit("refused_report", node=None, reason=UNSEALED)
                self._next_report += 1
                continue
            if report is None:
                return  # counted, not yet written
            self._next_report += 1
            why = self._report_refusal(report)
            if why:
                self._log(f"refused report of node {report.node}: {why}")
                self._emit("refused_report", node=report.node, reason=why)
                continue
            if report.kind == "started":
                self.rank_started(report.slot, report.incarnation, report.time)
            else:
                self.rank_exited(RankExit(report.slot, report.incarnation, report.code, report.time))

    def _report_refusal(self, report: AgentReport) -> str:
        remote = 0 <= report.node < self.nodes.count and report.node != self.local_node
        if report.kind not in ("started", "exited") or not remote:
            return f"kind {report.kind!r} from node {report.node}"
        if report.slot not in self.nodes.slots(report.node):
            return f"slot {report.slot} is not on node {report.node}"
        if (report.node, report.node_incarnation) in self._dead_nodes:
            return f"its incarnation {report.node_incarnation} was failed (lease lapsed)"
        return ""

    def _check_leases(self, older_than: float | None = None) -> list[int]:
        """Fail every node whose lease is older than ``older_than`` (default: the lease timeout), all
        of its member ranks in one change; returns the nodes failed."""
        limit = self.nodes.lease_seconds if older_than is None else older_than
        failed = []
        now = time.time()
        # Leases can only be judged while this coordinator kept up with them: after a stall of its
        # own (or of the store) every lease looks old, yet the agents may have been renewing.
        stalled = now - self._leases_read_at
        self._leases_read_at = now
        if stalled > limit / 2:
            self._log(f"lease checks were delayed {stalled:.1f} s: judging the nodes' leases again from now on")
            self._emit("lease_checks_delayed", seconds=stalled)
            return failed
        for node, lease in self._read_leases().items():
            age = now - lease.time
            if age <= limit or (node, lease.node_incarnation) in self._dead_nodes:
                continue
            self._dead_nodes.add((node, lease.node_incarnation))
            failed.append(node)
            self._fail_node(node, f"lease of node {node} (incarnation {lease.node_incarnation}) lapsed {age:.2f} s ago")
        return failed

    def _current_membership(self) -> Membership:
        """The current epoch's membership: one read of ``current_epoch``, the record only when it moved."""
        epoch = self._store.current_epoch()
        if self._membership is None or self._membership.epoch != epoch:
            self._membership = self._store.membership(epoch)
        return self._membership

    def _read_leases(self) -> dict[int, Lease]:
        """Every other node's lease (a node that has none yet is left out); kept for the beats."""
        nodes = [node for node in range(self.nodes.count) if node != self.local_node]
        read = self._store.leases(nodes)
        # A lease older than one already read is a replay (a sealed record written again by someone
        # else): the newer one stands until the agent renews.
        for node, lease in read.items():
            known = self._leases.get(node)
            if known is None or (lease.node_incarnation, lease.time) >= (known.node_incarnation, known.time):
                self._leases[node] = lease
        return dict(self._leases)

    def _renew_local_lease(self) -> None:
        """This host's node's lease, with its ranks' beats (read by the status page; its age is never
        judged: this coordinator is that node's agent)."""
        if self.local_node is None or not self.beats_dir:
            return
        if time.monotonic() - self._last_local_lease < renew_seconds(self.nodes.lease_seconds):
            return
        self._last_local_lease = time.monotonic()
        lease = Lease(0, time.time(), read_beats(self.beats_dir, self.nodes.slots(self.local_node)))
        self._store.renew_lease(self.local_node, lease)

    def _beats(self) -> dict[int, tuple[Beat, float]]:
        """Every rank's last beat, with the time it is judged at: this node's from its files (now),
        the others' from their leases as the lease check read them last (at the lease's time: a
        node whose agent stopped renewing is judged by its lease, as a whole, not rank by rank)."""
        beats: dict[int, tuple[Beat, float]] = {}
        for lease in self._leases.values():
            beats.update((slot, (beat, lease.time)) for slot, beat in lease.beats.items())
        if self.local_node is not None and self.beats_dir:
            now = time.time()
            local = read_beats(self.beats_dir, self.nodes.slots(self.local_node))
            beats.update((slot, (beat, now)) for slot, beat in local.items())
        return beats

    def _fail_node(self, node: int, detail: str) -> None:
        membership = self._store.membership()
        slots = [slot for slot in self.nodes.slots(node) if slot in membership.members and not self._failed(slot)]
        with self._lock:
            for slot in self.nodes.slots(node):
                if slot in self._incarnations:
                    self._incarnations[slot].running = False
        joining = [slot for slot in self.nodes.slots(node) if self._join_pending(slot, membership)]
        now = time.time()
        self._append_all([(FAILED, slot, now, detail) for slot in slots + joining])
        self._log(f"published failure of node {node}: slots {slots + joining} in one change ({detail})")
        for slot in slots + joining:
            self._emit("published_failure", slot=slot, cause="node", why=detail, epoch=membership.epoch, node=node)

    def _join_pending(self, slot: int, membership: Membership) -> bool:
        last = self._last_change(slot)
        return slot not in membership.members and last is not None and last.kind == JOIN

    def _failed(self, slot: int) -> bool:
        last = self._last_change(slot)
        return last is not None and last.kind == FAILED

    def _kill_rank(self, slot: int, incarnation: int) -> None:
        node = self.nodes.node_of(slot)
        if node == self.local_node:
            self._kill(slot, incarnation)
            return
        self._store.order_kill(node, KillOrder(slot, incarnation))

    def _answer_probe(self, request: Request) -> None:
        """A member's peer stopped answering and no failure was published: every member whose
        process has ended (whatever its code: a member that exits 0 before the job is finished
        leaves its peers waiting too) is published as failed."""
        membership = self._store.membership()
        ended = []
        for slot in membership.members:
            with self._lock:
                incarnation = self._incarnations.get(slot)
            last = self._last_change(slot)
            if incarnation is not None and not incarnation.running and not (last and last.kind == FAILED):
                ended.append(slot)
                self._append(FAILED, slot, time.time(), "ended while still a member")
                why = "ended while still a member"
                self._emit("published_failure", slot=slot, cause="probe", why=why, epoch=membership.epoch)
        if self.nodes.count > 1:
            # A node whose agent died with its ranks reports nothing: its lease is only getting old.
            quiet = self._check_leases(older_than=max(0.3, 3 * renew_seconds(self.nodes.lease_seconds)))
            ended += [slot for node in quiet for slot in self.nodes.slots(node)]
        found = f"published failure of ended members {ended}" if ended else "every member's process is running"
        first = (request.slot, membership.epoch) not in self._probed
        self._probed.add((request.slot, membership.epoch))
        if ended or first:  # a survivor probes every 0.1 s until a failure is published
            self._log(f"probe from slot {request.slot} (pid {request.pid}) in epoch {membership.epoch}: {found}")
            self._emit("probe", slot=request.slot, pid=request.pid, epoch=membership.epoch, ended=ended)

    def _check_heartbeats(self) -> None:
        membership = self._current_membership()
        beats = self._beats()
        now = time.time()
        published = [beats[s][0].iteration_seconds for s in membership.members if s in beats]
        worst_iteration = max((seconds for seconds in published if seconds is not None), default=None)
        gaps = [gap for recent in self._gaps.values() for gap in recent]
        timeout = self.policy.timeout(worst_iteration, max(gaps) if gaps else None)
        for slot in membership.members:
            with self._lock:
                incarnation = self._incarnations.get(slot)
            if incarnation is None or not incarnation.running or self._out(slot):
                continue
            beat, judged_at = beats.get(slot, (None, now))
            if beat is not None and beat.time >= incarnation.started:
                if beat.stopped:
                    continue
                self._job_heartbeats = True
                self._note_beat(slot, incarnation.number, beat.time)
                age = judged_at - beat.time
                if age > timeout:
                    detail = f"heartbeat stale {age:.2f} s (timeout {timeout:.2f} s)"
                    self._declare_hung(slot, incarnation.number, detail, membership.epoch)
            elif self._job_heartbeats and now - incarnation.started > self.policy.startup_timeout:
                detail = f"no heartbeat {now - incarnation.started:.1f} s after start"
                self._declare_hung(slot, incarnation.number, detail, membership.epoch)

    def _note_beat(self, slot: int, incarnation: int, beat: float) -> None:
        """Keep the last GAP_WINDOW gaps between consecutive heartbeats of a member's current
        process (the gap from a dead process's last beat to its respawn's first is no jitter)."""
        last = self._last_beat.get(slot)
        if last is None or last[0] != incarnation:
            self._gaps.pop(slot, None)
        elif beat > last[1]:
            self._gaps.setdefault(slot, collections.deque(maxlen=GAP_WINDOW)).append(beat - last[1])
        self._last_beat[slot] = (incarnation, beat)

    def _declare_hung(self, slot: int, incarnation: int, detail: str, epoch: int) -> None:
        self._append(FAILED, slot, time.time(), detail)
        self._log(f"published failure of slot {slot}: {detail}; killing its process")
        self._emit("published_failure", slot=slot, cause="heartbeat", why=detail, epoch=epoch)
        self._kill_rank(slot, incarnation)

    # ---- pending -------------------------------------------------------------------------------

    def _append(self, kind: str, slot: int, when: float, detail: str, target: int | None = None) -> None:
        self._append_all([(kind, slot, when, detail, target)])

    def _append_all(self, changes: list[tuple]) -> None:
        """Append ``changes`` (kind, slot, time, detail[, target]) in one write: a decision takes all
        or none (``alert`` counts them only once their keys are written). One more write wakes
        every node's agent (each blocks on its own node's next alert key, and wakes its ranks'
        watchers in turn: :mod:`ds_recycle.runtime.node.node_watch`): no one polls."""
        if not changes:
            return
        with self._lock:
            start = len(self._pending)
            for kind, slot, when, detail, *target in changes:
                self._pending.append(Change(len(self._pending), kind, slot, when, detail, *target))
            new = self._pending[start:]
        self._store.append_changes(start, new, self.nodes.count)

    def _last_change(self, slot: int) -> Change | None:
        with self._lock:
            for change in reversed(self._pending):
                if change.slot == slot:
                    return change
        return None

    def _out(self, slot: int) -> bool:
        """The slot's last change is a failure, a leave or a move: it is on its way out already."""
        last = self._last_change(slot)
        return last is not None and last.kind in OUT_KINDS


def _ignore(event: str, **fields: object) -> None:
    pass
