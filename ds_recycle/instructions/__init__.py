"""ReCycle's pipeline instructions.

Each is a subclass of DeepSpeed's ``PipeInstruction`` family. The routed ones name the
micro-batch they concern (``home`` pipeline and ``mb`` index) and, for transfers, the peer
worker ``(pipeline, stage)``, which can be in another pipeline after a failure. The engine runs
them through its own instruction map; DeepSpeed's map is left untouched.
"""

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
]
