"""A node's one watch of the job's changes, served to its ranks over loopback.

When the coordinator appends changes it wakes one key per node (``node_alert/<node>/<k>``), not one
per rank. The node's agent blocks on its node's next key and copies what its ranks' failure watchers
read into a store of its own on 127.0.0.1 (``DS_RECYCLE_NODE_STORE``), under the same keys: the new
``change/<seq>``, the latest epoch's record with the boundary decision that made it and
``current_epoch``, then ``alert``, then each of its slots' ``alert/<slot>/<k>``. A rank's watcher
(:class:`~ds_recycle.runtime.rank.waiting.FailureWatcher`) and a survivor's wait for the failure to be
published (:meth:`~ds_recycle.runtime.rank.membership.MembershipAgent.recover`) block there. So a change
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
from functools import partial
from typing import TypeVar

from ds_recycle.runtime.shared import transport
from ds_recycle.runtime.shared.c10d_store import C10dJobStore
from ds_recycle.runtime.shared.job_store import JobStore

T = TypeVar("T")

DECISION_SLICE_SECONDS = 1.0
"""The wait for a recovery decision looks this often whether a later failure moved its target..."""
DECISION_SLICES = 30
"""...and gives up after this many slices (a failure that stopped nobody: a joiner's, say)."""


class NodeWatch:
    """Hosts the node's store and keeps its copy of the job's changes (see the module doc)."""

    def __init__(
        self,
        job_address: str,
        generation: int,
        node: int,
        slots: range,
        token: str,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.node, self.slots, self.generation, self.token = node, slots, generation, token
        self._log = log or (lambda line: None)
        self._server = transport.serve("127.0.0.1", 0)
        self.address = f"127.0.0.1:{self._server.port}"
        self._job = C10dJobStore.connect(job_address, generation, token)
        self._waker = C10dJobStore.connect(job_address, generation, token)
        self._local: JobStore | None = None
        self.seen = 0
        """How many changes the node's store holds."""
        self._epoch = -1
        """The latest epoch copied."""
        self._decisions = C10dJobStore.connect(job_address, generation, token)
        self._awaited: tuple[int, int] | None = None
        """The epoch whose recovery decision is awaited (copied with the latest failure), and the
        changes copied with it."""
        self._awaited_changed = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._decision_thread: threading.Thread | None = None

    def start(self) -> NodeWatch:
        """Copy the changes and the epoch so far (before the node's ranks start), then watch."""
        self._local = C10dJobStore.connect(self.address, self.generation, self.token)
        self._copy(self._job.alert_count())
        self._thread = threading.Thread(target=self._run, name=f"recycle-node-watch-{self.node}", daemon=True)
        self._thread.start()
        name = f"recycle-node-decisions-{self.node}"
        self._decision_thread = threading.Thread(target=self._copy_decisions, name=name, daemon=True)
        self._decision_thread.start()
        return self

    def _run(self) -> None:
        try:
            for count in self._job.node_alerts(self.node, lambda: self.seen, self._stop):
                self._copy(count)
        except Exception as error:
            self._lost(error)

    def _copy(self, count: int) -> None:
        """Copy changes ``seen`` .. ``count - 1`` and the latest epoch, then wake the node's ranks."""
        copy = self._job.read_copy(self.seen, count, self._epoch)
        self._epoch = max(self._epoch, copy.epoch)
        if not copy.entries:
            return
        if copy.failure:
            with self._awaited_changed:
                self._awaited = (copy.epoch, count)
                self._awaited_changed.notify()
        self._local.write_copy(copy, self.slots)
        self.seen = count

    def _copy_decisions(self) -> None:
        """For the failure awaited: copy its epoch's recovery decision, then the entry into the
        epoch that decision makes, into the node's store."""
        local = C10dJobStore.connect(self.address, self.generation, self.token)
        done = None
        while not self._stop.is_set():
            with self._awaited_changed:
                while self._awaited in (None, done) and not self._stop.is_set():
                    self._awaited_changed.wait(DECISION_SLICE_SECONDS)
                awaited = self._awaited
            if self._stop.is_set():
                return
            try:
                decision = self._await(
                    partial(self._decisions.await_recovery, awaited[0], DECISION_SLICE_SECONDS), awaited
                )
                if decision is not None:
                    local.copy_recovery(decision)
                    epoch = decision.next.epoch
                    if self._await(partial(self._decisions.wait_for_entry, epoch, DECISION_SLICE_SECONDS), awaited):
                        local.mark_entered(epoch)
            except Exception:  # a store is gone: the watch's own thread closes the node's store
                return
            done = awaited

    def _await(self, look: Callable[[], T | None], awaited: tuple[int, int]) -> T | None:
        """What ``look`` (a wait of one slice on the job's store) returns once it is something;
        None when a later failure is awaited instead, or after DECISION_SLICES slices."""
        for _ in range(DECISION_SLICES):
            if self._stop.is_set() or self._awaited != awaited:
                return None
            found = look()
            if found:
                return found
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
            self._waker.wake_node_watch(self.node, self.seen)
        except Exception:  # the job's store is gone already
            pass
        for thread in (self._thread, self._decision_thread):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout)
        self._server = None
