"""The membership agent: a trainer's side of the coordinator protocol (keys.py has the keys).

It knows the current epoch, posts this process's requests (leave on a preemption signal, join
after a respawn, a probe when a peer stopped answering), takes the per-boundary decision and the
after-failure recovery decision that every member of the epoch shares, and keeps a heartbeat so
that the launcher can tell a hung process from a slow one. It decides nothing alone and holds no
engine: :mod:`ds_recycle.runtime.rank.recovery` drives it.

A decision is one ``compare_set``: the first member to propose fixes it and everyone else reads
its proposal back, so all members apply the same changes at the same iteration, whatever their
relative progress.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ds_recycle.errors import EpochSuperseded, MemberFailed, MembershipError
from ds_recycle.log import logger
from ds_recycle.runtime.shared import keys, policy
from ds_recycle.runtime.shared.beats import write_beat
from ds_recycle.runtime.shared.c10d_store import C10dJobStore
from ds_recycle.runtime.shared.job_store import JobStore
from ds_recycle.runtime.shared.placement import NodeLayout
from ds_recycle.runtime.shared.records import (
    FAILED,
    JOIN,
    LEAVE,
    OUT_KINDS,
    PROBE,
    Beat,
    Change,
    Decision,
    Membership,
    Progress,
    Request,
)

HEARTBEAT_SECONDS = 0.1
EXIT_GRACE_SECONDS = 30.0
"""The last heartbeat, written at interpreter exit, is dated this far ahead: tearing down torch and
gloo can take longer than the hang timeout, and an exiting process is not a hung one."""
PROBE_AFTER_SECONDS = 0.1
"""A survivor whose peer stopped answering asks the coordinator after this long without a published
failure, and again every as long until one is published."""
RECOVERY_SLICE_SECONDS = 0.25
"""A survivor blocks on the recovery decision this long at a time, then looks whether a change was
published meanwhile (a survivor died: the remaining ones may all have posted)..."""
RECOVERY_CHECK_SLICES = 4
"""...and every this many slices at the job's store (the decision may be made in a later epoch, or
its copy come late): with thousands of survivors, a look per slice would load the store more than
the decision does."""
ENTER_SLICE_SECONDS = 0.1
"""A member entering an epoch blocks on ``entered/<n>`` this long at a time, then looks at its
failure flag (no store operation)..."""
ENTER_CHECK_SLICES = 5
"""...and every this many slices at the store (a member failed, the epoch was superseded)."""
LEAVE_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@dataclass
class MembershipAgent:
    address: str
    slot: int
    token: str
    incarnation: int
    generation: int
    store: JobStore | None = None
    """The job's store (:class:`~ds_recycle.runtime.shared.job_store.JobStore`)."""
    node_address: str | None = None
    """The node's store (``DS_RECYCLE_NODE_STORE``): the node's agent copies the job's changes
    there, and this rank's watcher waits on it (:mod:`ds_recycle.runtime.node.node_watch`)."""
    node_store: JobStore | None = None
    """The agent's client of the node's store."""
    node_slots: tuple[int, ...] = ()
    """The slots of this rank's node, whose ranks share its store: their recovery progress and
    their entries into an epoch are counted there and reach the job's store once per node."""
    current: Membership | None = None
    applied: int = 0
    """How many entries of ``pending`` the decisions so far have taken."""
    leave_requested: bool = False
    requested_at: float = 0.0
    """When this process last posted its join request (wall clock)."""
    _known: list[Change] | None = field(default=None, repr=False)
    """``pending`` as this rank's watcher read it last (:meth:`note_changes`)."""
    _posted_in: int | None = field(default=None, repr=False)
    """The epoch in which this process last posted its recovery progress."""
    _forwarded_in: int | None = field(default=None, repr=False)
    """The epoch in which this process last copied its node's posts to the job's store."""
    _records: dict[int, Membership] = field(default_factory=dict, repr=False)
    """Epoch records read so far (:meth:`_latest`)."""
    _leavers: dict[int, set[int]] = field(default_factory=dict, repr=False)
    """By epoch: the leavers the boundary decision that made it took out (:meth:`_concerned`), noted
    from each decision this agent takes, read for a later epoch it has not taken."""
    beats_dir: str | None = None
    """The node's beat directory (``DS_RECYCLE_BEATS``): the heartbeat goes there, for the node's
    agent to relay (:mod:`ds_recycle.runtime.shared.beats`)."""
    iteration_seconds: float | None = None
    """The last measured iteration time, sent with every beat."""
    group_roles: policy.GroupRoles | None = None
    """The roles of a slot's process groups (set by the engine's runtime): a decision names the
    roles whose groups the next epoch makes afresh (:func:`~ds_recycle.runtime.shared.policy.groups_to_remake`)."""
    _heartbeat: threading.Thread | None = field(default=None, repr=False)
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)

    @classmethod
    def from_env(cls, environ=os.environ) -> MembershipAgent | None:
        """The agent of a process started by ``ds-recycle launch``; None under any other launcher."""
        address = environ.get(keys.ENV_STORE)
        if not address:
            return None
        agent = cls(
            address=address,
            slot=int(environ["RANK"]),
            token=environ.get(keys.ENV_TOKEN, ""),
            incarnation=int(environ.get(keys.ENV_INCARNATION, "0")),
            generation=int(environ.get(keys.ENV_GENERATION, "0")),
            beats_dir=environ.get(keys.ENV_BEATS),
            node_address=environ.get(keys.ENV_NODE_STORE),
        )
        if not agent.node_address:
            raise MembershipError(f"{keys.ENV_NODE_STORE} is not set: start the ranks with ds-recycle launch")
        if not agent.token:
            raise MembershipError(f"{keys.ENV_TOKEN} is not set: start the ranks with ds-recycle launch")
        try:
            node, layout = int(environ["GROUP_RANK"]), NodeLayout.from_env(environ, required=True)
        except (KeyError, ValueError):
            raise MembershipError(
                "GROUP_RANK and LOCAL_WORLD_SIZE must be set to integers: start the ranks with ds-recycle launch"
            ) from None
        agent.node_slots = tuple(layout.slots(node))
        try:
            agent.store = agent.connect()
            agent.node_store = agent.connect_node()
        except ValueError as error:
            raise MembershipError(str(error)) from None
        agent.current = agent.store.membership()
        return agent

    def connect(self) -> JobStore:
        """A client of the job's store of its own, for a thread that must not share the agent's."""
        return C10dJobStore.connect(self.address, self.generation, self.token)

    def connect_node(self) -> JobStore:
        """A client of the node's store of its own (the failure watcher's)."""
        return C10dJobStore.connect(self.node_address, self.generation, self.token)

    @property
    def is_joiner(self) -> bool:
        """A respawned process: it enters a running job instead of starting one."""
        return self.incarnation > 0

    # ---- requests --------------------------------------------------------------------------

    def request(
        self, kind: str, store: JobStore | None = None, slot: int | None = None, target: int | None = None
    ) -> None:
        """Post a request for this slot (or ``slot``: the lowest member proposes a migration of
        another member into ``target``)."""
        slot = self.slot if slot is None else slot
        (store or self.store).post_request(Request(kind, slot, os.getpid(), time.time(), target))

    def install_leave_handler(self) -> None:
        """SIGTERM, SIGINT or SIGHUP (a preemption notice, ``scancel``, a closed terminal) means:
        finish this iteration, then leave the job. A cluster signals the rank's whole process tree.
        A process forked from the rank inherits this handler: there it acts as if the handler had
        never been installed (a helper must not post a leave for the rank); a helper that must live
        on until the rank leaves ignores the signal (:func:`ds_recycle.data.shield_helper`)."""
        rank_pid = os.getpid()

        def on_signal(signum, frame):
            if os.getpid() != rank_pid:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
                return
            if not self.leave_requested:
                self.leave_requested = True
                name = signal.Signals(signum).name
                logger.info(f"ReCycle: slot {self.slot} got {name}; leaving at the next iteration boundary")
                # Its own client: the main thread may be inside a store call on the agent's client.
                leave = threading.Thread(target=lambda: self.request(LEAVE, self.connect()), daemon=True)
                leave.start()

        for signum in LEAVE_SIGNALS:
            signal.signal(signum, on_signal)

    # ---- decisions ---------------------------------------------------------------------------

    def decide(self, iteration: int) -> Decision:
        """The decision of the current epoch's members at the boundary before ``iteration``: one
        ``compare_set``. This member proposes the changes it knows of (:meth:`note_changes`, kept by
        its watcher; read here only before the watcher's first look); the first proposal fixes it."""
        epoch = self.current.epoch
        known = self._known if self._known is not None else self.store.changes()
        changes = tuple(known[self.applied :])
        # A member's failure is the survivors' to decide (every member's watcher raises its flag for
        # it): a boundary takes the changes before it only. Taken here, it would be decided away
        # under a member that has just been stopped by it, which could then not find it.
        failed = [i for i, c in enumerate(changes) if c.kind == FAILED and c.slot in self.current.members]
        if failed:
            changes = changes[: failed[0]]
        applied = self.applied + len(changes)
        nxt = self._next(changes, iteration)
        remade = None if nxt is None else self._remade(nxt)
        proposal = Decision(epoch, iteration, applied, changes, nxt, remade)
        decision = self.store.propose_decision(proposal)
        if decision == proposal and decision.next is not None:
            self._publish(decision.next, epoch)
        return self._take(decision, at_boundary=True)

    def recover(self, progress: Progress, running: tuple[int, ...], detect_timeout: float, timeout: float) -> Decision:
        """The survivors' one decision after a failure in the current epoch.

        Every survivor posts its progress on its node's store and counts it there; the survivor whose
        count completes its node's survivors copies their posts to the job's store and counts them
        there (``progress_count/<n>``), and the one whose count completes every survivor fixes the
        decision with one ``compare_set``: the changes pending so far, the next membership, and
        ``iteration`` = the iteration every survivor restarts from (the least finished count). The
        others block on the decision's key: no survivor polls. A survivor that dies meanwhile drops
        out: at every change published during the wait each survivor looks again whether its node's
        remaining survivors and then every remaining survivor have posted. A failure of
        one of ``running`` (the members this process was running with) must be published within
        ``detect_timeout``; after PROBE_AFTER_SECONDS without one the agent asks the coordinator to
        look for a member whose end it did not count as a failure.

        A boundary decision can make the next epoch while a failure stops this survivor: the
        members that reached the boundary first took it, and they recover in the new epoch. A
        survivor that looked before that epoch was published waits in the old one, whose decision
        can then never be made (those members will not post there): when a slice of its wait
        passes, it looks whether a newer epoch exists, and recovers in that one. The first look at
        the latest epoch is at the node's copy (made after the failure that stopped this survivor
        was published); a look after a superseded epoch is at the job's store."""
        deadline = time.monotonic() + timeout
        latest_from = self.node_store
        while True:
            decision = self._recover_in_latest(progress, running, detect_timeout, deadline, timeout, latest_from)
            if decision is not None:
                return decision
            latest_from = self.store

    def _recover_in_latest(
        self,
        progress: Progress,
        running: tuple[int, ...],
        detect_timeout: float,
        deadline: float,
        timeout: float,
        latest_from: JobStore,
    ) -> Decision | None:
        """:meth:`recover` in the latest epoch decided (as ``latest_from`` says); None if a newer
        one was decided meanwhile."""
        self.refresh(latest_from)
        epoch = self.current.epoch
        self._wait_for_failure(set(running) | self._concerned(self.current, self.current, self.store), detect_timeout)
        here = self._post_progress(epoch, progress)
        looked_at, pending = None, self._read_pending(self.node_store)
        slices = 0
        while True:
            # Looks at the changes after this survivor's post, on the node's store: a failure the
            # copy has not reached yet leaves the dead among the survivors (a stricter count: no
            # decision without it, or the decision's epoch fails on entry), and is seen a slice later.
            if len(pending) != looked_at:
                after_post = looked_at is None and here is not None
                looked_at = len(pending)
                count = self._forward_progress(epoch, tuple(pending[self.applied :]), here if after_post else None)
                # Right after its own post only a survivor that forwarded its node's posts moved the count.
                if count is not None or not after_post:
                    decision = self._propose_recovery(epoch, pending, count)
                    if decision is not None:
                        break
            # The node's agent copies the decision of the epoch it saw the failure in...
            decision = self.node_store.await_recovery(epoch, RECOVERY_SLICE_SECONDS)
            if decision is not None:
                break
            slices += 1
            # ...but it may be made in a later one, or its copy may come late.
            if slices % RECOVERY_CHECK_SLICES == 0:
                decision = self.store.recovery(epoch)
                if decision is not None:
                    break
                # A newer epoch without this recovery's decision: made by a boundary this survivor
                # did not see (the decision's key is set before the epoch it makes is published).
                if self.store.current_epoch() > epoch and self.store.recovery(epoch) is None:
                    logger.info(
                        f"ReCycle: slot {self.slot}: epoch {epoch} was superseded in its recovery; recovering anew"
                    )
                    return None
            looked = self._read_pending(self.node_store)
            pending = looked if len(looked) > len(pending) else pending  # a copy that lags shows fewer
            if time.monotonic() > deadline:
                survivors = self._survivors(tuple(self._read_pending()[self.applied :]))
                missing = [s for s in survivors if not self.store.progress_posted(epoch, [s])]
                raise MembershipError(
                    f"the progress of survivors {missing} did not reach the job's store within {timeout:.0f} s"
                )
        return self._take(decision, at_boundary=False)

    def _propose_recovery(self, epoch: int, pending: list[Change], count: int | None = None) -> Decision | None:
        """Fix epoch ``epoch``'s recovery decision if every survivor (as ``pending``, the changes
        so far, says) has posted its progress, and return it (or the one fixed first); else leave
        it to the survivor that completes the count. ``count``: the posts counted so far, when
        this survivor's own post just read it."""
        changes = tuple(pending[self.applied :])
        survivors = self._survivors(changes)
        if count is None:
            count = self.store.count_progress(epoch)
        if count < len(survivors) or not self.store.progress_posted(epoch, survivors):
            return None
        posts = self.store.progress_of(epoch, survivors)
        done = min(post.done for post in posts.values())
        nxt = self._next(changes, done) or Membership(epoch + 1, self.current.members, done)
        proposal = Decision(epoch, done, len(pending), changes, nxt, self._remade(nxt, posts))
        decision = self.store.propose_recovery(proposal)
        if decision == proposal:
            self._publish(nxt)  # after the key: a survivor that sees the epoch moved sees the key set
        return decision

    def _remade(self, nxt: Membership, posts: dict[int, Progress] | None = None) -> tuple[str, ...] | None:
        changed = set(self.current.members) ^ set(nxt.members)
        return policy.groups_to_remake(changed, self.group_roles, self.current.epoch, posts, nxt.members)

    def _post_progress(self, epoch: int, progress: Progress) -> int | None:
        """Post this survivor's progress in ``epoch`` on the node's store, and count it there once;
        returns the node's count after this post (None when this process posted in ``epoch``
        before: no other process of this slot is a survivor of an epoch this one was a member of)."""
        self.node_store.post_progress(epoch, self.slot, progress)
        if self._posted_in == epoch:
            return None
        self._posted_in = epoch
        return self.node_store.count_progress(epoch, 1)

    def _forward_progress(self, epoch: int, changes: tuple[Change, ...], here: int | None) -> int | None:
        """Copy the posts of this node's survivors (as ``changes`` leave them) to the job's store and
        count them there, once every one of them posted on the node's store; returns the job's count
        after it, or None when this survivor did not copy them. ``here``: the node's count that this
        survivor's own post just read (None: read it, after a later change)."""
        if self._forwarded_in == epoch:
            return None
        survivors = [s for s in self._survivors(changes) if s in self.node_slots]
        if here is None:
            here = self.node_store.count_progress(epoch)
        if (
            here < len(survivors)
            or not self.node_store.progress_posted(epoch, survivors)
            # A claimer that is no longer a survivor may have died before it copied them; if it did
            # copy them, the job's count runs above the survivors', which only sends the proposers
            # to look at the posts: a decision needs every survivor's.
            or not self.node_store.claim_forwarding(epoch, self.slot, survivors)
        ):
            return None
        posts = self.node_store.progress_of(epoch, survivors)
        self._forwarded_in = epoch
        return self.store.forward_progress(epoch, posts)

    def _wait_for_failure(self, slots: set[int], detect_timeout: float) -> None:
        """Until a failure among ``slots`` is published: blocks on this slot's next alert key in the
        node's store (set when a change is copied there), probing every PROBE_AFTER_SECONDS. No
        store operation when the changes the watcher read last hold one (it raised the flag for it)."""
        known = self._known
        if known is not None and self._failure_in(known, slots):
            return
        started, probes = time.monotonic(), 0
        while True:
            pending = self._read_pending()
            if self._failure_in(pending, slots):
                return
            alerts = len(pending)
            waited = time.monotonic() - started
            if waited > detect_timeout:
                raise MembershipError(
                    f"a peer stopped answering in epoch {self.current.epoch} but the launcher published no failure "
                    f"within {detect_timeout:.0f} s, and found no ended member when asked"
                )
            # Every PROBE_AFTER_SECONDS: a dead node's lease only gets old, so a later probe finds it.
            if waited > (probes + 1) * PROBE_AFTER_SECONDS:
                self.request(PROBE)
                probes += 1
                if probes == 1:
                    logger.info(f"ReCycle: slot {self.slot} asked the coordinator which peer stopped answering")
            self.node_store.wait_for_alert(self.slot, alerts + 1, PROBE_AFTER_SECONDS)

    def _take(self, decision: Decision, at_boundary: bool) -> Decision:
        """Apply ``decision`` (made ``at_boundary``, or by a recovery). Its decider publishes the
        epoch it makes; the others do only if it is still not published when they enter it
        (:meth:`enter`) or look at the latest epoch (:meth:`refresh`)."""
        self.applied = decision.applied
        if decision.next is not None:
            self._records[decision.next.epoch] = decision.next
            self._leavers[decision.next.epoch] = policy.boundary_leavers(decision) if at_boundary else set()
            self.current = decision.next
        return decision

    def failure_among(self, slots: set[int], store: JobStore | None = None) -> bool:
        """Whether a failure not yet taken by a decision concerns one of ``slots``."""
        return self._failure_in(self._read_pending(store), slots)

    def _failure_in(self, pending: list[Change], slots: set[int]) -> bool:
        return any(c.kind == FAILED and c.slot in slots for c in pending[self.applied :])

    def _read_pending(self, store: JobStore | None = None, count: int | None = None) -> list[Change]:
        """Every change so far, reading only those after the ones the watcher took in."""
        return (store or self.store).changes(self._known, count)

    def note_changes(self, store: JobStore, count: int | None = None) -> bool:
        """For the watcher (its own client of the node's store), at its start and whenever changes
        were copied there (``count``: the ``alert`` count it just read): take ``pending`` in (the
        next boundary proposes what it holds), and say whether a failure in it concerns this rank:
        one of a member of this rank's epoch, of the latest decided one, or of a leaver the decision
        making the latest one took out (it died before it finished the iteration its leave closed).
        A joiner that died before it was admitted concerns nobody."""
        pending = self._read_pending(store, count)
        relevant = self._failure_in(pending, self._concerned(self.current, self._latest(store), store))
        # Taken in last, just before the watcher raises its flag: a boundary that already holds a
        # failure in its proposal but passed its flag check would decide the failure away, and the
        # rank would then recover from a failure it no longer sees (and probe for it).
        self._known = pending
        return relevant

    def _concerned(self, current: Membership, latest: Membership, store: JobStore) -> set[int]:
        """The slots whose failure stops a rank in epoch ``current`` when ``latest`` is the newest
        decided epoch: the members of both, and the leavers that the boundary decision making
        ``latest`` took out (noted when this agent took it, else read once per epoch:
        :meth:`~ds_recycle.runtime.shared.job_store.JobStore.left_at_boundary`). ``latest`` is published, so the
        decision that made it is written; a boundary decision a straggler writes later at the same
        key did not make it."""
        leavers = self._leavers.get(latest.epoch)
        if leavers is None:
            leavers = self._leavers[latest.epoch] = store.left_at_boundary(latest)
        return set(current.members) | set(latest.members) | leavers

    def _latest(self, store: JobStore) -> Membership:
        """The latest decided membership: the store's (the node's copy, made after the changes the
        watcher woke for were published), or this agent's own when it took a later one. An epoch's
        record, written once, is read once."""
        epoch = store.current_epoch()
        current = self.current
        if current is not None and current.epoch > epoch and current.epoch in self._leavers:
            return current
        membership = self._records.get(epoch)
        if membership is None:
            membership = self._records[epoch] = store.membership(epoch)
        return membership

    def migrations(self) -> tuple[set[int], dict[int, int]]:
        """The retired slots no move fills, and the accepted moves not decided yet (mover ->
        target), from every change the coordinator accepted so far."""
        pending = self._read_pending()
        return policy.retired_slots(pending), policy.moves_under_way(pending, self.current.members)

    def _survivors(self, changes: tuple[Change, ...]) -> list[int]:
        gone = {c.slot for c in changes if c.kind in OUT_KINDS}
        return [s for s in self.current.members if s not in gone]

    def enter(
        self, membership: Membership, failure_announced: Callable[[], bool], timeout: float, copied: bool = False
    ) -> None:
        """Wait until every member of ``membership`` is ready to build its world: each counts itself
        on its node's store (``ready/<n>``), the one whose count completes its node's members counts
        them on the job's store, the one whose count completes the members sets ``entered/<n>``, and
        the others block on it: on the node's store when its agent copies the key there (``copied``:
        an epoch a recovery decision made), backed by a look at the job's store at every check. A
        member that dies before it counts itself leaves its node's count short: the others see its
        failure at a check.
        Raises EpochSuperseded if a newer epoch was decided meanwhile, and MemberFailed if a failure
        was announced (``failure_announced()``) or one of the members failed."""
        epoch = membership.epoch
        self._records[epoch] = membership
        here = self.node_store.count_ready(epoch, 1)
        if here == len([m for m in membership.members if m in self.node_slots]):
            if self.store.count_ready(epoch, here) >= len(membership.members):
                self._publish(membership)  # in case its decider died before it did (a leaver at a boundary)
                self.store.mark_entered(epoch)
                return
        deadline = time.monotonic() + timeout
        slices = 0
        while not (self.node_store if copied else self.store).wait_for_entry(epoch, ENTER_SLICE_SECONDS):
            if failure_announced():
                raise MemberFailed(f"a failure was announced while entering epoch {epoch}")
            slices += 1
            if slices % ENTER_CHECK_SLICES:
                continue
            if copied and self.store.entered(epoch):  # the copy is late, or its agent awaited another
                return
            # A member (a joiner) may have died after the failure watcher judged its failure to
            # concern nobody, before the decision that admitted it was published.
            if self.failure_among(set(membership.members)):
                raise MemberFailed(f"a member of epoch {epoch} failed before every member entered it")
            current = self.store.current_epoch()
            if current > epoch:
                raise EpochSuperseded(f"epoch {epoch} was superseded before every member entered it")
            if current < epoch:  # its decider died before it published it: a joiner waits for it
                self._publish(membership, current)
            if time.monotonic() > deadline:
                raise MembershipError(f"not every member of epoch {epoch} arrived within {timeout:.0f} s")

    def _next(self, changes: tuple[Change, ...], iteration: int) -> Membership | None:
        members = set(self.current.members)
        for change in changes:
            if change.kind == JOIN:
                members.add(change.slot)
            else:
                members.discard(change.slot)
        if members == set(self.current.members):
            return None
        return Membership(self.current.epoch + 1, tuple(sorted(members)), iteration)

    def _publish(self, membership: Membership, current_epoch: int | None = None) -> None:
        """Make ``membership`` the current epoch (``current_epoch``: the store's, if known), first
        publishing any epoch between the two that this agent held: a decider that died before it
        published its epoch leaves a gap, which the next publisher among its survivors fills."""
        if current_epoch is None:
            current_epoch = self.store.current_epoch()
        for epoch in range(current_epoch + 1, membership.epoch + 1):
            record = membership if epoch == membership.epoch else self._records.get(epoch)
            if record is None:
                return
            self.store.publish_epoch(record)

    def refresh(self, store: JobStore | None = None) -> Membership:
        """The latest epoch decided by anyone (a slower member may not have seen it yet), as
        ``store`` says (the job's, or the node's copy). One this agent took that is still
        unpublished on the job's store (its decider died between its decision and the publication)
        is published here: a survivor that did not take it would otherwise recover in the epoch
        before it, apart from those that did."""
        store = store or self.store
        epoch = store.current_epoch()
        if epoch < self.current.epoch and store is not self.store:  # a copy older than this agent
            store, epoch = self.store, self.store.current_epoch()
        if epoch > self.current.epoch:
            self._take(*self._creating(store.membership(epoch)))
        elif epoch < self.current.epoch:
            self._publish(self.current, epoch)
        return self.current

    def decision_creating(self, membership: Membership) -> Decision:
        """The decision (a boundary or a recovery) that created ``membership``."""
        return self._creating(membership)[0]

    def _creating(self, membership: Membership) -> tuple[Decision, bool]:
        """The decision that created ``membership``, and whether it was made at a boundary."""
        previous = membership.epoch - 1
        decision = self.store.decision(previous, membership.iteration)
        if decision is not None and decision.next == membership:
            return decision, True
        decision = self.store.recovery(previous)
        if decision is not None and decision.next == membership:
            return decision, False
        raise MembershipError(f"no decision created epoch {membership.epoch}")

    def created_by_recovery(self, membership: Membership) -> bool:
        """Whether ``membership`` was decided by the survivors of a failure (who roll back and
        re-sync tied weights on entering it), not at an iteration boundary."""
        decision = self.store.recovery(membership.epoch - 1)
        return decision is not None and decision.next == membership

    def holders(self, membership: Membership) -> tuple[int, ...]:
        """The members of ``membership`` that hold the trained state (:meth:`Decision.holders`)."""
        return self.decision_creating(membership).holders()

    # ---- joining -----------------------------------------------------------------------------

    def wait_for_admission(self, timeout: float, predecessor_removed: bool = False) -> Membership:
        """Wait until an epoch without this slot is decided (a respawn can start before the
        survivors have decided the removal of its predecessor, whose epoch still names the slot),
        then post a join request and wait until an epoch includes this slot.
        ``predecessor_removed``: this process was admitted once already (its epoch was superseded)."""
        deadline = time.monotonic() + timeout
        if not predecessor_removed:
            removed = "decided the removal of its predecessor"
            self._wait_for_epoch(lambda m: self.slot not in m.members, deadline, removed)
        self.request(JOIN)
        self.requested_at = time.time()
        current = self._wait_for_epoch(lambda m: self.slot in m.members, deadline, "admitted it")
        self._take(*self._creating(current))
        return current

    def _wait_for_epoch(self, condition, deadline: float, what: str) -> Membership:
        while time.monotonic() < deadline:
            current = self.store.membership()
            if condition(current):
                return current
            time.sleep(0.02)
        raise MembershipError(
            f"slot {self.slot} wants to join but no epoch {what} in time (recycle.join_timeout; is the job "
            "still running, and was the request refused by the launcher?)"
        )

    # ---- liveness ------------------------------------------------------------------------------

    def start_heartbeat(self) -> None:
        if self._heartbeat is not None:
            return
        if not self.beats_dir:
            raise MembershipError(f"{keys.ENV_BEATS} is not set: start the ranks with ds-recycle launch")

        def beat():
            failing = False
            while not self._stop.wait(HEARTBEAT_SECONDS):
                try:
                    self._beat(time.time())
                    failing = False
                except OSError as error:  # a missed beat, not the end of the heartbeat
                    if not failing:
                        logger.warning(f"ReCycle: slot {self.slot} could not write its heartbeat: {error}")
                    failing = True

        self._beat(time.time())
        self._heartbeat = threading.Thread(target=beat, name="recycle-heartbeat", daemon=True)
        self._heartbeat.start()
        atexit.register(self.stop)

    def _beat(self, when: float) -> None:
        write_beat(self.beats_dir, self.slot, Beat(when, self.iteration_seconds))

    def publish_iteration_seconds(self, seconds: float) -> None:
        """Sent with the next heartbeat (the coordinator's hang timeout follows the slowest rank)."""
        self.iteration_seconds = seconds

    def stop(self) -> None:
        self._stop.set()
        if self._heartbeat is not None and self._heartbeat is not threading.current_thread():
            self._heartbeat.join(timeout=2 * HEARTBEAT_SECONDS + 1.0)
            try:
                self._beat(time.time() + EXIT_GRACE_SECONDS)
            except OSError:  # the launcher is gone already (it removes the directory)
                pass
