"""The job's store as the protocol uses it: typed operations on the records of
:mod:`ds_recycle.runtime.shared.records` under the keys of :mod:`ds_recycle.runtime.shared.keys`.

:class:`JobStore` is the interface every part of the runtime speaks to the store through (the
coordinator, the node's agent, a rank's membership agent and failure watcher, the status page);
:class:`StoreRoot` is the store's root, outside every generation, where agents check in and the
coordinator names the generation it runs. Their one implementation today is over torch's c10d
store (:mod:`ds_recycle.runtime.shared.c10d_store`); another backend (etcd) implements these operations,
not c10d's ``get``/``set``/``add``.

A JobStore stands for one generation's keys on one store: the job's, or a node's copy of the part
its ranks read (:mod:`ds_recycle.runtime.node.node_watch`), which holds the same keys. Each thread that
may block in an operation needs a JobStore of its own (a client blocked in a wait blocks every
other caller of that client).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from ds_recycle.runtime.shared.records import (
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
from ds_recycle.runtime.shared.status_schema import StatusReport


@dataclass(frozen=True)
class NodeCopy:
    """What a node's agent copies from the job's store into its node's store at a wake: the new
    changes, and the latest epoch with the boundary decision that made it, as written (opaque to
    the agent: :meth:`JobStore.read_copy` reads it, :meth:`JobStore.write_copy` writes it)."""

    count: int
    """The job's ``alert`` count the copy reaches."""
    added: int
    """How many changes it adds to the node's copy."""
    epoch: int
    """The job's current epoch as read with it."""
    failure: bool
    """Whether one of the new changes is a failure."""
    entries: tuple[tuple[str, bytes | str], ...]
    """The records, by key (nothing when neither a change nor a newer epoch came)."""


class StoreRoot(ABC):
    """The store's root, outside every generation: the generation the coordinator runs, and the
    check-ins of the agents that wait for it."""

    @abstractmethod
    def running_generation(self) -> int | None:
        """The generation the coordinator runs (None before it runs one)."""

    @abstractmethod
    def start_generation(self, generation: int) -> None:
        """Name ``generation`` as the one the coordinator runs (its keys are written first)."""

    @abstractmethod
    def check_in(self, check_in: CheckIn) -> None:
        """An agent waits for the coordinator to run a generation."""

    @abstractmethod
    def check_in_of(self, node: int) -> CheckIn | None:
        """Node ``node``'s check-in, if it checked in. Raises
        :class:`~ds_recycle.runtime.shared.seal.ForgedRecord` for one not sealed with the job token."""

    @abstractmethod
    def withdraw_check_in(self, node: int) -> None:
        """Remove node ``node``'s check-in (a refused one)."""


class JobStore(ABC):
    """One generation's keys on one store (see the module doc)."""

    # ---- the job -----------------------------------------------------------------------------

    @abstractmethod
    def open_job(self, world_size: int, nodes: int | None = None) -> None:
        """Write a generation's first keys: its number of slots (and of nodes) and epoch 0 with
        every slot, made current."""

    @abstractmethod
    def world_size(self) -> int:
        """The job's number of slots."""

    @abstractmethod
    def node_count(self) -> int | None:
        """The job's number of nodes (None when the launcher did not write it)."""

    # ---- membership ----------------------------------------------------------------------------

    @abstractmethod
    def current_epoch(self) -> int:
        """The number of the current epoch."""

    @abstractmethod
    def membership(self, epoch: int | None = None) -> Membership:
        """Epoch ``epoch``'s membership (default: the current epoch's), read fresh."""

    @abstractmethod
    def publish_epoch(self, membership: Membership) -> None:
        """Write ``membership``'s record if none is written yet, then make it the current epoch if
        the one before it is current (each first write wins)."""

    @abstractmethod
    def left_at_boundary(self, membership: Membership) -> set[int]:
        """The leavers that the boundary decision making ``membership`` took out, alive then (not
        failed in it). The members that reached the boundary first decided it, so a leaver may not
        have finished the iteration it closed: its death before it did is a failure of that
        iteration."""

    # ---- changes ---------------------------------------------------------------------------------

    @abstractmethod
    def alert_count(self) -> int:
        """How many changes there are (``alert``)."""

    @abstractmethod
    def changes(self, known: list[Change] | None = None, count: int | None = None) -> list[Change]:
        """Every change so far: ``known`` (the first changes, as read before) and the ones after
        it; ``count``: the ``alert`` count, if just read."""

    @abstractmethod
    def append_changes(self, start: int, changes: list[Change], nodes: int) -> int:
        """The coordinator's one write of new changes (``start`` = how many there were), which then
        wakes every node's agent (a waiter woken reads everything written before). Returns the new
        count."""

    @abstractmethod
    def read_copy(self, seen: int, count: int, copied_epoch: int) -> NodeCopy:
        """What a node's agent copies into its node's store: changes ``seen`` .. ``count - 1``, and
        the current epoch with the boundary decision that made it if it is newer than
        ``copied_epoch``."""

    @abstractmethod
    def write_copy(self, copy: NodeCopy, slots: Iterable[int]) -> None:
        """Write ``copy`` into this (a node's) store, then move its ``alert`` count on and wake the
        failure watchers of ``slots``."""

    @abstractmethod
    def node_alerts(self, node: int, seen: Callable[[], int], stop: threading.Event) -> Iterator[int]:
        """The ``alert`` counts past ``seen()``, as the coordinator wakes node ``node``'s agent with
        them, until ``stop`` is set (a stopping agent wakes itself: :meth:`wake_node_watch`). Raises
        what the store raises when it cannot be reached."""

    @abstractmethod
    def slot_alerts(self, slot: int, seen: Callable[[], int], stop: threading.Event) -> Iterator[int]:
        """The same for the failure watcher of ``slot``, woken by its node's agent on the node's store."""

    @abstractmethod
    def wake_node_watch(self, node: int, seen: int) -> None:
        """Wake node ``node``'s agent from its wait for the change after ``seen`` (it is stopping)."""

    @abstractmethod
    def wake_slot_watcher(self, slot: int, seen: int) -> None:
        """Wake ``slot``'s failure watcher from its wait for the change after ``seen`` (it is stopping)."""

    @abstractmethod
    def wait_for_alert(self, slot: int, count: int, seconds: float) -> bool:
        """Block until ``slot``'s watchers are woken for the ``count``-th change (True), or
        ``seconds`` passed (False)."""

    # ---- requests and reports --------------------------------------------------------------------

    @abstractmethod
    def post_request(self, request: Request) -> int:
        """Append ``request`` for the coordinator; returns its index."""

    @abstractmethod
    def open_inboxes(self) -> None:
        """Create the request and report counters (the coordinator, before its first look)."""

    @abstractmethod
    def inbox_counts(self) -> tuple[int, int]:
        """How many requests and agent reports were posted, in one read."""

    @abstractmethod
    def posted_request(self, index: int) -> bytes | None:
        """Request ``index`` as posted (None: counted, not yet written). Not parsed: the coordinator
        refuses a malformed one. Raises :class:`~ds_recycle.runtime.shared.seal.ForgedRecord` for one
        not sealed with the job token (anyone who reaches the store may post)."""

    @abstractmethod
    def post_report(self, report: AgentReport) -> int:
        """Append a node's agent's report; returns its index."""

    @abstractmethod
    def report(self, index: int) -> AgentReport | None:
        """Report ``index`` (None: counted, not yet written). Raises
        :class:`~ds_recycle.runtime.shared.seal.ForgedRecord` for one not sealed with the job token."""

    @abstractmethod
    def save_cursor(self, request: int, report: int) -> None:
        """The coordinator reads request ``request`` and report ``report`` next."""

    @abstractmethod
    def cursor(self) -> tuple[int, int]:
        """The next request and report the coordinator reads ((1, 1) before it saved any)."""

    # ---- decisions -----------------------------------------------------------------------------

    @abstractmethod
    def propose_decision(self, proposal: Decision) -> Decision:
        """The decision of epoch ``proposal.epoch``'s members at the boundary before
        ``proposal.iteration``: ``proposal`` if it is the first, else the one fixed first."""

    @abstractmethod
    def decision(self, epoch: int, iteration: int) -> Decision | None:
        """Epoch ``epoch``'s boundary decision at ``iteration``, if made."""

    @abstractmethod
    def propose_recovery(self, proposal: Decision) -> Decision:
        """The survivors' decision after a failure in epoch ``proposal.epoch``: ``proposal`` if it is
        the first, else the one fixed first."""

    @abstractmethod
    def recovery(self, epoch: int) -> Decision | None:
        """The survivors' decision after a failure in epoch ``epoch``, if made."""

    @abstractmethod
    def await_recovery(self, epoch: int, seconds: float) -> Decision | None:
        """The recovery decision of epoch ``epoch`` once made, or None after ``seconds``."""

    @abstractmethod
    def copy_recovery(self, decision: Decision) -> None:
        """Write ``decision``, read from the job's store, into this (a node's) store."""

    # ---- recovery progress ---------------------------------------------------------------------

    @abstractmethod
    def post_progress(self, epoch: int, slot: int, progress: Progress) -> None:
        """A survivor's progress after a failure in epoch ``epoch``."""

    @abstractmethod
    def count_progress(self, epoch: int, posts: int = 0) -> int:
        """Add ``posts`` to the count of posts in epoch ``epoch``; returns the count (0: read it)."""

    @abstractmethod
    def progress_posted(self, epoch: int, slots: list[int]) -> bool:
        """Whether every one of ``slots`` posted its progress in epoch ``epoch``."""

    @abstractmethod
    def progress_of(self, epoch: int, slots: list[int]) -> dict[int, Progress]:
        """The progress that ``slots`` posted in epoch ``epoch`` (every one has: :meth:`progress_posted`)."""

    @abstractmethod
    def forward_progress(self, epoch: int, posts: dict[int, Progress]) -> int:
        """Write a node's ``posts`` (by slot) in one go and count them; returns the count after it."""

    @abstractmethod
    def claim_forwarding(self, epoch: int, slot: int, survivors: list[int]) -> bool:
        """On a node's store: whether ``slot`` copies its node's posts in epoch ``epoch`` to the
        job's store: the first to claim it, or the first to claim it from a claimer that is no
        longer among ``survivors``."""

    # ---- entering an epoch --------------------------------------------------------------------

    @abstractmethod
    def count_ready(self, epoch: int, members: int) -> int:
        """Add ``members`` to the count of epoch ``epoch``'s members ready to build its world;
        returns the count."""

    @abstractmethod
    def mark_entered(self, epoch: int) -> None:
        """Every member of epoch ``epoch`` is ready (or, on a node's store, the copy of that)."""

    @abstractmethod
    def entered(self, epoch: int) -> bool:
        """Whether every member of epoch ``epoch`` was ready."""

    @abstractmethod
    def wait_for_entry(self, epoch: int, seconds: float) -> bool:
        """Block until every member of epoch ``epoch`` is ready (True), or ``seconds`` passed (False)."""

    @abstractmethod
    def world_rendezvous(self, epoch: int) -> object:
        """A ``torch.distributed.Store`` of its own for torch to build epoch ``epoch``'s world on,
        under its own prefix (``world/<epoch>/``): a backend of another kind serves it from a c10d
        store beside it."""

    # ---- nodes -----------------------------------------------------------------------------------

    @abstractmethod
    def next_node_incarnation(self, node: int) -> int:
        """Take node ``node``'s next agent incarnation (1 for its first agent)."""

    @abstractmethod
    def set_domain(self, node: int, domain: str) -> None:
        """Node ``node``'s failure domain (``--domain``; "" for none)."""

    @abstractmethod
    def domain_labels(self, nodes: int, timeout_seconds: float) -> dict[int, str]:
        """Every node's failure domain, once each of the ``nodes`` agents wrote its own (bounded by
        ``timeout_seconds``)."""

    @abstractmethod
    def renew_lease(self, node: int, lease: Lease) -> None:
        """Node ``node``'s agent is alive, with its ranks' last beats."""

    @abstractmethod
    def lease(self, node: int) -> Lease | None:
        """Node ``node``'s last lease (None: it holds none yet)."""

    @abstractmethod
    def leases(self, nodes: list[int]) -> dict[int, Lease]:
        """The last lease of each of ``nodes`` that holds one (one read in the steady state)."""

    @abstractmethod
    def order_kill(self, node: int, order: KillOrder) -> None:
        """Tell node ``node``'s agent to kill a rank."""

    @abstractmethod
    def kill_count(self, node: int) -> int:
        """How many kills were ordered to node ``node``."""

    @abstractmethod
    def kill_order(self, node: int, index: int) -> KillOrder | None:
        """Node ``node``'s kill order ``index`` (None: counted, not yet written)."""

    @abstractmethod
    def end_node(self, node: int, end: AgentEnd) -> None:
        """Node ``node``'s agent ends (its incarnation and exit code)."""

    @abstractmethod
    def node_end(self, node: int) -> AgentEnd | None:
        """How node ``node``'s latest agent to end ended (None: none ended, or it died)."""

    # ---- what the ranks publish --------------------------------------------------------------------

    @abstractmethod
    def publish_status(self, report: StatusReport) -> None:
        """The job's status record, for the status page."""

    @abstractmethod
    def status_report(self) -> StatusReport | None:
        """The job's status record (None before the first)."""

    @abstractmethod
    def commit_evaluation(self, key: str, loss: float) -> None:
        """A member finished evaluation batch ``key`` with ``loss``."""

    @abstractmethod
    def committed_evaluation(self) -> tuple[str, float] | None:
        """The last evaluation batch a member finished, and its loss (None: none yet)."""
