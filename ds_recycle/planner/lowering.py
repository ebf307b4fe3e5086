"""Lowering: a Plan becomes one instruction stream per live worker.

For every op of a worker, in plan order:

- ``F(h, k, s)``: a ``LoadMicroBatch`` on the first and last stage (inputs and labels), a
  ``RecvActivation`` from the runner of ``F(h, k, s-1)`` on other stages, the ``ForwardPass``,
  and a ``SendActivation`` to the runner of ``F(h, k, s+1)`` unless ``s`` is the last stage;
- ``B(h, k, s)``: a ``RecvGrad`` from the runner of ``B(h, k, s+1)`` unless ``s`` is the last
  stage, the ``BackwardInput``, and a ``SendGrad`` to the runner of ``B(h, k, s-1)`` unless
  ``s == 0``;
- ``W(h, k, s)``: a ``BackwardWeight``;
- ``S``: a ``StaggeredStep``.

Routed p2p matches the messages of a directed pair of workers in the order they were posted (no
tags: NCCL has none), so both sides must post a pair's transfers in one order. A pair from stage
``s`` to ``s + 1`` carries only activations and one from ``s + 1`` to ``s`` only gradients, but the
plan may order two micro-batches of a pair differently on its two workers. The lowering then moves
transfers, never compute:

- activations: the sender follows the receiver's order, holding a send back until the activations
  the receiver takes before it have been sent (receiving early instead would need a buffer slot
  beyond the plan's memory cap). The held output stays in its slot until the sender's
  ``BackwardInput`` of that micro-batch, which waits for a gradient that needs the activation;
- gradients: the receiver follows the sender's order, receiving a gradient sent earlier than the
  one it waits for right away, into the slot its micro-batch already holds (sending late instead
  could outlive the sender's slot, which its ``BackwardWeight`` frees).

Either way a transfer moves only to a point where its message has already been sent (a held send
goes out right after the one the receiver waits for; an early receive takes a message sent before
the one it waits for), so no worker waits longer than in the plan's order. :func:`check_pair_order`
checks that every pair's sends and receives agree, and :func:`lower` runs it on every plan.

Sends are asynchronous in the engine and receives block, so a stream set cannot deadlock iff
executing the streams in lockstep (a receive waits for its send, a step waits for the whole
stage) finishes; :func:`check_streams` runs exactly that. Each micro-batch occupies one buffer
slot from its first instruction to its ``BackwardWeight``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ds_recycle.planner.actions import (
    MATCHING_SEND,
    RECVS,
    SENDS,
    Action,
    BackwardInput,
    BackwardWeight,
    ForwardPass,
    LoadMicroBatch,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
    StaggeredStep,
)
from ds_recycle.planner.plan import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, STEP, Plan, Worker


@dataclass
class WorkerStream:
    """The actions of one worker for one iteration and the buffer slots they use."""

    worker: Worker
    actions: list[Action]
    num_buffers: int


def lower(plan: Plan) -> dict[Worker, WorkerStream]:
    """One stream per live worker; raises StreamError if two sides of a pair disagree on its order."""
    runners = plan.runners()
    streams = {worker: _lower_worker(plan, worker, runners) for worker in plan.live_workers}
    _order_transfers(streams)
    check_pair_order(streams)
    return streams


def _lower_worker(plan: Plan, worker: Worker, runners: dict) -> WorkerStream:

    last_stage = plan.stages - 1
    free_slots: list[int] = []
    slot_of: dict[tuple[int, int], int] = {}
    num_buffers = 0
    out: list[Action] = []

    for op in plan.workers[worker]:
        if op.kind == STEP:
            out.append(StaggeredStep())
            continue
        h, k, s = op.home, op.mb, op.stage
        if (h, k) not in slot_of:
            if free_slots:
                slot_of[(h, k)] = free_slots.pop()
            else:
                slot_of[(h, k)] = num_buffers
                num_buffers += 1
        buf = slot_of[(h, k)]
        if op.kind == FORWARD:
            if s == 0 or s == last_stage:
                out.append(LoadMicroBatch(buf, h, k))
            if s > 0:
                out.append(RecvActivation(buf, h, k, runners[(FORWARD, h, k, s - 1)]))
            out.append(ForwardPass(buf, h, k))
            if s < last_stage:
                out.append(SendActivation(buf, h, k, runners[(FORWARD, h, k, s + 1)]))
        elif op.kind == BACKWARD_INPUT:
            if s < last_stage:
                out.append(RecvGrad(buf, h, k, runners[(BACKWARD_INPUT, h, k, s + 1)]))
            out.append(BackwardInput(buf, h, k))
            if s > 0:
                out.append(SendGrad(buf, h, k, runners[(BACKWARD_INPUT, h, k, s - 1)]))
        elif op.kind == BACKWARD_WEIGHT:
            out.append(BackwardWeight(buf, h, k))
            free_slots.append(slot_of.pop((h, k)))
        else:
            raise ValueError(f"lowering: unknown op kind {op.kind!r} in {op.label()} on worker {worker}")
    return WorkerStream(worker, out, max(num_buffers, 1))


def _order_transfers(streams: dict[Worker, WorkerStream]) -> None:
    """Make both sides of every pair post its transfers in one order (see the module docstring)."""

    receive_order = _pair_order(streams, RecvActivation, received=True)
    for worker, stream in streams.items():
        stream.actions = _hold_sends(worker, stream.actions, SendActivation, receive_order)
    send_order = _pair_order(streams, SendGrad, received=False)
    for worker, stream in streams.items():
        stream.actions = _receive_early(worker, stream.actions, RecvGrad, send_order)


def _pair_order(streams: dict[Worker, WorkerStream], kind: type, received: bool) -> dict[tuple, list]:
    """``(sender, receiver) -> [(home, mb), ...]`` of the ``kind`` actions, in stream order."""
    order: dict[tuple, list] = {}
    for worker, stream in streams.items():
        for ins in stream.actions:
            if isinstance(ins, kind):
                pair = (ins.peer, worker) if received else (worker, ins.peer)
                order.setdefault(pair, []).append((ins.home, ins.mb))
    return order


def _hold_sends(worker: Worker, actions: list, kind: type, receive_order: dict[tuple, list]) -> list:
    """Emit each ``kind`` send once every message its receiver takes before it has been sent."""
    out: list = []
    held: dict[Worker, dict[tuple[int, int], Action]] = {}
    position: dict[Worker, int] = {}
    for ins in actions:
        wanted = receive_order.get((worker, ins.peer)) if isinstance(ins, kind) else None
        if wanted is None:
            out.append(ins)
            continue
        waiting = held.setdefault(ins.peer, {})
        waiting[(ins.home, ins.mb)] = ins
        i = position.get(ins.peer, 0)
        while i < len(wanted) and wanted[i] in waiting:
            out.append(waiting.pop(wanted[i]))
            i += 1
        position[ins.peer] = i
    out.extend(ins for waiting in held.values() for ins in waiting.values())  # only for a malformed plan
    return out


def _receive_early(worker: Worker, actions: list, kind: type, send_order: dict[tuple, list]) -> list:
    """Before each ``kind`` receive, receive the messages its sender sent before it."""
    later = {(ins.peer, ins.home, ins.mb): ins for ins in actions if isinstance(ins, kind)}
    out: list = []
    taken: set[tuple] = set()
    position: dict[Worker, int] = {}
    index: dict[Worker, dict[tuple[int, int], int]] = {}
    for ins in actions:
        if not isinstance(ins, kind):
            out.append(ins)
            continue
        if (ins.peer, ins.home, ins.mb) in taken:
            continue
        sent = send_order.get((ins.peer, worker), [])
        if ins.peer not in index:
            index[ins.peer] = {key: i for i, key in enumerate(sent)}
        at = index[ins.peer].get((ins.home, ins.mb))
        i = position.get(ins.peer, 0)
        if at is not None and at >= i:
            for home, mb in sent[i:at]:
                early = later.get((ins.peer, home, mb))
                if early is not None:
                    out.append(early)
                    taken.add((ins.peer, home, mb))
            position[ins.peer] = at + 1
        out.append(ins)
    return out


class StreamError(ValueError):
    pass


def check_streams(streams: dict[Worker, WorkerStream]) -> None:
    """Raise StreamError unless every send has exactly one matching receive, every pair's sends
    and receives come in one order (:func:`check_pair_order`), ``StaggeredStep`` ends its stream,
    every instruction uses its micro-batch's buffer slot, and the streams, run in lockstep with
    asynchronous sends and blocking receives matched in order per pair, all finish."""

    sends: dict[tuple, int] = {}
    recvs: dict[tuple, int] = {}
    for worker, stream in streams.items():
        for ins in stream.actions:
            if isinstance(ins, SENDS):
                key = (type(ins).__name__, worker, ins.peer, ins.home, ins.mb)
                sends[key] = sends.get(key, 0) + 1
            elif isinstance(ins, RECVS):
                key = (MATCHING_SEND[type(ins)].__name__, ins.peer, worker, ins.home, ins.mb)
                recvs[key] = recvs.get(key, 0) + 1
    for key in sends.keys() | recvs.keys():
        if sends.get(key, 0) != 1 or recvs.get(key, 0) != 1:
            kind, src, dst, h, k = key
            raise StreamError(
                f"{kind} of micro-batch ({h},{k}) from {src} to {dst}: "
                f"{sends.get(key, 0)} send(s) and {recvs.get(key, 0)} receive(s); exactly one of each is needed"
            )
    check_pair_order(streams)
    for worker, stream in streams.items():
        _check_step_last(worker, stream)
        _check_buffers(worker, stream)

    pc = {w: 0 for w in streams}
    posted: dict[tuple[Worker, Worker], int] = {}
    taken: dict[tuple[Worker, Worker], int] = {}
    stages = {w[1] for w in streams}
    members = {s: [w for w in streams if w[1] == s] for s in stages}
    progressed = True
    while progressed:
        progressed = False
        for worker, stream in streams.items():
            while pc[worker] < len(stream.actions):
                ins = stream.actions[pc[worker]]
                if isinstance(ins, RECVS):
                    pair = (ins.peer, worker)
                    if posted.get(pair, 0) <= taken.get(pair, 0):
                        break
                    taken[pair] = taken.get(pair, 0) + 1
                elif isinstance(ins, StaggeredStep):
                    peers = members[worker[1]]
                    at_step = all(
                        pc[p] < len(streams[p].actions) and isinstance(streams[p].actions[pc[p]], StaggeredStep)
                        for p in peers
                    )
                    if not at_step:
                        break
                    for p in peers:
                        if p != worker:
                            pc[p] += 1
                elif isinstance(ins, SENDS):
                    posted[(worker, ins.peer)] = posted.get((worker, ins.peer), 0) + 1
                pc[worker] += 1
                progressed = True
    stuck = {w: streams[w].actions[pc[w]] for w in streams if pc[w] < len(streams[w].actions)}
    if stuck:
        detail = ", ".join(f"{w} at {ins!r}" for w, ins in sorted(stuck.items()))
        raise StreamError(f"streams deadlock: {detail}")


def transfers(streams: dict[Worker, WorkerStream]) -> dict[tuple[Worker, Worker], tuple[list, list]]:
    """``(sender, receiver) -> (sent, received)``: the pair's transfers as ``("activation" or
    "gradient", home, mb)``, in the sender's and in the receiver's stream order."""

    kinds = {SendActivation: "activation", SendGrad: "gradient", RecvActivation: "activation", RecvGrad: "gradient"}
    out: dict[tuple[Worker, Worker], tuple[list, list]] = {}
    for worker, stream in streams.items():
        for ins in stream.actions:
            kind = kinds.get(type(ins))
            if kind is None:
                continue
            sending = isinstance(ins, (SendActivation, SendGrad))
            pair = (worker, ins.peer) if sending else (ins.peer, worker)
            out.setdefault(pair, ([], []))[0 if sending else 1].append((kind, ins.home, ins.mb))
    return out


def check_pair_order(streams: dict[Worker, WorkerStream]) -> None:
    """Raise StreamError unless, on every directed pair of workers, the sequence of sends equals the
    sequence of receives: p2p without tags matches a pair's messages in the order they were posted."""
    for (src, dst), (sent, received) in sorted(transfers(streams).items()):
        if sent == received:
            continue
        pairs = zip(sent, received, strict=False)
        i = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(sent), len(received)))
        raise StreamError(
            f"transfers from {src} to {dst} are posted in different orders: transfer {i} of the pair is "
            f"{_transfer(sent, i)} on {src} but {_transfer(received, i)} on {dst} "
            "(p2p matches a pair's messages in the order they were posted)"
        )


def _transfer(sequence: list, i: int) -> str:
    if i >= len(sequence):
        return "nothing"
    kind, home, mb = sequence[i]
    return f"the {kind} of micro-batch ({home},{mb})"


def _check_step_last(worker: Worker, stream: WorkerStream) -> None:
    """The step's own messages (engine/staggered_step.py) follow every routed transfer of a pair."""

    steps = [i for i, ins in enumerate(stream.actions) if isinstance(ins, StaggeredStep)]
    if len(steps) > 1 or (steps and steps[0] != len(stream.actions) - 1):
        raise StreamError(
            f"worker {worker}: StaggeredStep must be the stream's one last instruction, found at "
            f"{steps} of {len(stream.actions)}"
        )


def _check_buffers(worker: Worker, stream: WorkerStream) -> None:
    """Each micro-batch holds one slot from its first instruction to its BackwardWeight, alone."""

    holder: dict[int, tuple[int, int]] = {}
    freed: set[tuple[int, int]] = set()
    for ins in stream.actions:
        buffer_id = getattr(ins, "buffer_id", None)
        if buffer_id is None:
            continue
        micro_batch = (ins.home, ins.mb)
        if micro_batch in freed:
            raise StreamError(f"worker {worker}: {ins!r} comes after the BackwardWeight that freed its buffer")
        if not 0 <= buffer_id < stream.num_buffers:
            raise StreamError(f"worker {worker}: {ins!r} uses buffer {buffer_id} of {stream.num_buffers}")
        owner = holder.setdefault(buffer_id, micro_batch)
        if owner != micro_batch:
            raise StreamError(f"worker {worker}: {ins!r} uses buffer {buffer_id}, which micro-batch {owner} holds")
        if isinstance(ins, BackwardWeight):
            del holder[buffer_id]
            freed.add(micro_batch)


def stream_kinds(stream: WorkerStream) -> list[tuple[str, int, int]]:
    """The compute ops of a stream as (F|B|W|S, home, mb), the form the engine's events use."""

    names = {ForwardPass: FORWARD, BackwardInput: BACKWARD_INPUT, BackwardWeight: BACKWARD_WEIGHT}
    out = []
    for ins in stream.actions:
        if type(ins) in names:
            out.append((names[type(ins)], ins.home, ins.mb))
        elif isinstance(ins, StaggeredStep):
            out.append((STEP, -1, -1))
    return out
