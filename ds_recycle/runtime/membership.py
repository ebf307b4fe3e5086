"""The membership agent: the one owner of membership on a trainer.

It talks to the coordinator store that ``ds-recycle launch`` hosts (ds_recycle/runtime/protocol.py
has the keys). It knows the current epoch, posts this process's requests (leave on SIGTERM, join
after a respawn), takes the per-boundary decision that every member of the epoch shares, and
keeps a heartbeat so that the launcher can tell a hung process from a slow one.

A decision is one ``compare_set`` on ``decision/<epoch>/<iteration>``: the first member at the
boundary proposes the changes pending at that moment and everyone else reads its proposal back, so
all members apply the same changes at the same iteration, whatever their relative progress.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist
from deepspeed.utils import logger

from ds_recycle.runtime import protocol as proto
from ds_recycle.runtime.protocol import Change, Decision, Membership, Request

HEARTBEAT_SECONDS = 0.1
STORE_TIMEOUT_SECONDS = 120.0


class MembershipError(RuntimeError):
    """The coordinator cannot be reached, or a request was not admitted in time."""


def connect(address: str, generation: int, timeout: float = STORE_TIMEOUT_SECONDS):
    """A client of the coordinator store at ``host:port``, under the generation's key prefix."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise MembershipError(f"{proto.ENV_STORE}={address!r} must be host:port")
    base = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout), wait_for_workers=False)
    return dist.PrefixStore(proto.prefix(generation), base)


@dataclass
class MembershipAgent:
    address: str
    slot: int
    token: str
    incarnation: int
    generation: int
    store: object = None
    current: Membership | None = None
    applied: int = 0
    """How many entries of ``pending`` the decisions so far have taken."""
    leave_requested: bool = False
    _heartbeat: threading.Thread | None = field(default=None, repr=False)
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)

    @classmethod
    def from_env(cls, environ=os.environ) -> MembershipAgent | None:
        """The agent of a process started by ``ds-recycle launch``; None under any other launcher."""
        address = environ.get(proto.ENV_STORE)
        if not address:
            return None
        agent = cls(
            address=address,
            slot=int(environ["RANK"]),
            token=environ.get(proto.ENV_TOKEN, ""),
            incarnation=int(environ.get(proto.ENV_INCARNATION, "0")),
            generation=int(environ.get(proto.ENV_GENERATION, "0")),
        )
        agent.store = connect(address, agent.generation)
        agent.current = agent._read_current()
        return agent

    @property
    def is_joiner(self) -> bool:
        """A respawned process: it enters a running job instead of starting one."""
        return self.incarnation > 0

    # ---- requests --------------------------------------------------------------------------

    def request(self, kind: str) -> None:
        index = self.store.add(proto.REQUEST_COUNT, 1)
        request = Request(kind, self.slot, self.token, os.getpid(), time.time())
        self.store.set(proto.request_key(index), request.to_json())

    def install_leave_handler(self) -> None:
        """SIGTERM (a preemption notice) means: finish this iteration, then leave the job."""

        def on_sigterm(signum, frame):
            if not self.leave_requested:
                self.leave_requested = True
                logger.info(f"ReCycle: slot {self.slot} got SIGTERM; leaving at the next iteration boundary")
                threading.Thread(target=self._post_leave, name="recycle-leave", daemon=True).start()

        signal.signal(signal.SIGTERM, on_sigterm)

    def _post_leave(self) -> None:
        # Its own client: the main thread may be inside a store call on the agent's client.
        store = connect(self.address, self.generation)
        index = store.add(proto.REQUEST_COUNT, 1)
        store.set(
            proto.request_key(index), Request(proto.LEAVE, self.slot, self.token, os.getpid(), time.time()).to_json()
        )

    # ---- decisions ---------------------------------------------------------------------------

    def decide(self, iteration: int) -> Decision:
        """The decision of the current epoch's members at the boundary before ``iteration``."""
        epoch = self.current.epoch
        pending = self._pending()
        changes = tuple(c for c in pending[self.applied :])
        proposal = Decision(epoch, iteration, len(pending), changes, self._next(changes, iteration))
        value = self.store.compare_set(proto.decision_key(epoch, iteration), "", proposal.to_json())
        decision = Decision.from_json(value)
        self.applied = decision.applied
        if decision.next is not None:
            self._publish(decision.next)
            self.current = decision.next
        return decision

    def _next(self, changes: tuple[Change, ...], iteration: int) -> Membership | None:
        members = set(self.current.members)
        for change in changes:
            if change.kind == proto.JOIN:
                members.add(change.slot)
            else:
                members.discard(change.slot)
        if members == set(self.current.members):
            return None
        return Membership(self.current.epoch + 1, tuple(sorted(members)), iteration)

    def _publish(self, membership: Membership) -> None:
        self.store.compare_set(proto.epoch_key(membership.epoch), "", membership.to_json())
        self.store.compare_set(proto.CURRENT_EPOCH, str(membership.epoch - 1), str(membership.epoch))

    def _pending(self) -> list[Change]:
        if not self.store.check([proto.PENDING]):
            return []
        return proto.changes_from_json(self.store.get(proto.PENDING))

    def _read_current(self) -> Membership:
        epoch = int(self.store.get(proto.CURRENT_EPOCH))
        return Membership.from_json(self.store.get(proto.epoch_key(epoch)))

    # ---- joining -----------------------------------------------------------------------------

    def wait_for_admission(self, timeout: float) -> Membership:
        """Post a join request and wait until an epoch includes this slot."""
        self.request(proto.JOIN)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            current = self._read_current()
            if self.slot in current.members:
                admitted = self.store.get(proto.decision_key(current.epoch - 1, current.iteration))
                self.current = current
                self.applied = Decision.from_json(admitted).applied
                return current
            time.sleep(0.02)
        raise MembershipError(
            f"slot {self.slot} asked to join but no epoch admitted it within {timeout:.0f} s "
            f"(is the job still running, and was the request refused by the launcher?)"
        )

    # ---- liveness ------------------------------------------------------------------------------

    def start_heartbeat(self) -> None:
        if self._heartbeat is not None:
            return
        store = connect(self.address, self.generation)

        def beat():
            while not self._stop.wait(HEARTBEAT_SECONDS):
                store.set(proto.heartbeat_key(self.slot), repr(time.time()))

        store.set(proto.heartbeat_key(self.slot), repr(time.time()))
        self._heartbeat = threading.Thread(target=beat, name="recycle-heartbeat", daemon=True)
        self._heartbeat.start()

    def publish_iteration_seconds(self, seconds: float) -> None:
        self.store.set(proto.iteration_seconds_key(self.slot), repr(seconds))

    def stop(self) -> None:
        self._stop.set()
