"""The lowering's output and the engine's instructions: one worker's program for one iteration.

Pure data with no DeepSpeed in it. The engine runs the actions as they are: its instruction map
is keyed on their classes and calls ``handler(engine, **action.kwargs)``, which is all DeepSpeed's
``PipeInstruction`` gives an instruction (``name``, ``kwargs``, the same ``repr``). A micro-batch
action names the micro-batch (``home`` pipeline, ``mb`` index) and its buffer slot; a transfer
also names the peer worker ``(pipeline, stage)``, which can be in another pipeline after a
failure. ``str(action)`` is a compact label (``F(b0,h1,k2)``, ``SendActivation(b0,h1,k2->(1, 1))``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ds_recycle.planner.plan import Worker


@dataclass(frozen=True)
class Action:
    @property
    def name(self) -> str:
        return type(self).__name__

    @property
    def kwargs(self) -> dict:
        """The fields by name: the engine's handler of this action takes them as keywords."""
        return dict(vars(self))


@dataclass(frozen=True)
class MicroBatchAction(Action):
    buffer_id: int
    home: int
    mb: int

    def __str__(self) -> str:
        return f"{self.name}(b{self.buffer_id},h{self.home},k{self.mb})"


@dataclass(frozen=True)
class TransferAction(MicroBatchAction):
    peer: Worker

    def __str__(self) -> str:
        return f"{self.name}(b{self.buffer_id},h{self.home},k{self.mb}->{self.peer})"


class LoadMicroBatch(MicroBatchAction):
    """Load the inputs (first stage) or labels (last stage) of micro-batch (home, mb)."""


class ForwardPass(MicroBatchAction):
    pass


class BackwardInput(MicroBatchAction):
    """Gradients of the stage input only: the critical path of the backward pass."""


class BackwardWeight(MicroBatchAction):
    """Gradients of the stage parameters, deferred into a bubble; frees the buffer."""


class SendActivation(TransferAction):
    pass


class RecvActivation(TransferAction):
    pass


class SendGrad(TransferAction):
    pass


class RecvGrad(TransferAction):
    pass


@dataclass(frozen=True)
class StaggeredStep(Action):
    """This stage's DP all-reduce and optimizer step, with no barrier across stages."""

    def __str__(self) -> str:
        return "StaggeredStep"


SENDS = (SendActivation, SendGrad)
RECVS = (RecvActivation, RecvGrad)
MATCHING_SEND = {RecvActivation: SendActivation, RecvGrad: SendGrad}
