"""The job store over torch's c10d store (a ``TCPStore`` client, behind a ``PrefixStore`` for a
generation's keys): the one module that calls a store's raw operations for the protocol.

Every operation is the sequence of ``get``/``set``/``add``/``compare_set``/``check``/``wait``/
``multi_get``/``multi_set`` the protocol has always made (:mod:`ds_recycle.runtime.shared.keys` has the
table): a decision is one ``compare_set``, a counter is an ``add``, a waiter blocks in one ``wait``
that the server answers when the key is set.

Every record is sealed with the job token (:mod:`ds_recycle.runtime.shared.seal`). What a reader does
with a record whose seal is not the job's: a request, an agent's report, a kill order, a check-in, a
lease or the status record is ignored (read as absent), with one log line; any other record (the
job's epochs, changes, decisions, progress) raises :class:`~ds_recycle.runtime.shared.seal.ForgedRecord`,
since the protocol cannot go on past a record it cannot trust.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta

from ds_recycle.runtime.shared import keys, transport
from ds_recycle.runtime.shared.job_store import JobStore, NodeCopy, StoreRoot
from ds_recycle.runtime.shared.policy import boundary_leavers
from ds_recycle.runtime.shared.records import (
    FAILED,
    AgentEnd,
    AgentReport,
    Change,
    CheckIn,
    Decision,
    KillOrder,
    Lease,
    Membership,
    Progress,
    Request,
)
from ds_recycle.runtime.shared.seal import ForgedRecord, Seal
from ds_recycle.runtime.shared.status_schema import StatusReport
from ds_recycle.runtime.shared.transport import Store

WATCH_TIMEOUT_SECONDS = 600.0
"""The longest single wait for a watcher's next alert key (each timeout logs one c10d warning line,
so it is long: a stopping watcher wakes itself)."""


def _timed_out() -> type[Exception]:
    from torch.distributed import DistStoreError

    return DistStoreError


def _trusted(seal: Seal, key: str, value: bytes, what: str | None = None) -> bytes:
    """The record sealed in ``value`` at ``key``; raises ForgedRecord naming it (``what``, default
    the key) when its seal is not the job's."""
    record = seal.open(key, value)
    if record is not None:
        return record
    if what is not None:
        raise ForgedRecord(f"{what} is not sealed with this job's token")
    raise ForgedRecord(
        f"the record at {key!r} (generation {seal.generation}) is not sealed with this job's token: "
        "a process without the token wrote into the job's store, and the protocol cannot go on past it"
    )


class C10dStoreRoot(StoreRoot):
    """The root of a c10d store (a client without a generation prefix)."""

    def __init__(self, client: Store, token: str | None) -> None:
        self.client = client
        """The c10d client underneath."""
        self.seal = Seal(token)

    @classmethod
    def connect(
        cls,
        address: str,
        token: str | None,
        timeout: float = transport.STORE_TIMEOUT_SECONDS,
        connect_timeout: float | None = None,
    ) -> C10dStoreRoot:
        return cls(transport.connect(address, None, timeout, connect_timeout), token)

    def running_generation(self) -> int | None:
        if not self.client.check([keys.GENERATION]):
            return None
        what = f"the store's generation ({keys.GENERATION!r})"
        return int(_trusted(self.seal, keys.GENERATION, self.client.get(keys.GENERATION), what))

    def start_generation(self, generation: int) -> None:
        self.client.set(keys.GENERATION, self.seal.seal(keys.GENERATION, str(generation)))

    def check_in(self, check_in: CheckIn) -> None:
        key = keys.check_in_key(check_in.node)
        self.client.set(key, self.seal.seal(key, check_in.to_json()))

    def check_in_of(self, node: int) -> CheckIn | None:
        key = keys.check_in_key(node)
        if not self.client.check([key]):
            return None
        return CheckIn.from_json(_trusted(self.seal, key, self.client.get(key), f"the check-in of node {node}"))

    def withdraw_check_in(self, node: int) -> None:
        self.client.delete_key(keys.check_in_key(node))


class C10dJobStore(JobStore):
    """One generation's keys on a c10d store (see :class:`~ds_recycle.runtime.shared.job_store.JobStore`)."""

    def __init__(self, client: Store, token: str | None, generation: int) -> None:
        self.client = client
        """The c10d client underneath, under the generation's prefix (a harness counts its
        operations through it; torch builds groups on :meth:`world_rendezvous`)."""
        self.seal = Seal(token, generation)

    @classmethod
    def connect(
        cls,
        address: str,
        generation: int,
        token: str | None,
        timeout: float = transport.STORE_TIMEOUT_SECONDS,
        connect_timeout: float | None = None,
    ) -> C10dJobStore:
        """A new client of the store at ``host:port``, under generation ``generation``'s keys
        (:func:`~ds_recycle.runtime.shared.transport.connect` has the bounds)."""
        return cls(transport.connect(address, generation, timeout, connect_timeout), token, generation)

    # ---- sealed records ----------------------------------------------------------------------

    def _put(self, key: str, text: str) -> None:
        self.client.set(key, self.seal.seal(key, text))

    def _put_many(self, names: list[str], texts: list[str]) -> None:
        self.client.multi_set(names, [self.seal.seal(key, text) for key, text in zip(names, texts, strict=True)])

    def _read(self, key: str, what: str | None = None) -> bytes:
        """The record at ``key`` (blocking until it is written, as ``get`` does)."""
        return _trusted(self.seal, key, self.client.get(key), what)

    def _read_many(self, names: list[str]) -> list[bytes]:
        return [_trusted(self.seal, key, value) for key, value in zip(names, self.client.multi_get(names), strict=True)]

    def _read_if_set(self, key: str, what: str | None = None) -> bytes | None:
        return self._read(key, what) if self.client.check([key]) else None

    def _inbox(self, key: str) -> bytes | None:
        """A record anyone may post (a request, a report, an order): None when absent or when its
        seal is not the job's (ignored, with one log line)."""
        return self._opened(key, self.client.get(key)) if self.client.check([key]) else None

    def _opened(self, key: str, value: bytes) -> bytes | None:
        record = self.seal.open(key, value)
        if record is None:
            self.seal.report(key)
        return record

    def _first(self, key: str, text: str) -> bytes:
        """The record at ``key``: ``text`` if it is the first written there, else the first."""
        return _trusted(self.seal, key, self.client.compare_set(key, "", self.seal.seal(key, text)))

    def _wait(self, key: str, seconds: float) -> bool:
        """Block until ``key`` is set (True), or ``seconds`` passed (False): the server answers when
        it is set, so a waiter makes one store operation however long it waits."""
        try:
            self.client.wait([key], timedelta(seconds=seconds))
            return True
        except _timed_out():
            return False

    # ---- the job -----------------------------------------------------------------------------

    def open_job(self, world_size: int, nodes: int | None = None) -> None:
        self._put(keys.WORLD_SIZE, str(world_size))
        if nodes is not None:
            self._put(keys.NODES, str(nodes))
        self._put(keys.epoch_key(0), Membership(0, tuple(range(world_size)), 0).to_json())
        self._put(keys.CURRENT_EPOCH, "0")

    def world_size(self) -> int:
        return int(self._read(keys.WORLD_SIZE))

    def node_count(self) -> int | None:
        value = self._read_if_set(keys.NODES)
        return None if value is None else int(value)

    # ---- membership ----------------------------------------------------------------------------

    def current_epoch(self) -> int:
        return int(self._read(keys.CURRENT_EPOCH))

    def membership(self, epoch: int | None = None) -> Membership:
        if epoch is None:
            epoch = self.current_epoch()
        return Membership.from_json(self._read(keys.epoch_key(epoch)))

    def publish_epoch(self, membership: Membership) -> None:
        epoch = membership.epoch
        self._first(keys.epoch_key(epoch), membership.to_json())
        seal, current = self.seal.seal, keys.CURRENT_EPOCH
        self.client.compare_set(current, seal(current, str(epoch - 1)), seal(current, str(epoch)))

    def left_at_boundary(self, membership: Membership) -> set[int]:
        if membership.epoch == 0:
            return set()
        decision = self.decision(membership.epoch - 1, membership.iteration)
        if decision is None or decision.next != membership:
            return set()
        return boundary_leavers(decision)

    # ---- changes ---------------------------------------------------------------------------------

    def alert_count(self) -> int:
        return int(self.client.add(keys.ALERT, 0))

    def changes(self, known: list[Change] | None = None, count: int | None = None) -> list[Change]:
        known = known or []
        count = self.alert_count() if count is None else count
        if count <= len(known):
            return list(known)
        values = self._read_many([keys.change_key(seq) for seq in range(len(known), count)])
        return known + [Change.from_json(value) for value in values]

    def append_changes(self, start: int, changes: list[Change], nodes: int) -> int:
        names = [keys.change_key(c.seq) for c in changes]
        sealed = [self.seal.seal(key, c.to_json()) for key, c in zip(names, changes, strict=True)]
        return self._publish_changes(
            names, sealed, len(changes), lambda k: [keys.node_alert_key(n, k) for n in range(nodes)]
        )

    def _publish_changes(
        self, names: list[str], sealed: list[bytes], added: int, alert_keys: Callable[[int], list[str]]
    ) -> int:
        """Write ``names`` (``added`` new changes and what goes with them, sealed), then move
        ``alert`` on by ``added``, then set ``alert_keys(k)`` for each new count k, in one
        ``multi_set``: a waiter woken by its key reads everything written before it. Returns the new
        count."""
        self.client.multi_set(names, sealed)
        count = int(self.client.add(keys.ALERT, added))
        woken = [key for k in range(count - added + 1, count + 1) for key in alert_keys(k)]
        if woken:
            self.client.multi_set(woken, ["1"] * len(woken))
        return count

    def read_copy(self, seen: int, count: int, copied_epoch: int) -> NodeCopy:
        names = [keys.change_key(seq) for seq in range(seen, count)]
        values = list(self.client.multi_get(names)) if names else []
        failure = any(
            Change.from_json(_trusted(self.seal, n, v)).kind == FAILED for n, v in zip(names, values, strict=True)
        )
        current = self.client.get(keys.CURRENT_EPOCH)
        epoch = int(_trusted(self.seal, keys.CURRENT_EPOCH, current))
        if epoch > copied_epoch:
            record = self.client.get(keys.epoch_key(epoch))
            names.append(keys.epoch_key(epoch))
            values.append(record)
            if epoch > 0:
                made_by = keys.decision_key(
                    epoch - 1, Membership.from_json(_trusted(self.seal, names[-1], record)).iteration
                )
                if self.client.check([made_by]):
                    names.append(made_by)
                    values.append(self.client.get(made_by))
            names.append(keys.CURRENT_EPOCH)
            values.append(current)
        return NodeCopy(count, count - seen, epoch, failure, tuple(zip(names, values, strict=True)))

    def write_copy(self, copy: NodeCopy, slots: Iterable[int]) -> None:
        slots = tuple(slots)
        names, values = [name for name, _ in copy.entries], [value for _, value in copy.entries]
        self._publish_changes(names, values, copy.added, lambda k: [keys.alert_key(s, k) for s in slots])

    def _alerts(self, key_of: Callable[[int], str], seen: Callable[[], int], stop: threading.Event) -> Iterator[int]:
        """The one alert-wait loop (a node's agent's and a rank's failure watcher's): block on the
        waiter's next alert key, and yield the ``alert`` count once it moved past what was seen. A
        key set by a stop (the waiter woke itself, or an earlier waiter of its slot or node did) is
        deleted; then the count is read again, since the writer may have set the key for real just
        before the delete (it counts first)."""
        while not stop.is_set():
            last = seen()
            key = key_of(last + 1)
            try:
                self.client.wait([key], timedelta(seconds=WATCH_TIMEOUT_SECONDS))
                if stop.is_set():
                    return
                count = self.alert_count()
                if count <= last:
                    self.client.delete_key(key)
                    count = self.alert_count()
            except _timed_out():  # the wait timed out: nothing changed meanwhile
                continue
            if count > last:
                yield count

    def node_alerts(self, node: int, seen: Callable[[], int], stop: threading.Event) -> Iterator[int]:
        return self._alerts(lambda k: keys.node_alert_key(node, k), seen, stop)

    def slot_alerts(self, slot: int, seen: Callable[[], int], stop: threading.Event) -> Iterator[int]:
        return self._alerts(lambda k: keys.alert_key(slot, k), seen, stop)

    def wake_node_watch(self, node: int, seen: int) -> None:
        self.client.set(keys.node_alert_key(node, seen + 1), "stop")

    def wake_slot_watcher(self, slot: int, seen: int) -> None:
        self.client.set(keys.alert_key(slot, seen + 1), "stop")

    def wait_for_alert(self, slot: int, count: int, seconds: float) -> bool:
        return self._wait(keys.alert_key(slot, count), seconds)

    # ---- requests and reports --------------------------------------------------------------------

    def post_request(self, request: Request) -> int:
        index = int(self.client.add(keys.REQUEST_COUNT, 1))
        self._put(keys.request_key(index), request.to_json())
        return index

    def open_inboxes(self) -> None:
        for counter in (keys.REQUEST_COUNT, keys.REPORT_COUNT):
            self.client.add(counter, 0)  # both exist from now on: each look reads them in one go

    def inbox_counts(self) -> tuple[int, int]:
        requests, reports = (int(v) for v in self.client.multi_get([keys.REQUEST_COUNT, keys.REPORT_COUNT]))
        return requests, reports

    def posted_request(self, index: int) -> bytes | None:
        return self._read_if_set(keys.request_key(index), f"request {index}")

    def post_report(self, report: AgentReport) -> int:
        index = int(self.client.add(keys.REPORT_COUNT, 1))
        self._put(keys.report_key(index), report.to_json())
        return index

    def report(self, index: int) -> AgentReport | None:
        value = self._read_if_set(keys.report_key(index), f"agent report {index}")
        return None if value is None else AgentReport.from_json(value)

    def save_cursor(self, request: int, report: int) -> None:
        self._put(keys.COORDINATOR_CURSOR, json.dumps([request, report]))

    def cursor(self) -> tuple[int, int]:
        value = self._read_if_set(keys.COORDINATOR_CURSOR)
        if value is None:
            return 1, 1
        request, report = json.loads(value)
        return int(request), int(report)

    # ---- decisions -----------------------------------------------------------------------------

    def _propose(self, key: str, proposal: Decision) -> Decision:
        return Decision.from_json(self._first(key, proposal.to_json()))

    def propose_decision(self, proposal: Decision) -> Decision:
        return self._propose(keys.decision_key(proposal.epoch, proposal.iteration), proposal)

    def decision(self, epoch: int, iteration: int) -> Decision | None:
        value = self._read_if_set(keys.decision_key(epoch, iteration))
        return None if value is None else Decision.from_json(value)

    def propose_recovery(self, proposal: Decision) -> Decision:
        return self._propose(keys.recovery_key(proposal.epoch), proposal)

    def recovery(self, epoch: int) -> Decision | None:
        value = self._read_if_set(keys.recovery_key(epoch))
        return None if value is None else Decision.from_json(value)

    def await_recovery(self, epoch: int, seconds: float) -> Decision | None:
        key = keys.recovery_key(epoch)
        if not self._wait(key, seconds):
            return None
        return Decision.from_json(self._read(key))

    def copy_recovery(self, decision: Decision) -> None:
        self._put(keys.recovery_key(decision.epoch), decision.to_json())

    # ---- recovery progress ---------------------------------------------------------------------

    def post_progress(self, epoch: int, slot: int, progress: Progress) -> None:
        self._put(keys.progress_key(epoch, slot), progress.to_json())

    def count_progress(self, epoch: int, posts: int = 0) -> int:
        return int(self.client.add(keys.progress_count_key(epoch), posts))

    def progress_posted(self, epoch: int, slots: list[int]) -> bool:
        return self.client.check([keys.progress_key(epoch, s) for s in slots])

    def progress_of(self, epoch: int, slots: list[int]) -> dict[int, Progress]:
        values = self._read_many([keys.progress_key(epoch, s) for s in slots])
        return dict(zip(slots, map(Progress.from_json, values), strict=True))

    def forward_progress(self, epoch: int, posts: dict[int, Progress]) -> int:
        names = [keys.progress_key(epoch, slot) for slot in posts]
        self._put_many(names, [post.to_json() for post in posts.values()])
        return self.count_progress(epoch, len(names))

    def claim_forwarding(self, epoch: int, slot: int, survivors: list[int]) -> bool:
        key, me = keys.progress_forwarder_key(epoch), self.seal.seal(keys.progress_forwarder_key(epoch), str(slot))
        claim = self.client.compare_set(key, "", me)
        if claim != me and int(_trusted(self.seal, key, claim)) not in survivors:
            claim = self.client.compare_set(key, claim, me)
        return claim == me

    # ---- entering an epoch --------------------------------------------------------------------

    def count_ready(self, epoch: int, members: int) -> int:
        return int(self.client.add(keys.ready_key(epoch), members))

    def mark_entered(self, epoch: int) -> None:
        self._put(keys.entered_key(epoch), "1")

    def entered(self, epoch: int) -> bool:
        return self.client.check([keys.entered_key(epoch)])

    def wait_for_entry(self, epoch: int, seconds: float) -> bool:
        return self._wait(keys.entered_key(epoch), seconds)

    def world_rendezvous(self, epoch: int) -> Store:
        import torch.distributed as dist

        return dist.PrefixStore(
            keys.world_prefix(epoch), transport.rendezvous_client(self.client, self.seal.generation)
        )

    # ---- nodes -----------------------------------------------------------------------------------

    def next_node_incarnation(self, node: int) -> int:
        return int(self.client.add(keys.node_incarnation_key(node), 1))

    def set_domain(self, node: int, domain: str) -> None:
        self._put(keys.domain_key(node), domain)

    def domain_labels(self, nodes: int, timeout_seconds: float) -> dict[int, str]:
        names = [keys.domain_key(node) for node in range(nodes)]
        self.client.wait(names, timedelta(seconds=timeout_seconds))
        return {node: value.decode() for node, value in enumerate(self._read_many(names))}

    def renew_lease(self, node: int, lease: Lease) -> None:
        self._put(keys.lease_key(node), lease.to_json())

    def lease(self, node: int) -> Lease | None:
        value = self._inbox(keys.lease_key(node))
        return None if value is None else Lease.from_json(value)

    def leases(self, nodes: list[int]) -> dict[int, Lease]:
        names = [keys.lease_key(node) for node in nodes]
        if self.client.check(names):  # the steady state: one round trip
            values = [self._opened(key, value) for key, value in zip(names, self.client.multi_get(names), strict=True)]
        else:
            values = [self._inbox(key) for key in names]
        return {node: Lease.from_json(v) for node, v in zip(nodes, values, strict=True) if v is not None}

    def order_kill(self, node: int, order: KillOrder) -> None:
        index = int(self.client.add(keys.kill_count_key(node), 1))
        self._put(keys.kill_key(node, index), order.to_json())

    def kill_count(self, node: int) -> int:
        return int(self.client.add(keys.kill_count_key(node), 0))

    def kill_order(self, node: int, index: int) -> KillOrder | None:
        value = self._inbox(keys.kill_key(node, index))
        return None if value is None else KillOrder.from_json(value)

    def end_node(self, node: int, end: AgentEnd) -> None:
        self._put(keys.ended_key(node), end.to_json())

    def node_end(self, node: int) -> AgentEnd | None:
        value = self._read_if_set(keys.ended_key(node))
        return None if value is None else AgentEnd.from_json(value)

    # ---- what the ranks publish --------------------------------------------------------------------

    def publish_status(self, report: StatusReport) -> None:
        self._put(keys.STATUS, report.to_json())

    def status_report(self) -> StatusReport | None:
        value = self._inbox(keys.STATUS)
        return None if value is None else StatusReport.from_json(value)

    def commit_evaluation(self, key: str, loss: float) -> None:
        self._put(keys.EVAL_COMMITTED, json.dumps({"key": key, "loss": float(loss)}))

    def committed_evaluation(self) -> tuple[str, float] | None:
        value = self._read_if_set(keys.EVAL_COMMITTED)
        if value is None:
            return None
        committed = json.loads(value)
        return str(committed["key"]), float(committed["loss"])
