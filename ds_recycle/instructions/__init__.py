"""ReCycle's pipeline instructions.

Each is a subclass of DeepSpeed's ``PipeInstruction`` family. The routed ones name the
micro-batch they concern (``home`` pipeline and ``mb`` index) and, for transfers, the peer
worker ``(pipeline, stage)``, which can be in another pipeline after a failure. The engine runs
them through its own instruction map; DeepSpeed's map is left untouched.
"""

from deepspeed.runtime.pipe.schedule import PipeInstruction

from ds_recycle.instructions.routed import (
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
from ds_recycle.planner import actions

_INSTRUCTION_OF = {
    actions.LoadMicroBatch: LoadMicroBatch,
    actions.ForwardPass: ForwardPass,
    actions.BackwardInput: BackwardInput,
    actions.BackwardWeight: BackwardWeight,
    actions.SendActivation: SendActivation,
    actions.RecvActivation: RecvActivation,
    actions.SendGrad: SendGrad,
    actions.RecvGrad: RecvGrad,
    actions.StaggeredStep: StaggeredStep,
}


def to_instruction(action: actions.Action) -> PipeInstruction:
    """The engine's instruction for one of the lowering's plain actions."""
    return _INSTRUCTION_OF[type(action)](**action.kwargs)


__all__ = [
    "BackwardInput",
    "BackwardWeight",
    "ForwardPass",
    "LoadMicroBatch",
    "RecvActivation",
    "RecvGrad",
    "SendActivation",
    "SendGrad",
    "StaggeredStep",
    "to_instruction",
]
