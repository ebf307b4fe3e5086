"""The records of the coordinator protocol: each one's fields and its JSON round trip (the keys
they are written under are in :mod:`ds_recycle.runtime.shared.keys`), and the kinds of change and request."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

LEAVE = "leave"
JOIN = "join"
FAILED = "failed"
PROBE = "probe"
"""A request, never a change: a member's peer stopped answering and no failure was published."""
MOVE = "move"
"""A migration: member ``slot`` leaves at the boundary that takes it, and the agent that ran it
starts a process for ``target`` on the same device, which joins as any respawn does."""
RETIRED = "retired"
"""A change, never a request: the agent will not start ``slot`` again (it kept failing, or a mover
left it), so a migration may fill it. It changes no membership."""
REQUEST_KINDS = (LEAVE, JOIN, PROBE, MOVE)
OUT_KINDS = (FAILED, LEAVE, MOVE)


@dataclass(frozen=True)
class Membership:
    """The live slots of one epoch; epoch n runs from iteration ``iteration`` on."""

    epoch: int
    members: tuple[int, ...]
    iteration: int

    def to_json(self) -> str:
        """The members as runs of consecutive slots (``[first, end)`` pairs): a job of thousands of
        ranks with a few out is a few numbers, which every rank reads at every change."""
        runs: list[list[int]] = []
        for slot in sorted(self.members):
            if runs and runs[-1][1] == slot:
                runs[-1][1] = slot + 1
            else:
                runs.append([slot, slot + 1])
        return json.dumps({"epoch": self.epoch, "runs": runs, "iteration": self.iteration}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> Membership:
        data = json.loads(text)
        members = tuple(slot for first, end in data["runs"] for slot in range(int(first), int(end)))
        return cls(int(data["epoch"]), tuple(sorted(members)), int(data["iteration"]))


@dataclass(frozen=True)
class Request:
    """A trainer asks to leave, or a new process asks to join, slot ``slot``; a member asks that
    ``slot`` move into ``target`` (a migration)."""

    kind: str
    slot: int
    pid: int
    time: float
    target: int | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Request:
        data = json.loads(text)
        target = data.get("target")
        return cls(
            str(data["kind"]),
            int(data["slot"]),
            int(data["pid"]),
            float(data["time"]),
            None if target is None else int(target),
        )


@dataclass(frozen=True)
class AgentReport:
    """A node's agent tells the coordinator that one of its ranks started or exited."""

    kind: str
    """``started`` or ``exited``."""
    node: int
    node_incarnation: int
    slot: int
    incarnation: int
    pid: int
    code: int | None
    """Popen's convention for ``exited``; None for ``started``."""
    time: float

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> AgentReport:
        data = json.loads(text)
        code = data["code"]
        return cls(
            str(data["kind"]),
            int(data["node"]),
            int(data["node_incarnation"]),
            int(data["slot"]),
            int(data["incarnation"]),
            int(data["pid"]),
            None if code is None else int(code),
            float(data["time"]),
        )


@dataclass(frozen=True)
class Beat:
    """A rank's last heartbeat: when it was written, and the rank's last measured iteration time."""

    time: float
    """Wall time of the beat (a trainer that exits dates its last one ahead: its teardown is no hang)."""
    iteration_seconds: float | None = None
    stopped: bool = False
    """The trainer stopped beating on purpose (it finished, or left and is exiting): the coordinator
    does not check the slot until a later beat arrives (a respawned process). Without it, a process
    whose teardown outlasts the heartbeat timeout is declared failed and killed."""

    def to_list(self) -> list:
        return [self.time, self.iteration_seconds, self.stopped]

    @classmethod
    def from_list(cls, row: list) -> Beat:
        time, seconds, stopped = row
        return cls(float(time), None if seconds is None else float(seconds), bool(stopped))


@dataclass(frozen=True)
class Lease:
    """A node's agent is alive: renewed every fraction of the lease timeout, with the last beat of
    each of the node's ranks that has one."""

    node_incarnation: int
    time: float
    beats: dict[int, Beat] = field(default_factory=dict)

    def to_json(self) -> str:
        beats = {str(slot): beat.to_list() for slot, beat in self.beats.items()}
        return json.dumps({"node_incarnation": self.node_incarnation, "time": self.time, "beats": beats})

    @classmethod
    def from_json(cls, text: str | bytes) -> Lease:
        data = json.loads(text)
        beats = {int(slot): Beat.from_list(row) for slot, row in data.get("beats", {}).items()}
        return cls(int(data["node_incarnation"]), float(data["time"]), beats)


@dataclass(frozen=True)
class AgentEnd:
    """A node's agent ended with exit code ``code``; ``node_incarnation`` tells it from a later
    agent of the same node (one re-admitted after it)."""

    node_incarnation: int
    code: int

    def to_json(self) -> str:
        return json.dumps({"node_incarnation": self.node_incarnation, "code": self.code})

    @classmethod
    def from_json(cls, text: str | bytes) -> AgentEnd:
        data = json.loads(text)
        return cls(int(data["node_incarnation"]), int(data["code"]))


@dataclass(frozen=True)
class CheckIn:
    """An agent waits for the coordinator to start a generation; ``last_generation`` is the one its
    ranks ran last (-1: none, a fresh agent)."""

    node: int
    last_generation: int

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> CheckIn:
        data = json.loads(text)
        return cls(int(data["node"]), int(data["last_generation"]))


@dataclass(frozen=True)
class KillOrder:
    slot: int
    incarnation: int

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> KillOrder:
        data = json.loads(text)
        return cls(int(data["slot"]), int(data["incarnation"]))


@dataclass(frozen=True)
class Change:
    """One accepted membership change. ``time`` is when it happened (the failure was detected, the
    request was posted), for the detection-latency log."""

    seq: int
    kind: str
    slot: int
    time: float
    detail: str = ""
    target: int | None = None
    """The slot a ``move`` fills."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Change:
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, c: dict) -> Change:
        target = c.get("target")
        return cls(
            int(c["seq"]),
            c["kind"],
            int(c["slot"]),
            float(c["time"]),
            c.get("detail", ""),
            None if target is None else int(target),
        )


def changes_to_json(changes: list[Change]) -> str:
    return json.dumps([asdict(c) for c in changes])


def changes_from_json(text: str | bytes) -> list[Change]:
    return [Change.from_dict(c) for c in json.loads(text)]


GroupState = tuple[int, int]
"""A process group as a survivor holds it: ``(the epoch it was made in, the collectives posted on
it)``."""


@dataclass(frozen=True)
class Progress:
    """How far a survivor got when a failure stopped it: ``done`` iterations finished, and whether
    it had already stepped the in-flight iteration ``done``; and the groups it holds for its roles
    in the grid of epoch ``grid_epoch`` (:data:`GroupState` by role), by which the survivors agree
    which groups to keep (:func:`~ds_recycle.runtime.shared.policy.groups_to_remake`)."""

    done: int
    stepped: bool
    grid_epoch: int = -1
    groups: dict[str, GroupState] = field(default_factory=dict)

    def to_json(self) -> str:
        groups = {role: list(state) for role, state in sorted(self.groups.items())}
        return json.dumps([self.done, self.stepped, self.grid_epoch, groups], separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> Progress:
        done, stepped, grid_epoch, groups = json.loads(text)
        return cls(int(done), bool(stepped), int(grid_epoch), {r: (int(m), int(n)) for r, (m, n) in groups.items()})


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
    remade: tuple[str, ...] | None = None
    """The roles whose groups the next epoch makes afresh
    (:func:`~ds_recycle.runtime.shared.policy.groups_to_remake`); None: all."""

    def holders(self) -> tuple[int, ...]:
        """The members of the next epoch that hold the trained state: all but the slots this
        decision admits. Joiners copy their state from them. Every member of the next epoch reads
        the same decision, so they agree on it, whichever epoch each had entered to the end (a
        failure can stop some members of an epoch in its state transfer while others train in it;
        a joiner stopped before its state arrived gives up its join, so it is never among them)."""
        joined = {c.slot for c in self.changes if c.kind == JOIN}
        return tuple(s for s in self.next.members if s not in joined)

    def to_json(self) -> str:
        return json.dumps(
            {
                "epoch": self.epoch,
                "iteration": self.iteration,
                "applied": self.applied,
                "changes": [asdict(c) for c in self.changes],
                "next": None if self.next is None else json.loads(self.next.to_json()),
                "remade": None if self.remade is None else list(self.remade),
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
            tuple(Change.from_dict(c) for c in data["changes"]),
            None if nxt is None else Membership.from_json(json.dumps(nxt)),
            None if data.get("remade") is None else tuple(str(r) for r in data["remade"]),
        )
