"""Model and hardware descriptions for the paper-scale simulator (sources in docs/simulator.md).

Per-layer times and memory are per GPT-3-family decoder layer, bf16 autocast, sequence 2048,
micro-batch 1 sequence, tensor-parallel degree 1, measured on one H100 (docs/simulator.md, Sources).
350M and 2.7B were not measured: they are scaled from the 1.3B layer by matmul FLOPs (times)
and by hidden size (memory), which makes the small layers optimistic (kernels are less
efficient at small sizes). What a micro-batch holds between B and W is not from that probe
(which saved fp32 copies of the Linear inputs): it is the W path's measured bytes,
:func:`w_path_held_mib`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path

SEQ_LEN = 2048


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int
    hidden: int
    params_per_layer: float
    """Parameters of one decoder layer (12 h^2 + 13 h)."""
    F_ms: float
    """Per layer, tensor-parallel degree 1: forward."""
    B_ms: float
    """BackwardInput (decoupled)."""
    W_ms: float
    """BackwardWeight (decoupled)."""
    fused_ms: float
    """Fused backward (what 1F1B systems run)."""
    act_mib: float
    """Activations one micro-batch holds between F and B."""
    held_mib: float
    """What one micro-batch holds between B and W when W is deferred (presets: :func:`w_path_held_mib`)."""
    tp: int = 1
    """Tensor-parallel degree: one pipeline worker is a group of ``tp`` GPUs."""
    source: str = "measured"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"model name {self.name!r} must be a non-empty string")
        if not isinstance(self.source, str):
            raise ValueError(f"model {self.name}: source {self.source!r} must be a string")
        for name in ("layers", "hidden", "tp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1_000_000:
                raise ValueError(f"model {self.name}: {name} = {value!r} must be an integer in 1..1000000")
        for name in ("params_per_layer", "F_ms", "B_ms", "W_ms", "fused_ms", "act_mib", "held_mib"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1e15:
                raise ValueError(f"model {self.name}: {name} = {value!r} must be a finite number in (0, 1e15]")

    @property
    def params(self) -> float:
        """Decoder-layer parameters (embeddings are counted separately by the cost model)."""
        return self.layers * self.params_per_layer


@dataclass(frozen=True)
class Hardware:
    gpu_memory: float = 80 * 2**30
    """Bytes of one GPU (H100 SXM 80 GB)."""
    usable_memory: float = 0.9
    """Fraction left after the framework, NCCL buffers and fragmentation."""
    network_bandwidth: float = 50e9
    """Bytes/s per GPU between nodes (one 400 Gb/s NIC per GPU)."""
    network_latency: float = 10e-6
    """Seconds per p2p message on top of its bytes."""
    hbm_bandwidth: float = 2e12
    """Bytes/s the optimizer streams over its state."""
    tp_efficiency: float = 0.9
    """Per-layer speed-up of a TP group is ``tp * tp_efficiency``."""
    state_bytes_per_param: float = 16.0
    """fp32 weights + fp32 grads + Adam m and v; no ZeRO (DP peers are the redundancy)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1e18:
                raise ValueError(f"hardware: {f.name} = {value!r} must be a finite number > 0")
        if self.usable_memory > 1 or self.tp_efficiency > 1:
            raise ValueError("hardware: usable_memory and tp_efficiency must be in (0, 1]")


W_PATH_HELD_BYTES = 32.0
"""Bytes the W path (engine/weight_grad.py) holds between B and W per token and hidden unit of a
decoder layer under bf16 autocast: the inputs of the four Linears (h + h + h + 4h) and their output
gradients (3h + h + 4h + h), 16 bf16 elements. Measured by engine/held_memory.py in
bench/backward_split_output.txt, "path" rows: bf16, 2.00 MiB over 4 layers x 64 tokens x 2 x 128 =
32 B; fp32, 64 B (16 x 4) at all three shapes. That is 0.80 of the H100 layer's ``act_mib``; the
bench's ratio to bytes after F (0.50 in bf16) is not used, since its "after F" is a CPU stage of
64 tokens with unfused attention and grows with the sequence (0.40 at 512 tokens)."""


def w_path_held_mib(hidden: int) -> float:
    """MiB one micro-batch (one sequence of ``SEQ_LEN``) holds between B and W per decoder layer,
    tensor-parallel degree 1."""
    return W_PATH_HELD_BYTES * SEQ_LEN * hidden / 2**20


VOCAB = 50257
"""GPT-2/GPT-3 BPE vocabulary: the LM head on the last stage, the embedding on the first."""


def _layer_params(h: int) -> float:
    return 12 * h * h + 13 * h


def _layer_flops(h: int) -> float:
    return 24 * SEQ_LEN * h * h + 4 * SEQ_LEN * SEQ_LEN * h


def _scaled(name: str, layers: int, hidden: int, ref: ModelSpec) -> ModelSpec:
    t = _layer_flops(hidden) / _layer_flops(ref.hidden)
    mem = hidden / ref.hidden
    return ModelSpec(
        name,
        layers,
        hidden,
        _layer_params(hidden),
        ref.F_ms * t,
        ref.B_ms * t,
        ref.W_ms * t,
        ref.fused_ms * t,
        ref.act_mib * mem,
        w_path_held_mib(hidden),
        source=f"scaled from {ref.name} by FLOPs",
    )


def _measured(
    name: str,
    layers: int,
    hidden: int,
    params_per_layer: float,
    times_ms: tuple[float, float, float, float],
    act_mib: float,
    tp: int = 1,
) -> ModelSpec:
    """``times_ms``: F, B, W, fused backward of one layer on the H100."""
    return ModelSpec(name, layers, hidden, params_per_layer, *times_ms, act_mib, w_path_held_mib(hidden), tp=tp)


_GPT3_1_3B = _measured("1.3B", 24, 2048, 50.4e6, (0.750, 1.090, 0.538, 1.393), 160)

PRESETS: dict[str, ModelSpec] = {
    "350M": _scaled("350M", 24, 1024, _GPT3_1_3B),
    "1.3B": _GPT3_1_3B,
    "2.7B": _scaled("2.7B", 32, 2560, _GPT3_1_3B),
    "6.7B": _measured("6.7B", 32, 4096, 201.4e6, (1.858, 2.575, 1.849, 3.960), 320),
    "13B": _measured("13B", 40, 5120, 314.6e6, (2.811, 3.681, 2.884, 5.789), 400),
    "39B": _measured("39B", 48, 8192, 805.4e6, (6.560, 7.975, 7.235, 13.349), 641, tp=4),
    "175B": _measured("175B", 96, 12288, 1812.1e6, (14.380, 16.242, 16.253, 28.444), 961, tp=8),
}


def get_model(name: str, tp: int | None = None) -> ModelSpec:
    """A preset by name (``PRESETS``) or a JSON file with ModelSpec's fields. ValueError names
    the problem."""
    if name in PRESETS:
        spec = PRESETS[name]
    elif name.endswith(".json"):
        spec = _load(Path(name))
    else:
        raise ValueError(f"unknown model {name!r}: allowed {', '.join(PRESETS)} or a .json file with ModelSpec fields")
    return spec if tp is None else replace(spec, tp=tp)


def _load(path: Path) -> ModelSpec:
    names = {f.name for f in fields(ModelSpec)}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read model file {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"model file {path} is not JSON ({exc}): expected an object with the keys {sorted(names)}"
        ) from None
    if not isinstance(data, dict) or set(data) - names:
        raise ValueError(f"model file {path}: expected an object with the keys {sorted(names)}")
    data.setdefault("name", path.stem)
    data.setdefault("source", str(path))
    try:
        return ModelSpec(**data)
    except TypeError as exc:
        raise ValueError(f"model file {path}: {exc}") from None


@dataclass(frozen=True)
class RecoveryCosts:
    """ReCycle's pause per failure: detection (to every survivor stopped) and the rebuild of its
    communication groups, also paid by a re-join and a migration (``sim/recycle.py``)."""

    name: str
    detect_s: float
    rebuild_s: float
    source: str


RECYCLE_COSTS: dict[str, RecoveryCosts] = {
    "measured": RecoveryCosts(
        "measured",
        1.0,
        3.0,
        "detection: the heartbeat's hang detection on CPU, median 1.03 s in the fault campaign's latest run and "
        "0.96-2.00 s over all its runs (bench/fault_campaign_output.txt; timeout max(1 s, 3 x slowest iteration)); "
        "a crash is seen in 25-58 ms, so 1 s covers both. Rebuild: on one H200 with NCCL the survivors' waits end "
        "within 1 ms of the failure flag and ncclCommAbort (0.5-3.1 s) runs in the background "
        "(bench/gpu_check_output.txt), so the rebuild is new NCCL communicators for the touched groups, not "
        "measured: 3 s [A]. On CPU the whole recovery, detection included, takes a median 0.07-0.55 s.",
    ),
    "paper": RecoveryCosts("paper", 5.0, 10.0, "ReCycle's defaults in this simulator: 5 s detection, 10 s rebuild [A]"),
}
"""ReCycle's recovery costs: ``measured`` (what this project measured, the ETTR study's default) or
``paper`` (the simulator's original assumptions, ``RecycleParams``' defaults)."""
