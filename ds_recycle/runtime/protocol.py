"""The coordinator protocol: the environment and the store keys shared by the launcher and the trainers.

``ds-recycle launch`` hosts one TCPStore for the whole job and is the single owner of the list of
pending membership changes. Trainers post requests; the launcher validates them (the job token,
the slot, the kind) and appends the accepted ones, and the failures it detects itself, to
``pending``. At the end of every iteration the current members fix, with one ``compare_set``, which
pending changes take effect: the first member to reach the boundary decides for all.

Every key lives under ``job/<generation>/``: a restart from a checkpoint starts a new generation,
so nothing from the previous one is read again.

=========================  ============================================================  ==========
key                        value                                                         writer
=========================  ============================================================  ==========
world_size                 N (the number of slots)                                       launcher
epoch/<n>                  :class:`Membership` JSON                                      members
current_epoch              n, advanced by compare_set from n-1                           members
request_count, request/<k> :class:`Request` JSON (k from ``add(request_count, 1)``)     anyone
pending                    JSON list of :class:`Change` (append-only, seq = index)       launcher
alert                      counter, +1 per failure put in ``pending``                    launcher
decision/<n>/<i>           :class:`Decision` JSON for epoch n at the end of iteration i  members
heartbeat/<slot>           wall time of the last heartbeat (float), or HEARTBEAT_STOPPED  trainer
iteration_seconds/<slot>   the trainer's measured iteration time (float)                 trainer
=========================  ============================================================  ==========
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

ENV_STORE = "DS_RECYCLE_STORE"
"""``host:port`` of the coordinator store (set by ``ds-recycle launch``)."""
ENV_TOKEN = "DS_RECYCLE_TOKEN"
"""The job's secret; a request without it is refused."""
ENV_INCARNATION = "DS_RECYCLE_INCARNATION"
"""0 for a rank's first start, k after its k-th respawn: a process with k > 0 joins a running job."""
ENV_GENERATION = "DS_RECYCLE_GENERATION"
"""0 at first, +1 at every restart of the whole job from a checkpoint; the key prefix."""

RESTART_EXIT_CODE = 75
"""A trainer exits with this code when training cannot go on in place (a stage lost every worker) and
a checkpoint exists: ``ds-recycle launch --respawn`` then restarts every rank from it."""
STOP_EXIT_CODE = 76
"""A trainer exits with this code when training cannot go on in place and there is no checkpoint to
restart from: the launcher stops the job (no respawn) and exits non-zero."""
HEARTBEAT_MIN_TIMEOUT_SECONDS = 10.0
"""Default floor of the hang timeout (the launcher's ``--heartbeat-min-timeout``)."""

LEAVE = "leave"
JOIN = "join"
FAILED = "failed"
PROBE = "probe"
"""A request, never a change: a member's peer stopped answering and no failure was published."""
REQUEST_KINDS = (LEAVE, JOIN, PROBE)


HEARTBEAT_STOPPED = "stopped"
"""Written to ``heartbeat/<slot>`` by a trainer that stops beating on purpose (it finished, or it
left and is exiting): the launcher then stops checking that slot's heartbeat until a numeric one
arrives (a respawned process). Without it, a process whose teardown outlasts the heartbeat timeout
is declared failed and killed."""


def prefix(generation: int) -> str:
    return f"job/{generation}/"


def epoch_key(epoch: int) -> str:
    return f"epoch/{epoch}"


def decision_key(epoch: int, iteration: int) -> str:
    return f"decision/{epoch}/{iteration}"


def request_key(index: int) -> str:
    return f"request/{index}"


def heartbeat_key(slot: int) -> str:
    return f"heartbeat/{slot}"


def iteration_seconds_key(slot: int) -> str:
    return f"iteration_seconds/{slot}"


WORLD_SIZE = "world_size"
CURRENT_EPOCH = "current_epoch"
REQUEST_COUNT = "request_count"
PENDING = "pending"
ALERT = "alert"


@dataclass(frozen=True)
class Membership:
    """The live slots of one epoch; epoch n runs from iteration ``iteration`` on."""

    epoch: int
    members: tuple[int, ...]
    iteration: int

    def to_json(self) -> str:
        return json.dumps({"epoch": self.epoch, "members": list(self.members), "iteration": self.iteration})

    @classmethod
    def from_json(cls, text: str | bytes) -> Membership:
        data = json.loads(text)
        return cls(int(data["epoch"]), tuple(sorted(int(s) for s in data["members"])), int(data["iteration"]))


@dataclass(frozen=True)
class Request:
    """A trainer asks to leave, or a new process asks to join, slot ``slot``."""

    kind: str
    slot: int
    token: str
    pid: int
    time: float

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Request:
        data = json.loads(text)
        return cls(str(data["kind"]), int(data["slot"]), str(data["token"]), int(data["pid"]), float(data["time"]))


@dataclass(frozen=True)
class Change:
    """One accepted membership change. ``time`` is when it happened (the failure was detected, the
    request was posted), for the detection-latency log."""

    seq: int
    kind: str
    slot: int
    time: float
    detail: str = ""


def changes_to_json(changes: list[Change]) -> str:
    return json.dumps([asdict(c) for c in changes])


def changes_from_json(text: str | bytes) -> list[Change]:
    return [
        Change(int(c["seq"]), c["kind"], int(c["slot"]), float(c["time"]), c.get("detail", ""))
        for c in json.loads(text)
    ]


@dataclass(frozen=True)
class Decision:
    """What the members of epoch ``epoch`` agreed at the end of iteration ``iteration``: the
    changes that take effect (``applied`` = seqs of ``pending`` taken so far) and, if any, the
    next membership."""

    epoch: int
    iteration: int
    applied: int
    changes: tuple[Change, ...] = field(default_factory=tuple)
    next: Membership | None = None

    def to_json(self) -> str:
        return json.dumps(
            {
                "epoch": self.epoch,
                "iteration": self.iteration,
                "applied": self.applied,
                "changes": [asdict(c) for c in self.changes],
                "next": None if self.next is None else json.loads(self.next.to_json()),
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Decision:
        data = json.loads(text)
        nxt = data["next"]
        return cls(
            int(data["epoch"]),
            int(data["iteration"]),
            int(data["applied"]),
            tuple(changes_from_json(json.dumps(data["changes"]))),
            None if nxt is None else Membership.from_json(json.dumps(nxt)),
        )
