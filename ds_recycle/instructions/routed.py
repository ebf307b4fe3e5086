"""Instruction classes. Pure data: the engine gives them meaning."""

from __future__ import annotations

from deepspeed.runtime.pipe import schedule

from ds_recycle.planner.plan import Worker


class _MicroBatchOp:
    """Mixin for instructions that concern micro-batch ``(home, mb)`` held in ``buffer_id``."""

    buffer_id: int
    home: int
    mb: int

    def key(self) -> tuple[str, int, int]:
        return (self.name, self.home, self.mb)

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.kwargs == other.kwargs

    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted(self.kwargs.items()))))


class LoadMicroBatch(_MicroBatchOp, schedule.LoadMicroBatch):
    """Load the inputs (first stage) or labels (last stage) of micro-batch (home, mb)."""

    def __init__(self, buffer_id: int, home: int, mb: int):
        super().__init__(buffer_id, home=home, mb=mb)


class ForwardPass(_MicroBatchOp, schedule.ForwardPass):
    def __init__(self, buffer_id: int, home: int, mb: int):
        super().__init__(buffer_id, home=home, mb=mb)


class BackwardInput(_MicroBatchOp, schedule.BufferOpInstruction):
    """Gradients of the stage input only: the critical path of the backward pass."""

    def __init__(self, buffer_id: int, home: int, mb: int):
        super().__init__(buffer_id, home=home, mb=mb)


class BackwardWeight(_MicroBatchOp, schedule.BufferOpInstruction):
    """Gradients of the stage parameters, deferred into a bubble; frees the buffer."""

    def __init__(self, buffer_id: int, home: int, mb: int):
        super().__init__(buffer_id, home=home, mb=mb)


class SendActivation(_MicroBatchOp, schedule.SendActivation):
    def __init__(self, buffer_id: int, home: int, mb: int, peer: Worker):
        super().__init__(buffer_id, home=home, mb=mb, peer=tuple(peer))


class RecvActivation(_MicroBatchOp, schedule.RecvActivation):
    def __init__(self, buffer_id: int, home: int, mb: int, peer: Worker):
        super().__init__(buffer_id, home=home, mb=mb, peer=tuple(peer))


class SendGrad(_MicroBatchOp, schedule.SendGrad):
    def __init__(self, buffer_id: int, home: int, mb: int, peer: Worker):
        super().__init__(buffer_id, home=home, mb=mb, peer=tuple(peer))


class RecvGrad(_MicroBatchOp, schedule.RecvGrad):
    def __init__(self, buffer_id: int, home: int, mb: int, peer: Worker):
        super().__init__(buffer_id, home=home, mb=mb, peer=tuple(peer))


class StaggeredStep(schedule.PipeInstruction):
    """This stage's DP all-reduce and optimizer step, with no barrier across stages."""

    def __init__(self):
        super().__init__()

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other)

    def __hash__(self) -> int:
        return hash(self.name)


SENDS = (SendActivation, SendGrad)
RECVS = (RecvActivation, RecvGrad)
MATCHING_SEND = {RecvActivation: SendActivation, RecvGrad: SendGrad}
