"""Per-stage cost models derived from a GPT-like transformer's sizes.

FLOPs per micro-batch of ``b`` sequences of length ``t`` with hidden size ``h`` (Megatron's
accounting, matmuls only):

- one transformer layer, forward: ``24 b t h^2 + 4 b t^2 h``;
- its BackwardInput (grads of the layer input): the same as the forward;
- its BackwardWeight (grads of the weights): ``24 b t h^2`` (no attention-score matmuls);
- the LM head on the last stage: ``2 b t h V`` forward, the same for each backward half.

Layers are split as evenly as possible, the earlier stages taking the remainder. p2p latency is
the activation ``b t h`` elements over the link bandwidth plus a fixed latency; S is a ring
all-reduce of the stage's parameters over its ``D`` data-parallel peers plus an optimizer pass.
"""

from __future__ import annotations

from dataclasses import dataclass

from ds_recycle.planner.plan import CostModel


@dataclass(frozen=True)
class TransformerSpec:
    layers: int
    hidden: int
    seq_len: int
    micro_batch: int = 1
    vocab: int = 50257
    bytes_per_value: int = 2


@dataclass(frozen=True)
class Hardware:
    flops: float = 100e12
    """Sustained FLOP/s of one worker."""
    link_bandwidth: float = 25e9
    """Bytes per second between two workers."""
    link_latency: float = 10e-6
    optimizer_bytes_per_second: float = 200e9
    """How fast the optimizer streams over the parameters (Adam reads and writes ~16 B/param)."""


def transformer_costs(spec: TransformerSpec, stages: int, pipelines: int = 1, hw: Hardware = Hardware()) -> CostModel:
    """A CostModel in seconds for ``spec`` split over ``stages`` pipeline stages."""
    if stages < 1 or spec.layers < stages:
        raise ValueError(f"cannot split {spec.layers} layers over {stages} stages")
    b, t, h = spec.micro_batch, spec.seq_len, spec.hidden
    base, extra = divmod(spec.layers, stages)
    layers = [base + (1 if s < extra else 0) for s in range(stages)]
    layer_f = 24 * b * t * h * h + 4 * b * t * t * h
    layer_w = 24 * b * t * h * h
    head = 2 * b * t * h * spec.vocab
    F, B, W = [], [], []
    for s, n in enumerate(layers):
        f = n * layer_f + (head if s == stages - 1 else 0)
        w = n * layer_w + (head if s == stages - 1 else 0)
        F.append(f / hw.flops)
        B.append(f / hw.flops)
        W.append(w / hw.flops)
    comm = b * t * h * spec.bytes_per_value / hw.link_bandwidth + hw.link_latency
    params = max(n * 12 * h * h for n in layers) + spec.vocab * h
    allreduce = (
        2 * (pipelines - 1) / pipelines * params * spec.bytes_per_value / hw.link_bandwidth if pipelines > 1 else 0.0
    )
    step = allreduce + params * 16 / hw.optimizer_bytes_per_second
    return CostModel(tuple(F), tuple(B), tuple(W), comm=comm, step=step)
