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

from collections.abc import Sequence
from dataclasses import dataclass

from ds_recycle.planner.plan import CostModel
from ds_recycle.sim.presets import SEQ_LEN, VOCAB, ModelSpec
from ds_recycle.sim.presets import Hardware as HardwareSpec


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


# ----- costs from a model preset (ds_recycle.sim.presets), for the paper-scale study ------------
#
# Units: the planner's CostModel is in MILLISECONDS (the planner's duration range is [1e-3, 1e6]
# and its validator's tolerance is absolute, so seconds would make 10 us p2p latencies vanish);
# every other figure of the study is in seconds and bytes.


@dataclass(frozen=True)
class StageCosts:
    """One pipeline layout (``stages`` stages, ``pipelines`` DP peers) of a model."""

    costs: CostModel
    """Milliseconds: decoupled F/B/W per stage, p2p latency, and S (DP all-reduce + optimizer)."""
    fused: CostModel
    """Milliseconds: the same with a fused backward (B = fused backward, W = 0): 1F1B systems."""
    memory_cap: int
    """Micro-batches every worker can hold between F and W (the tightest stage); 0: the
    parameters alone do not fit."""
    fused_memory_cap: int
    """The same for a fused backward (a micro-batch holds its activations only until B)."""
    state_bytes: float
    """Parameter + gradient + optimizer bytes per GPU on the largest stage (what a re-join copies)."""
    layers: tuple[int, ...]
    """Decoder layers per stage."""
    stage_state_bytes: tuple[float, ...] = ()
    """Parameter + gradient + optimizer bytes per GPU of each stage (what a worker joining it copies)."""
    layer_state_bytes: float = 0.0
    """The same for one decoder layer (what a worker taking a layer from another stage copies)."""


def split_layers(layers: int, stages: int) -> tuple[int, ...]:
    """As even as possible, the earlier stages taking the remainder (the last has the LM head)."""
    if stages < 1 or layers < stages:
        raise ValueError(f"cannot split {layers} layers over {stages} stages")
    base, extra = divmod(layers, stages)
    return tuple(base + (1 if s < extra else 0) for s in range(stages))


def check_split(layers: Sequence[int], total: int, stages: int) -> tuple[int, ...]:
    """``layers`` as a tuple when it gives each of ``stages`` stages at least one layer and ``total`` in all."""
    split = tuple(int(n) for n in layers)
    if len(split) != stages or sum(split) != total or min(split) < 1:
        raise ValueError(f"layer split {split} must give each of {stages} stages >= 1 layer, {total} in all")
    return split


def head_layer_ratio(model: ModelSpec) -> float:
    """LM head FLOPs per sequence relative to one decoder layer's: ``2 t h V / (24 t h^2 + 4 t^2 h)``."""
    return 2 * VOCAB / (24 * model.hidden + 4 * SEQ_LEN)


def stage_costs(
    model: ModelSpec,
    stages: int,
    pipelines: int,
    hw: HardwareSpec = HardwareSpec(),
    redundancy: float = 1.0,
    embeddings: bool = True,
    layers: Sequence[int] | None = None,
) -> StageCosts:
    """``model`` split over ``stages`` stages with ``pipelines`` data-parallel peers per stage.

    Per stage: decoder layers x the per-layer times of the preset, divided by the TP speed-up
    ``tp * tp_efficiency``; with ``embeddings`` the last stage also runs the LM head (its time is
    the layer time scaled by :func:`head_layer_ratio`; F, B and W each one GEMM of the same size)
    and holds fp32 logits per micro-batch, and the first and last stages hold the (tied) embedding.
    Memory per GPU: ``redundancy`` x parameter state (``state_bytes_per_param`` per parameter;
    Bamboo holds its successor's layers too: 2) plus ``cap`` micro-batches of activations (the
    larger of "after F" and "held between B and W" with a decoupled backward). ``layers`` gives
    the decoder layers of each stage (a re-partitioned grid); None: :func:`split_layers`.
    """
    layers = split_layers(model.layers, stages) if layers is None else check_split(layers, model.layers, stages)
    speed = 1.0 if model.tp == 1 else model.tp * hw.tp_efficiency
    head = head_layer_ratio(model) if embeddings else 0.0
    last = stages - 1

    def per_stage(per_layer_ms: float) -> tuple[float, ...]:
        return tuple((n + (head if s == last else 0.0)) * per_layer_ms / speed for s, n in enumerate(layers))

    F, B, W = per_stage(model.F_ms), per_stage(model.B_ms), per_stage(model.W_ms)
    fused_bwd = tuple(
        (n * model.fused_ms + (2 * head * model.F_ms if s == last else 0.0)) / speed for s, n in enumerate(layers)
    )
    activation_bytes = 2 * SEQ_LEN * model.hidden / model.tp  # bf16 activations of one micro-batch
    comm_ms = 1e3 * (activation_bytes / hw.network_bandwidth + hw.network_latency)
    embedding = VOCAB * model.hidden if embeddings else 0.0
    params = [n * model.params_per_layer + (embedding if s in (0, last) else 0.0) for s, n in enumerate(layers)]
    params_gpu = [p / model.tp for p in params]
    grads = 4 * max(params_gpu)  # fp32 gradients (fp32 master weights, bf16 autocast)
    allreduce = 2 * (pipelines - 1) / pipelines * grads / hw.network_bandwidth if pipelines > 1 else 0.0
    step_ms = 1e3 * (allreduce + max(params_gpu) * hw.state_bytes_per_param / hw.hbm_bandwidth)
    logits = 4 * SEQ_LEN * VOCAB / model.tp if embeddings else 0.0
    usable = hw.gpu_memory * hw.usable_memory
    caps, fused_caps = [], []
    for s, n in enumerate(layers):
        free = usable - redundancy * params_gpu[s] * hw.state_bytes_per_param
        extra = logits if s == last else 0.0
        decoupled_mb = n * max(model.act_mib, model.held_mib) * 2**20 / model.tp + extra
        fused_mb = n * model.act_mib * 2**20 / model.tp + extra
        caps.append(max(0, int(free // decoupled_mb)) if free > 0 else 0)
        fused_caps.append(max(0, int(free // fused_mb)) if free > 0 else 0)
    return StageCosts(
        costs=CostModel(F, B, W, comm=comm_ms, step=step_ms),
        fused=CostModel(F, fused_bwd, (0.0,) * stages, comm=comm_ms, step=step_ms),
        memory_cap=min(caps),
        fused_memory_cap=min(fused_caps),
        state_bytes=max(params_gpu) * hw.state_bytes_per_param,
        layers=layers,
        stage_state_bytes=tuple(p * hw.state_bytes_per_param for p in params_gpu),
        layer_state_bytes=model.params_per_layer / model.tp * hw.state_bytes_per_param,
    )
