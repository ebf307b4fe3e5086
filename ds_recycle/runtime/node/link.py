"""A node's link to the coordinator, on every node whose agent does not host it (every node but
node 0, or every node with a standalone ``ds-recycle coordinator``).

The launcher hands it what waitpid sees; in a thread of its own (with its own store client) the link

- reports its ranks' starts and exits (``report/<k>``), which the coordinator treats as it treats
  node 0's own;
- renews the node's lease (``lease/<K>``) every fifth of the lease timeout (at least every 0.25 s),
  with its ranks' last beats (read from the node's beat files: :mod:`ds_recycle.runtime.shared.beats`);
- carries out the coordinator's kills (``kill/<K>/<k>``: a hung rank of this node, judged after
  seconds), read once a second;
- **fences** the node when it could not renew its lease for ``grace`` seconds (``--coordinator-timeout``,
  at most the lease timeout: a partition, the coordinator's host gone, or this node frozen and
  thawed): it kills every rank of the node at once, so that a node the coordinator may already
  have declared dead never comes back as a zombie member;
- writes the agent's incarnation and exit code (``ended/<K>``) as it ends.

After a fence the launcher waits for a coordinator at the endpoint (:func:`await_generation`): a
restarted one runs a later generation and the node's ranks start again in it; the same one still
running means the job went on without this node, and the agent ends.

The link registers as a new node incarnation at start (``node_incarnation/<K>``): the first agent
of a node starts its ranks fresh; a restarted one (incarnation > 1) starts them as joiners, and is
refused while its predecessor's lease is still live.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from collections.abc import Callable

from ds_recycle.runtime.control.coordinator import RankExit, renew_seconds
from ds_recycle.runtime.shared import transport
from ds_recycle.runtime.shared.beats import read_beats
from ds_recycle.runtime.shared.c10d_store import C10dJobStore, C10dStoreRoot
from ds_recycle.runtime.shared.records import AgentEnd, AgentReport, CheckIn, Lease, Membership

LEASE_WATCH_SECONDS = 0.05
KILL_CHECK_SECONDS = 1.0
CHECK_IN_POLL_SECONDS = 0.1
CONNECT_SECONDS = 2.0
"""Bound on one attempt to reach the coordinator's store while waiting for it."""


class NodeRefused(RuntimeError):
    """The coordinator's store says this node may not start now (its predecessor's lease is live)."""


class CoordinatorGone(RuntimeError):
    """No coordinator at the endpoint ran the generation waited for within the bound."""


def await_generation(address: str, node: int, token: str, last: int, wait: float, newer_only: bool = True) -> int:
    """Check in at the coordinator's store (``check_in/<node>``: this node last ran generation
    ``last``, -1 for none) and wait until the store names the generation it runs, after ``last``
    (``newer_only``) or any; returns it. Every attempt is bounded; CoordinatorGone after ``wait`` s."""
    import torch.distributed as dist

    deadline = time.monotonic() + wait
    root, checked_in = None, False
    while True:
        try:
            if root is None and (address.startswith(transport.ETCD_SCHEME) or _listening(address)):
                root = C10dStoreRoot.connect(address, token, timeout=CONNECT_SECONDS)
            if root is None:
                raise ConnectionRefusedError(address)
            generation = root.running_generation()
            if generation is not None and (generation > last or not newer_only):
                return generation
            if not checked_in:
                root.check_in(CheckIn(node, last))
                checked_in = True
        except (RuntimeError, OSError, dist.DistStoreError, ValueError):
            root, checked_in = None, False  # not listening (yet), or it went away: a fresh client next time
        if time.monotonic() > deadline:
            after = f"a generation after {last}" if last >= 0 else "the job"
            raise CoordinatorGone(f"no coordinator at {address} started {after} within {wait:g} s")
        time.sleep(CHECK_IN_POLL_SECONDS)


def _listening(address: str) -> bool:
    """Whether something accepts connections at ``host:port`` (tried with a plain socket first: a
    TCPStore client that cannot connect logs a stack trace per attempt)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=CONNECT_SECONDS):
            return True
    except OSError:
        return False


class NodeLink:
    """The coordinator as a node's launcher sees it when another host runs it (the same calls as
    :class:`Coordinator`)."""

    def __init__(
        self,
        address: str,
        generation: int,
        node: int,
        token: str,
        lease_seconds: float,
        log: Callable[[str], None],
        kill: Callable[[int, int], None],
        fence: Callable[[str], None],
        grace: float | None = None,
        beats_dir: str | None = None,
        slots: range = range(0),
    ) -> None:
        """``grace``: fence after this long without a renewal (default and at most ``lease_seconds``);
        ``beats_dir``: where the node's ranks (``slots``) write their beats."""
        self.address, self.generation, self.node = address, generation, node
        self.beats_dir, self.slots = beats_dir, slots
        self.token = token
        self.lease_seconds = lease_seconds
        self.grace = lease_seconds if grace is None else min(grace, lease_seconds)
        self._log, self._kill, self._fence = log, kill, fence
        self._store = C10dJobStore.connect(address, generation, token, timeout=max(1.0, lease_seconds))
        self._query = C10dJobStore.connect(address, generation, token, timeout=max(1.0, lease_seconds))
        self._query_lock = threading.Lock()
        self._reports: queue.Queue[AgentReport] = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_kill = 1
        self.node_incarnation = 0
        self.last_renewal = 0.0
        self.fenced = False
        self._fence_lock = threading.Lock()

    def register(self, domain: str = "") -> int:
        """Take this node's next incarnation and say its failure domain. A previous agent's lease
        must lapse first (it fences itself by then); one that is still renewed is a live agent of
        this node: refused."""
        deadline = time.monotonic() + 2 * self.lease_seconds
        while (lease := self._store.lease(self.node)) is not None:
            age = time.time() - lease.time
            if age >= self.lease_seconds:
                break
            if time.monotonic() > deadline:
                raise NodeRefused(
                    f"node {self.node} already has a live agent (incarnation {lease.node_incarnation}, lease renewed "
                    f"{age:.1f} s ago): is --node-rank {self.node} given twice?"
                )
            time.sleep(0.1)
        self.node_incarnation = self._store.next_node_incarnation(self.node)
        self._store.set_domain(self.node, domain)
        self._renew()
        return self.node_incarnation

    @property
    def rejoining(self) -> bool:
        """This agent replaces an earlier one of the node: its ranks join a running job."""
        return self.node_incarnation > 1

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"recycle-node-{self.node}", daemon=True)
        self._thread.start()
        # Apart from the store thread: on a partition a store call can block far past its timeout
        # (packets dropped, no reset), and the node must fence itself all the same.
        threading.Thread(target=self._watch_lease, name=f"recycle-node-{self.node}-fence", daemon=True).start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def end(self, code: int | None) -> None:
        """The agent ends with ``code``: stop, and tell the coordinator (best effort; a fenced
        node's coordinator is gone or has failed it already)."""
        self.stop()
        if code is None or self.fenced:
            return
        try:
            self._store.end_node(self.node, AgentEnd(self.node_incarnation, code))
        except Exception:
            pass

    def rank_started(self, slot: int, incarnation: int, wall_time: float) -> None:
        self._reports.put(self._report("started", slot, incarnation, 0, None, wall_time))

    def rank_exited(self, exit: RankExit) -> None:
        self._reports.put(self._report("exited", exit.slot, exit.incarnation, 0, exit.returncode, exit.observed))

    def membership(self) -> Membership:
        with self._query_lock:
            return self._query.membership()

    def _report(self, kind: str, slot: int, incarnation: int, pid: int, code: int | None, when: float) -> AgentReport:
        return AgentReport(kind, self.node, self.node_incarnation, slot, incarnation, pid, code, when)

    # ---- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        period = renew_seconds(self.lease_seconds)
        next_renewal = next_kill_check = 0.0
        while not self._stop.is_set():
            if self._lease_lapsed():  # a frozen node that thaws sees first how long it was gone
                return
            try:
                if time.monotonic() >= next_renewal:
                    self._renew()
                    next_renewal = time.monotonic() + period
                if time.monotonic() >= next_kill_check:
                    self._take_kills()
                    next_kill_check = time.monotonic() + KILL_CHECK_SECONDS
                self._send_reports()
            except Exception:  # the store is unreachable: the lease lapses unless it comes back
                pass
            self._stop.wait(min(0.02, period))
        try:
            self._send_reports()  # the last exits, so that node 0 knows this node's ranks ended
        except Exception:
            pass

    def _watch_lease(self) -> None:
        while not self._stop.wait(LEASE_WATCH_SECONDS):
            if self._lease_lapsed():
                return

    def _lease_lapsed(self) -> bool:
        """Fence the node (once) if its lease was not renewed for ``grace`` seconds."""
        silent = time.time() - self.last_renewal
        if silent <= self.grace:
            return False
        with self._fence_lock:
            if not self.fenced:
                limits = f"coordinator timeout {self.grace:g} s, lease {self.lease_seconds:g} s"
                self._fence_node(f"no lease renewal for {silent:.1f} s ({limits})")
        self._stop.set()
        return True

    def _renew(self) -> None:
        beats = read_beats(self.beats_dir, self.slots) if self.beats_dir else {}
        self._store.renew_lease(self.node, Lease(self.node_incarnation, time.time(), beats))
        self.last_renewal = time.time()

    def _send_reports(self) -> None:
        while True:
            try:
                report = self._reports.get_nowait()
            except queue.Empty:
                return
            self._store.post_report(report)

    def _take_kills(self) -> None:
        count = self._store.kill_count(self.node)
        while self._next_kill <= count:
            order = self._store.kill_order(self.node, self._next_kill)
            if order is None:
                return  # counted, not yet written
            self._kill(order.slot, order.incarnation)
            self._next_kill += 1

    def _fence_node(self, why: str) -> None:
        self.fenced = True
        self._fence(why)
