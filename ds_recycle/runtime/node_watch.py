"""A node's one watch of the job's changes, served to its ranks over loopback.

When the coordinator appends changes it wakes one key per node (``node_alert/<node>/<k>``), not one
per rank. The node's agent blocks on its node's next key and copies what its ranks' failure watchers
read into a store of its own on 127.0.0.1 (``DS_RECYCLE_NODE_STORE``), under the same keys: the new
``change/<seq>``, the latest epoch's record with the boundary decision that made it and
``current_epoch``, then ``alert``, then each of its slots' ``alert/<slot>/<k>``. A rank's watcher
(:class:`~ds_recycle.runtime.waiting.FailureWatcher`) and a survivor's wait for the failure to be
published (:meth:`~ds_recycle.runtime.membership.MembershipAgent.recover`) block there. So a change
costs the job's store a few operations per node instead of per rank.

After a failure the survivors fix one recovery decision (``recovery/<n>``) on the job's store, then
enter the epoch it makes (``entered/<n+1>``, set once every member counted itself in). When the
agent copies a failure it also waits, in a thread of its own, for the recovery decision of the
epoch it copied with it, then for the entry into the epoch that decision makes, and copies each:
the node's survivors wait for them on the node's store, and look at the job's only when a slice of
their wait passes without them (the decision may be made in a later epoch).

The copy is a prefix of the job's changes, read after they were published: changes are written
once and appended only, and an epoch's record and its decision are written before
``current_epoch`` names it. A rank that reads the node's store reads what it would have read from
the job's a moment earlier. Every decision is still taken on the job's store.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta

from ds_recycle.runtime import protocol as proto
from ds_recycle.runtime.protocol import Decision, Membership

WATCH_TIMEOUT_SECONDS = 600.0
"""The longest single wait for the node's next alert key (a stopping watch wakes itself)."""
DECISION_SLICE_SECONDS = 1.0
"""The wait for a recovery decision looks this often whether a later failure moved its target..."""
DECISION_SLICES = 30
"""...and gives up after this many slices (a failure that stopped nobody: a joiner's, say)."""


class NodeWatch:
    """Hosts the node's store and keeps its copy of the job's changes (see the module doc)."""

    def __init__(
        self, job_address: str, generation: int, node: int, slots: range, log: Callable[[str], None] | None = None
    ) -> None:
        self.node, self.slots, self.generation = node, slots, generation
        self._log = log or (lambda line: None)
        self._server = proto.serve("127.0.0.1", 0)
        self.address = f"127.0.0.1:{self._server.port}"
        self._job = proto.connect(job_address, generation)
        self._waker = proto.connect(job_address, generation)
        self._local: proto.Store | None = None
        self.seen = 0
        """How many changes the node's store holds."""
        self._epoch = -1
        """The latest epoch copied."""
        self._decisions = proto.connect(job_address, generation)
        self._awaited: tuple[int, int] | None = None
        """The epoch whose recovery decision is awaited (copied with the latest failure), and the
        changes copied with it."""
        self._awaited_changed = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._decision_thread: threading.Thread | None = None

    def start(self) -> NodeWatch:
        """Copy the changes and the epoch so far (before the node's ranks start), then watch."""
        self._local = proto.connect(self.address, self.generation)
        self._copy(int(self._job.add(proto.ALERT, 0)))
        self._thread = threading.Thread(target=self._run, name=f"recycle-node-watch-{self.node}", daemon=True)
        self._thread.start()
        name = f"recycle-node-decisions-{self.node}"
        self._decision_thread = threading.Thread(target=self._copy_decisions, name=name, daemon=True)
        self._decision_thread.start()
        return self

    def _run(self) -> None:
        from torch.distributed import DistStoreError

        while not self._stop.is_set():
            key = proto.node_alert_key(self.node, self.seen + 1)
            try:
                self._job.wait([key], timedelta(seconds=WATCH_TIMEOUT_SECONDS))
                if self._stop.is_set():
                    return
                count = proto.alert_count_after(self._job, key, self.seen)
                if count > self.seen:
                    self._copy(count)
            except DistStoreError:  # the wait timed out: nothing changed meanwhile
                continue
            except Exception as error:
                self._lost(error)
                return

    def _copy(self, count: int) -> None:
        """Copy changes ``seen`` .. ``count - 1`` and the latest epoch, then wake the node's ranks."""
        keys = [proto.change_key(seq) for seq in range(self.seen, count)]
        values = list(self._job.multi_get(keys)) if keys else []
        failure = any(proto.Change.from_json(value).kind == proto.FAILED for value in values)
        epoch = int(self._job.get(proto.CURRENT_EPOCH))
        if epoch > self._epoch:
            record = self._job.get(proto.epoch_key(epoch))
            keys.append(proto.epoch_key(epoch))
            values.append(record)
            if epoch > 0:
                made_by = proto.decision_key(epoch - 1, Membership.from_json(record).iteration)
                if self._job.check([made_by]):
                    keys.append(made_by)
                    values.append(self._job.get(made_by))
            keys.append(proto.CURRENT_EPOCH)
            values.append(str(epoch))
            self._epoch = epoch
        if not keys:
            return
        added = count - self.seen
        if failure:
            with self._awaited_changed:
                self._awaited = (epoch, count)
                self._awaited_changed.notify()
        proto.publish_changes(self._local, keys, values, added, lambda k: [proto.alert_key(s, k) for s in self.slots])
        self.seen = count

    def _copy_decisions(self) -> None:
        """For the failure awaited: copy its epoch's recovery decision, then the entry into the
        epoch that decision makes, into the node's store."""
        local = proto.connect(self.address, self.generation)
        done = None
        while not self._stop.is_set():
            with self._awaited_changed:
                while self._awaited in (None, done) and not self._stop.is_set():
                    self._awaited_changed.wait(DECISION_SLICE_SECONDS)
                awaited = self._awaited
            if self._stop.is_set():
                return
            try:
                decision = self._copy_when_set(proto.recovery_key(awaited[0]), awaited, local)
                if decision is not None:
                    self._copy_when_set(proto.entered_key(Decision.from_json(decision).next.epoch), awaited, local)
            except Exception:  # a store is gone: the watch's own thread closes the node's store
                return
            done = awaited

    def _copy_when_set(self, key: str, awaited: tuple[int, int], local: proto.Store) -> bytes | None:
        """Copy ``key`` (written once) from the job's store once it is set, and return its value;
        None when a later failure is awaited instead, or after DECISION_SLICES slices."""
        from torch.distributed import DistStoreError

        for _ in range(DECISION_SLICES):
            if self._stop.is_set() or self._awaited != awaited:
                return None
            try:
                self._decisions.wait([key], timedelta(seconds=DECISION_SLICE_SECONDS))
            except DistStoreError:
                continue
            value = self._decisions.get(key)
            local.set(key, value)
            return value
        return None

    def _lost(self, error: Exception) -> None:
        """The job's store cannot be reached (the job ended, or this node is cut off and its lease
        lapses): the node's store goes too, so that every watcher on it wakes and stops its rank."""
        self._log(f"node {self.node} lost the job's store ({type(error).__name__}: {error}); closing its node store")
        self._server = None

    def stop(self, timeout: float = 2.0) -> None:
        """Stop watching (the watch wakes itself) and close the node's store."""
        self._stop.set()
        with self._awaited_changed:
            self._awaited_changed.notify()
        try:
            self._waker.set(proto.node_alert_key(self.node, self.seen + 1), "stop")
        except Exception:  # the job's store is gone already
            pass
        for thread in (self._thread, self._decision_thread):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout)
        self._server = None
