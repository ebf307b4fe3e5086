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

Sends are asynchronous in the engine and receives block, so a stream set cannot deadlock iff
executing the streams in lockstep (a receive waits for its send, a step waits for the whole
stage) finishes; :func:`check_streams` runs exactly that. Each micro-batch occupies one buffer
slot from its first instruction to its ``BackwardWeight``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ds_recycle.planner.plan import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, STEP, Plan, Worker

if TYPE_CHECKING:
    from deepspeed.runtime.pipe.schedule import PipeInstruction

# The instruction classes subclass DeepSpeed's, and importing DeepSpeed takes seconds: they are
# imported inside the functions below, so that planning (which never lowers) does not pay for it.


@dataclass
class WorkerStream:
    """The instructions of one worker for one iteration and the buffer slots they use."""

    worker: Worker
    instructions: list[PipeInstruction]
    num_buffers: int


def lower(plan: Plan) -> dict[Worker, WorkerStream]:
    runners = plan.runners()
    return {worker: _lower_worker(plan, worker, runners) for worker in plan.live_workers}


def _lower_worker(plan: Plan, worker: Worker, runners: dict) -> WorkerStream:
    from ds_recycle.instructions import (
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

    last_stage = plan.stages - 1
    free_slots: list[int] = []
    slot_of: dict[tuple[int, int], int] = {}
    num_buffers = 0
    out: list[PipeInstruction] = []

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


class StreamError(ValueError):
    pass


def check_streams(streams: dict[Worker, WorkerStream]) -> None:
    """Raise StreamError unless every send has exactly one matching receive and the streams,
    run in lockstep with asynchronous sends and blocking receives, all finish."""
    from ds_recycle.instructions import StaggeredStep
    from ds_recycle.instructions.routed import MATCHING_SEND, RECVS, SENDS

    sends: dict[tuple, int] = {}
    recvs: dict[tuple, int] = {}
    for worker, stream in streams.items():
        for ins in stream.instructions:
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

    pc = {w: 0 for w in streams}
    done_sends: set[tuple] = set()
    stages = {w[1] for w in streams}
    members = {s: [w for w in streams if w[1] == s] for s in stages}
    progressed = True
    while progressed:
        progressed = False
        for worker, stream in streams.items():
            while pc[worker] < len(stream.instructions):
                ins = stream.instructions[pc[worker]]
                if isinstance(ins, RECVS):
                    key = (MATCHING_SEND[type(ins)].__name__, ins.peer, worker, ins.home, ins.mb)
                    if key not in done_sends:
                        break
                elif isinstance(ins, StaggeredStep):
                    peers = members[worker[1]]
                    at_step = all(
                        pc[p] < len(streams[p].instructions)
                        and isinstance(streams[p].instructions[pc[p]], StaggeredStep)
                        for p in peers
                    )
                    if not at_step:
                        break
                    for p in peers:
                        if p != worker:
                            pc[p] += 1
                elif isinstance(ins, SENDS):
                    done_sends.add((type(ins).__name__, worker, ins.peer, ins.home, ins.mb))
                pc[worker] += 1
                progressed = True
    stuck = {w: streams[w].instructions[pc[w]] for w in streams if pc[w] < len(streams[w].instructions)}
    if stuck:
        detail = ", ".join(f"{w} at {ins!r}" for w, ins in sorted(stuck.items()))
        raise StreamError(f"streams deadlock: {detail}")


def stream_kinds(stream: WorkerStream) -> list[tuple[str, int, int]]:
    """The compute ops of a stream as (F|B|W|S, home, mb), the form the engine's events use."""
    from ds_recycle.instructions import BackwardInput, BackwardWeight, ForwardPass, StaggeredStep

    names = {ForwardPass: FORWARD, BackwardInput: BACKWARD_INPUT, BackwardWeight: BACKWARD_WEIGHT}
    out = []
    for ins in stream.instructions:
        if type(ins) in names:
            out.append((names[type(ins)], ins.home, ins.mb))
        elif isinstance(ins, StaggeredStep):
            out.append((STEP, -1, -1))
    return out
