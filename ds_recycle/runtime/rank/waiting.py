"""Failure-aware waiting: no survivor blocks forever on a dead or hung peer.

Every ReCycle transfer and collective is started asynchronously and then waited for here, against
the failure flag that the :class:`FailureWatcher` raises when the coordinator publishes a failure.
gloo offers no abort: a blocked op only returns when its peer's sockets close or its timeout fires,
and ranks that are not talking to the dead peer never notice it (docs/design.md §8). So:

- collectives are polled with ``work.is_completed()``;
- a point-to-point ``wait()`` only completes once called, so it runs in a helper thread while the
  caller polls; after a failure that thread is abandoned (a kept pair's op never times out: it stays
  blocked, runtime/rank/groups.py) and a fresh one serves the next op;
- a wait that sees no failure and no completion for :data:`WAIT_BOUND_SECONDS` ends as a failure,
  the backstop that gloo's group timeout was before pair groups stopped timing out;
- a gloo error on any op is a failure too: the caller stops at once and waits for the coordinator
  to say who failed;
- a blocking call that ReCycle does not own (DeepSpeed's ``save_checkpoint``, whose barriers and
  tag all-reduce are synchronous) runs in a thread of its own while the caller polls, and is
  abandoned the same way.

On NCCL the same holds with two differences (:mod:`~ds_recycle.runtime.rank.communication`):
starting an op can block too (a communicator is made at its first op, a rendezvous of its members
in C++), so every op, collective or p2p, is started and polled (``work.is_completed()``, a CUDA
event query) in the helper thread, and ``work.wait()`` (which only orders the caller's stream after
the op) follows its completion; after a failure the helper is abandoned as on gloo, and the
recovery aborts the communicators, which ends whatever of it the GPU still runs.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ds_recycle.errors import PeerFailure
from ds_recycle.runtime.rank import exit_guard
from ds_recycle.runtime.shared.job_store import JobStore

SPIN_SECONDS = 0.0005
POLL_SECONDS = 0.001
WAIT_BOUND_SECONDS = 120.0
"""The longest wait for one op when no failure is announced; the process groups' timeout too
(``runtime/rank/groups.py``), but the pairs', which never time out."""

_blocking_thread = threading.local()
"""``abandoned``: in a thread that runs a :meth:`Waiter.blocking` call, set when its caller gives up on it."""


@dataclass
class FailureWatcher:
    """Raises :attr:`flag` when the coordinator publishes a failure that concerns this rank.

    It blocks on this slot's next alert key (``alert/<slot>/<seen+1>``) in the node's store, which
    the node's agent sets for each of its slots in one write whenever it has copied new changes of
    ``pending`` there (:mod:`~ds_recycle.runtime.node.node_watch`; ``alert`` counts them): no store
    operation while nothing changes. At every wake the rank takes the changes in
    (:attr:`on_changes`), which is how it learns of leaves and joins without reading at boundaries.
    """

    store: JobStore
    """Its own client of the node's store: it is blocked in a wait most of the time."""
    slot: int
    waker: JobStore
    """Another client of the node's store: :meth:`stop` sets this watcher's key with it to wake it."""
    on_changes: Callable[..., bool] | None = None
    """Given the watcher's store client (and at a wake the ``alert`` count it read), at start and
    at every wake: the rank takes in the changes published so far and says whether a failure among
    them concerns its peers. One that does not (a joiner that died before it was admitted, or no
    failure at all) is taken as seen, not raised."""
    seen: int = 0
    """How many changes of ``pending`` were taken into account."""
    flag: threading.Event = field(default_factory=threading.Event)
    raised_at: float | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _acknowledged: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    """Orders the watcher's compare-and-raise against :meth:`acknowledge`."""

    def start(self, seen: int | None = None) -> FailureWatcher:
        """Watch the changes after the first ``seen`` (default: every change published so far is
        seen)."""
        self.seen = self.store.alert_count() if seen is None else seen
        if self.on_changes is not None:
            self.on_changes(self.store)  # the changes up to ``seen`` at least; later ones wake it
        self._thread = threading.Thread(target=self._run, name="recycle-failure-watcher", daemon=True)
        self._thread.start()
        # A thread caught inside a store call when the interpreter exits aborts the process.
        atexit.register(self.stop)
        return self

    def _run(self) -> None:
        try:
            for value in self.store.slot_alerts(self.slot, lambda: self.seen, self._stop):
                self._take(value)
        except Exception:  # the node's agent (and its store) is gone: the job is over
            self.raise_flag()

    def _take(self, value: int) -> None:
        """The changes up to ``value`` were published: raise the flag if they concern this rank,
        and then wait until recovery took them into account (or stop)."""
        if value <= self.seen:
            return
        try:
            relevant = self.on_changes is None or self.on_changes(self.store, value)
        except Exception:  # cannot tell: stop and let recovery find out
            relevant = True
        with self._lock:
            if value <= self.seen:
                return
            if not relevant:
                self.seen = value
                return
            self._acknowledged.clear()
            self.raise_flag()
        self._acknowledged.wait()

    def raise_flag(self) -> None:
        if not self.flag.is_set():
            self.raised_at = time.time()
            self.flag.set()

    def acknowledge(self, seen: int) -> None:
        """Recovery has taken the first ``seen`` changes into account; a later failure raises the
        flag again."""
        with self._lock:
            self.seen = seen
            self.flag.clear()
            self.raised_at = None
            self._acknowledged.set()

    def stop(self) -> None:
        self._stop.set()
        self._acknowledged.set()
        try:
            self.waker.wake_slot_watcher(self.slot, self.seen)
        except Exception:  # the store is gone: the watcher's wait fails by itself
            pass
        self._thread.join(timeout=1.0)
        if self._thread.is_alive():  # still inside a store call (a slow or gone store)
            exit_guard.abandoned(self._thread)


class Waiter:
    """Waits on work handles, giving up with :class:`PeerFailure` when a failure is flagged."""

    def __init__(self, failed: threading.Event | None = None):
        self.failed = failed or threading.Event()
        self._requests: queue.Queue | None = None
        self._nccl_requests: queue.Queue | None = None

    def check(self, what: str) -> None:
        if self.failed.is_set():
            raise PeerFailure(f"a failure was announced before {what}")

    def collective(self, start, what: str):
        """``start()`` returns an async work handle; wait for it."""
        self.check(what)
        if _on_nccl():
            return self._on_nccl_helper(start, what)
        try:
            work = start()
            spins, bound = 0, time.monotonic() + WAIT_BOUND_SECONDS
            while not work.is_completed():
                if self.failed.is_set():
                    raise PeerFailure(f"a failure was announced during {what}")
                if time.monotonic() > bound:
                    raise _unbounded(what)
                spins += 1
                time.sleep(SPIN_SECONDS if spins < 200 else POLL_SECONDS)
            work.wait()
        except RuntimeError as error:
            if isinstance(error, PeerFailure):
                raise
            raise PeerFailure(f"{what}: {error}") from error

    def p2p(self, start, what: str) -> None:
        """``start()`` returns an isend/irecv work handle; its ``wait()`` runs in a helper thread."""
        self.check(what)
        if _on_nccl():
            return self._on_nccl_helper(start, what)
        try:
            work = start()
        except RuntimeError as error:
            raise PeerFailure(f"{what}: {error}") from error
        done = threading.Event()
        outcome: list = []
        self._helper().put((work, done, outcome))
        self._await(done, outcome, what, self._abandon_p2p_helper)

    def _abandon_p2p_helper(self) -> None:
        exit_guard.abandoned(self._thread)  # it may stay blocked in this wait
        self._requests = None

    def _await(self, done: threading.Event, outcome: list, what: str, abandon: Callable[[], None]) -> None:
        """Wait until a helper thread sets ``done``; on a failure or past the bound, ``abandon()``
        the helper and raise :class:`PeerFailure`. An error the helper put in ``outcome`` is a failure."""
        spins, bound = 0, time.monotonic() + WAIT_BOUND_SECONDS
        while not done.is_set():
            if self.failed.is_set() or time.monotonic() > bound:
                abandon()
                if self.failed.is_set():
                    raise PeerFailure(f"a failure was announced during {what}")
                raise _unbounded(what)
            spins += 1
            done.wait(SPIN_SECONDS if spins < 200 else POLL_SECONDS)
        if outcome and outcome[0] is not None:
            raise PeerFailure(f"{what}: {outcome[0]}") from outcome[0]

    def blocking(self, call: Callable[[], object], what: str) -> object:
        """``call()``'s result; it runs in a thread of its own so that a failure announced while it
        blocks in a collective stops the caller (the thread is abandoned, and stops at its next
        :meth:`stop_if_abandoned`). A gloo error in it is a failure; any other error is raised as
        it is."""
        self.check(what)
        outcome: list = []
        device = _cuda_device()
        abandoned = threading.Event()

        def target() -> None:
            if device is not None:
                torch.cuda.set_device(device)  # the current device is the thread's own
            _blocking_thread.abandoned = abandoned
            try:
                outcome.append((True, call()))
            except BaseException as error:  # reported to the waiting caller
                outcome.append((False, error))

        thread = threading.Thread(target=target, name="recycle-blocking-call", daemon=True)
        thread.start()
        spins = 0
        while thread.is_alive():
            if self.failed.is_set():
                abandoned.set()
                exit_guard.abandoned(thread)
                raise PeerFailure(f"a failure was announced during {what}")
            spins += 1
            thread.join(SPIN_SECONDS if spins < 200 else POLL_SECONDS)
        ok, value = outcome[0]
        if ok:
            return value
        if isinstance(value, RuntimeError):  # gloo reports a closed peer so
            raise PeerFailure(f"{what}: {value}") from value
        raise value

    @staticmethod
    def inside_blocking_call() -> bool:
        """Whether the calling thread runs a :meth:`blocking` call (or was abandoned in one)."""
        return getattr(_blocking_thread, "abandoned", None) is not None

    @staticmethod
    def stop_if_abandoned(what: str) -> None:
        """In a :meth:`blocking` call's thread that its caller gave up on, raise
        :class:`PeerFailure`. A call abandoned while it wrote files (a checkpoint's shards take
        seconds) would otherwise go on to its next collective, which runs on the world current
        then: after the recovery, the survivors' new one, out of turn. Code that ReCycle owns
        calls this before each such collective."""
        abandoned = getattr(_blocking_thread, "abandoned", None)
        if abandoned is not None and abandoned.is_set():
            raise PeerFailure(f"{what}: abandoned after a failure was announced")

    def _on_nccl_helper(self, start, what: str) -> None:
        """Start the op and poll it to completion in the NCCL helper thread (module doc)."""
        if self._nccl_requests is None:
            requests: queue.Queue = queue.Queue()
            self._nccl_thread = threading.Thread(
                target=_serve_nccl, args=(requests, _cuda_device()), name="recycle-nccl-wait", daemon=True
            )
            self._nccl_thread.start()
            self._nccl_requests = requests
        done, cancel, outcome = threading.Event(), threading.Event(), []
        self._nccl_requests.put((start, done, cancel, outcome))

        def abandon() -> None:
            cancel.set()
            exit_guard.abandoned(self._nccl_thread)  # it may be inside a communicator's making
            self._nccl_requests = None

        self._await(done, outcome, what, abandon)

    def _helper(self) -> queue.Queue:
        if self._requests is None:
            requests: queue.Queue = queue.Queue()
            self._thread = threading.Thread(target=_serve, args=(requests,), name="recycle-p2p-wait", daemon=True)
            self._thread.start()
            self._requests = requests
        return self._requests


def _unbounded(what: str) -> PeerFailure:
    return PeerFailure(f"{what}: not done after {WAIT_BOUND_SECONDS:.0f} s, and no failure was announced")


def _serve(requests: queue.Queue) -> None:
    while True:
        work, done, outcome = requests.get()
        try:
            work.wait()
            outcome.append(None)
        except Exception as error:  # reported to the waiting caller
            outcome.append(error)
        done.set()


def _on_nccl() -> bool:
    return dist.is_initialized() and dist.get_backend() == dist.Backend.NCCL


def _cuda_device() -> int | None:
    """The calling thread's CUDA device, where CUDA is in use."""
    return torch.cuda.current_device() if torch.cuda.is_initialized() else None


def _serve_nccl(requests: queue.Queue, device: int | None) -> None:
    if device is not None:
        torch.cuda.set_device(device)
    while True:
        start, done, cancel, outcome = requests.get()
        try:
            work = start()
            spins = 0
            while not work.is_completed():
                if cancel.is_set():  # abandoned: its communicator is aborted by the recovery
                    return
                spins += 1
                time.sleep(SPIN_SECONDS if spins < 200 else POLL_SECONDS)
            work.wait()
            outcome.append(None)
        except Exception as error:  # reported to the waiting caller
            outcome.append(error)
        done.set()
