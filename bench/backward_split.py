"""Decoupled backprop on one stage: the W path against a fused backward and the generic graph split.

For GPT stages (pre-LN blocks of ds_recycle.models.gpt, a middle stage: its input needs a
gradient) and a host-bound stack (24 x Linear + LayerNorm on tiny tensors), each row gives

- F: the forward (with the W path installed for "path": its hooks cost forward time);
- fused: one ``backward`` of the output (what stock DeepSpeed runs);
- B, W: BackwardInput and BackwardWeight (ds_recycle.engine.backward_split);
- (B+W)/fused: the median over repetitions of the ratio within one repetition (the three modes run
  interleaved, so a repetition's timings share the machine's load);
- held: bytes held between B and W over bytes held after F (ds_recycle.engine.held_memory);
- vs graph: bytes held between B and W over the generic graph split's.

Modes: "path" is the default W path (Linear weight GEMMs deferred), "graph" the generic graph
split, which the path falls back to for modules it does not cover.

Two suites. ``cpu`` (the default on a CPU) is the table above on CPU-sized stages. ``gpu`` (the
default with ``--device cuda``) is issue 41's: GPT-3-family stages (d = 2048, 4096, 5120, head
dimension 128, 2 layers, sequence 2048, micro-batch 1 and 4) and a LLaMA-family stage built by
ds_recycle.integrations.hf_model.causal_lm_pipeline from a local LlamaConfig (hidden 4096, GQA
32/8 heads, SwiGLU 11008, RMSNorm, 2 layers; nothing downloaded), in fp32 and bf16 autocast, with
two more columns and the goals:

- alloc: the CUDA allocator's bytes held between B and W over its bytes after F (one micro-batch,
  gradients allocated beforehand), to check the storage count of "held";
- host: CPU wall time spent issuing F, fused, B and W (until the call returns, before the
  synchronization that ends the op's timing);
- goals, "path" rows: (B+W)/fused <= 1.01 in fp32 and <= 1.05 in bf16, held <= 0.6.

Timings are CUDA-synchronized on a GPU. Each stage prints its rows or one ``FAILED`` line (its
traceback goes to stderr); ``--budget-seconds`` skips the stages that would not finish in time
(estimated from the FLOPs and the rate of the stages already run). ``--suite gpu --tiny`` runs the
gpu suite's code at CPU sizes. The last line is ``host-bound (B+W)/fused: X.XXX`` for the default
path.

    .venv/bin/python bench/backward_split.py [--quick] [--threads 1]
    python3 bench/backward_split.py --device cuda [--budget-seconds 85]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import math
import os
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

# DeepSpeed (only the LLaMA stage imports it) on a GPU machine must use its CUDA accelerator: its
# CPU accelerator compiles a shared-memory op at init_distributed.
os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")

from ds_recycle.engine.backward_split import backward_input, backward_weight  # noqa: E402
from ds_recycle.engine.held_memory import measure_held_bytes  # noqa: E402
from ds_recycle.engine.weight_grad import WeightGradPath, install_weight_grad_path  # noqa: E402
from ds_recycle.models.gpt import Block  # noqa: E402

GOAL_RATIO = {"fp32": 1.01, "bf16": 1.05}
GOAL_HELD = 0.6


@dataclass(frozen=True)
class Stage:
    name: str
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    dtype: torch.dtype | None
    """The autocast dtype, or None for fp32."""
    reps: int
    warmup: int = 3
    flops: float = 0.0
    """Forward matmul FLOPs of one micro-batch (the budget's estimate of the stage's run time)."""


@dataclass
class Row:
    stage: str
    dtype: str
    mode: str
    forward_ms: float
    fused_ms: float
    b_ms: float
    w_ms: float
    ratio: float
    held_ratio: float
    held_mib: float
    vs_graph: float = 1.0
    alloc_ratio: float = math.nan
    """The CUDA allocator's bytes held between B and W over after F (nan off CUDA)."""
    host_ms: tuple[float, float, float, float] = (math.nan,) * 4
    """CPU time issuing F, fused, B, W (median)."""


@dataclass(frozen=True)
class Timing:
    """One repetition of one mode, in seconds: wall (synchronized) and host (issue) times."""

    forward: float
    backward: float
    """Fused backward, or B."""
    weight: float
    """W (0 for the fused mode)."""
    host_forward: float
    host_backward: float
    host_weight: float


def gpt_stage(d: int, layers: int, heads: int | None = None) -> Callable[[], nn.Module]:
    n_heads = heads if heads is not None else max(1, d // 64)
    return lambda: nn.Sequential(*[Block(d, n_heads, 4) for _ in range(layers)])


def host_bound_stage() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(24):
        layers += [nn.Linear(64, 64), nn.LayerNorm(64)]
    return nn.Sequential(*layers)


HOST_BOUND = "host-bound 24x(Linear+LN) d=64"


def gpt_flops(d: int, layers: int, batch: int, seq: int) -> float:
    return layers * (24 * batch * seq * d * d + 4 * batch * seq * seq * d)


class DecoderStage(nn.Module):
    """A middle stage of decoder layers of a causal_lm_pipeline: hidden states in, hidden states
    out, with the all-ones 2-D attention mask that crosses a stage boundary."""

    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(hidden.shape[:2], dtype=torch.long, device=hidden.device)
        for layer in self.layers:
            hidden, mask = layer((hidden, mask))
        return hidden


@dataclass(frozen=True)
class LlamaSizes:
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    intermediate: int = 11008
    layers: int = 2
    vocab: int = 1024
    """Only the decoder layers are timed; a small vocabulary keeps the unused embedding small."""

    def flops(self, batch: int, seq: int) -> float:
        d, kv = self.hidden, self.hidden * self.kv_heads // self.heads
        linear = d * d * 2 + 2 * d * kv + 3 * d * self.intermediate
        return self.layers * (2 * batch * seq * linear + 4 * batch * seq * seq * d)


def ensure_distributed() -> None:
    """A world of one process (gloo): a PipelineModule needs torch.distributed, no collective runs."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    import deepspeed

    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    deepspeed.init_distributed(dist_backend="gloo")


def llama_stage(sizes: LlamaSizes) -> Callable[[], nn.Module]:
    """The stage's builder; it builds once (the fp32 and bf16 rows share the stage: it is only
    read, and each row copies it)."""
    built: list[nn.Module] = []

    def build() -> nn.Module:
        if built:
            return built[0]
        from transformers import LlamaConfig

        from ds_recycle.integrations.hf_model import DecoderLayerPipe, causal_lm_pipeline

        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed prints its layer map: keep stdout to rows
            ensure_distributed()
            config = LlamaConfig(
                vocab_size=sizes.vocab,
                hidden_size=sizes.hidden,
                intermediate_size=sizes.intermediate,
                num_hidden_layers=sizes.layers,
                num_attention_heads=sizes.heads,
                num_key_value_heads=sizes.kv_heads,
                max_position_embeddings=4096,
            )
            pipeline = causal_lm_pipeline(config, num_stages=1)
        layers = [m for m in pipeline.modules() if isinstance(m, DecoderLayerPipe)]
        built.append(DecoderStage(layers))
        return built[0]

    return build


def stages(device: str, quick: bool) -> list[Stage]:
    """The cpu suite, as before issue 41 (bench/backward_split_output.txt is its table on a CPU)."""
    if device == "cuda":
        gpu = [(2048, 4, 1), (4096, 2, 1), (2048, 4, 4)]
        out = [
            Stage(f"gpt d={d} L={n} seq=2048 mb={b}", gpt_stage(d, n), (b, 2048, d), dtype, 10)
            for dtype in (torch.bfloat16, None)
            for d, n, b in (gpu[:1] if quick else gpu)
        ]
    else:
        cpu = [(128, 4, 64, 2, 20), (256, 4, 128, 2, 10), (512, 2, 256, 1, 6)]
        out = [
            Stage(f"gpt d={d} L={n} seq={t} mb={b}", gpt_stage(d, n), (b, t, d), None, 3 if quick else reps)
            for d, n, t, b, reps in (cpu[:2] if quick else cpu)
        ]
        # CPU bf16 matmuls are slow without AMX: one small stage.
        bf16 = Stage("gpt d=128 L=4 seq=64 mb=2", gpt_stage(128, 4), (2, 64, 128), torch.bfloat16, 3 if quick else 5)
        out.append(bf16)
    out.append(Stage(HOST_BOUND, host_bound_stage, (2, 8, 64), None, 60 if quick else 400))
    return out


def gpu_stages(tiny: bool, quick: bool) -> list[Stage]:
    """Issue 41's suite, cheapest first within each dtype so that a budget cuts the largest.
    ``tiny``: the same stages at CPU sizes (to run its code here)."""
    reps, warmup = (2, 1) if tiny else (5, 2)
    seq, layers = (32, 2) if tiny else (2048, 2)
    widths = [(64, 2), (128, 4), (160, 5)] if tiny else [(2048, 16), (4096, 32), (5120, 40)]
    if quick:
        widths = widths[:1]
    llama = LlamaSizes(128, 4, 2, 344, 2, 128) if tiny else LlamaSizes()
    build_llama = llama_stage(llama)
    out = [Stage(HOST_BOUND, host_bound_stage, (2, 8, 64), None, 20 if tiny else 60, warmup)]
    for dtype in (torch.bfloat16, None):
        for batch in (1, 4):
            for d, heads in widths:
                out.append(
                    Stage(
                        f"gpt d={d} h={heads} L={layers} seq={seq} mb={batch}",
                        gpt_stage(d, layers, heads),
                        (batch, seq, d),
                        dtype,
                        reps,
                        warmup,
                        gpt_flops(d, layers, batch, seq),
                    )
                )
            if batch == 1:
                name = (
                    f"llama d={llama.hidden} gqa {llama.heads}/{llama.kv_heads} ff={llama.intermediate} "
                    f"L={llama.layers} seq={seq} mb=1"
                )
                out.append(Stage(name, build_llama, (1, seq, llama.hidden), dtype, reps, warmup, llama.flops(1, seq)))
    return out


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _autocast(device: str, dtype: torch.dtype | None):
    return torch.autocast(device, dtype=dtype or torch.float32, enabled=dtype is not None)


def dtype_label(dtype: torch.dtype | None) -> str:
    return "fp32" if dtype is None else f"{str(dtype).removeprefix('torch.')} autocast"


def allocator_held_ratio(
    module: nn.Module, x0: torch.Tensor, path: WeightGradPath | None, dtype: torch.dtype | None
) -> float:
    """The CUDA allocator's bytes held between B and W over its bytes after F, for one micro-batch
    (parameter gradients allocated beforehand, the input gradient dropped as the engine sends it)."""
    device = x0.device.type
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    x = x0.clone().requires_grad_()
    _sync(device)
    base = torch.cuda.memory_allocated()
    with _autocast(device, dtype):
        out = module(x)
    _sync(device)
    after_forward = torch.cuda.memory_allocated() - base
    grad = torch.randn_like(out)
    input_grads, work = backward_input([out], [grad], [x], params, path=path)
    del out, grad, input_grads
    _sync(device)
    between = torch.cuda.memory_allocated() - base
    backward_weight(work)
    for p in params:
        p.grad = None
    return between / after_forward if after_forward > 0 else math.nan


def bench_stage(stage: Stage, device: str) -> list[Row]:
    torch.manual_seed(0)
    fused = stage.build().to(device)
    graph = copy.deepcopy(fused)
    path_module = copy.deepcopy(fused)
    path = install_weight_grad_path(path_module)
    x0 = torch.randn(stage.input_shape, device=device)
    modules = {"fused": (fused, None), "graph": (graph, None), "path": (path_module, path)}
    times: dict[str, list[Timing]] = {name: [] for name in modules}

    def one(name: str) -> Timing:
        module, p = modules[name]
        params = [q for q in module.parameters() if q.requires_grad]
        for q in params:
            q.grad = None
        x = x0.clone().requires_grad_()
        _sync(device)
        began = time.perf_counter()
        with _autocast(device, stage.dtype):
            out = module(x)
        host_forward = time.perf_counter() - began
        _sync(device)
        forward = time.perf_counter() - began
        grad = torch.ones_like(out)
        _sync(device)
        began = time.perf_counter()
        if name == "fused":
            out.backward(grad)
            host = time.perf_counter() - began
            _sync(device)
            return Timing(forward, time.perf_counter() - began, 0.0, host_forward, host, 0.0)
        _, work = backward_input([out], [grad], [x], params, path=p)
        host_b = time.perf_counter() - began
        _sync(device)
        b_done = time.perf_counter()
        del out
        backward_weight(work)
        host_w = time.perf_counter() - b_done
        _sync(device)
        return Timing(forward, b_done - began, time.perf_counter() - b_done, host_forward, host_b, host_w)

    for name in modules:  # warm-up
        for _ in range(stage.warmup):
            one(name)
    for _ in range(stage.reps):
        for name in modules:
            times[name].append(one(name))

    held = {name: measure_held_bytes(modules[name][0], x0, modules[name][1], stage.dtype) for name in ("graph", "path")}
    alloc = {name: math.nan for name in ("graph", "path")}
    if device == "cuda":
        alloc = {name: allocator_held_ratio(modules[name][0], x0, modules[name][1], stage.dtype) for name in alloc}
    fused_runs = times["fused"]
    fused_bwd = [t.backward for t in fused_runs]
    rows = []
    for name in ("path", "graph"):
        runs = times[name]
        ratios = [(t.backward + t.weight) / f for t, f in zip(runs, fused_bwd, strict=True)]
        rows.append(
            Row(
                stage.name,
                dtype_label(stage.dtype),
                name,
                forward_ms=statistics.median(t.forward for t in runs) * 1e3,
                fused_ms=statistics.median(fused_bwd) * 1e3,
                b_ms=statistics.median(t.backward for t in runs) * 1e3,
                w_ms=statistics.median(t.weight for t in runs) * 1e3,
                ratio=statistics.median(ratios),
                held_ratio=held[name].ratio,
                held_mib=held[name].between_b_and_w / 2**20,
                vs_graph=held[name].between_b_and_w / held["graph"].between_b_and_w,
                alloc_ratio=alloc[name],
                host_ms=(
                    statistics.median(t.host_forward for t in runs) * 1e3,
                    statistics.median(t.host_backward for t in fused_runs) * 1e3,
                    statistics.median(t.host_backward for t in runs) * 1e3,
                    statistics.median(t.host_weight for t in runs) * 1e3,
                ),
            )
        )
    return rows


def goals(row: Row) -> str:
    """The issue's goals for a "path" row, in words."""
    if row.mode != "path" or row.stage == HOST_BOUND:
        return "-"
    limit = GOAL_RATIO["fp32" if row.dtype == "fp32" else "bf16"]
    parts = [
        f"ratio {'ok' if row.ratio <= limit else 'MISS'} (<= {limit})",
        f"held {'ok' if row.held_ratio <= GOAL_HELD else 'MISS'} (<= {GOAL_HELD})",
    ]
    return ", ".join(parts)


def _fmt(value: float, digits: int = 2) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def format_row(row: Row, wide: bool) -> str:
    cells = [row.stage, row.dtype, row.mode, f"{row.forward_ms:.3f}", f"{row.fused_ms:.3f}", f"{row.b_ms:.3f}"]
    cells += [f"{row.w_ms:.3f}", f"{row.ratio:.3f}", f"{row.held_ratio:.2f}", f"{row.held_mib:.2f}"]
    cells.append(f"{row.vs_graph:.2f}")
    if wide:
        cells.append(_fmt(row.alloc_ratio))
        cells.append("/".join(_fmt(v, 3) for v in row.host_ms))
        cells.append(goals(row))
    return "| " + " | ".join(cells) + " |"


class Budget:
    """Skips a stage whose estimated run time (its FLOPs at the rate of the last stage run in its
    dtype: stages come in increasing size, and a smaller one is the slower per FLOP) would end past
    the budget."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.began = time.perf_counter()
        self.rate: dict[str, float] = {}

    def elapsed(self) -> float:
        return time.perf_counter() - self.began

    def estimate(self, stage: Stage) -> float:
        rate = self.rate.get(dtype_label(stage.dtype))
        return 0.0 if rate is None or not stage.flops else rate * stage.flops

    def allows(self, stage: Stage) -> bool:
        return self.seconds is None or self.elapsed() + self.estimate(stage) <= self.seconds

    def ran(self, stage: Stage, seconds: float) -> None:
        if stage.flops:
            key = dtype_label(stage.dtype)
            self.rate[key] = seconds / stage.flops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: steadier timings)")
    parser.add_argument("--quick", action="store_true", help="fewer stages and repetitions")
    parser.add_argument("--suite", choices=["auto", "cpu", "gpu"], default="auto", help="auto: gpu on cuda, else cpu")
    parser.add_argument("--tiny", action="store_true", help="the gpu suite at CPU sizes (to test its code)")
    parser.add_argument("--budget-seconds", type=float, default=None, help="skip stages that would end later")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    suite = args.suite if args.suite != "auto" else ("gpu" if args.device == "cuda" else "cpu")
    wide = suite == "gpu"
    header = f"# device {args.device}, torch {torch.__version__}, {args.threads} CPU thread(s)"
    if args.device == "cuda":
        tf32 = getattr(torch.backends.cuda.matmul, "allow_tf32", None)
        fp32 = {True: "TF32", False: "IEEE fp32"}.get(tf32, "unknown precision")
        header += f", {torch.cuda.get_device_name()}, fp32 matmuls in {fp32}"
    print(header, flush=True)
    columns = ["stage", "dtype", "mode", "F ms", "fused ms", "B ms", "W ms", "(B+W)/fused"]
    columns += ["held B->W / after F", "held MiB", "vs graph"]
    if wide:
        columns += ["alloc B->W / after F", "host F/fused/B/W ms", "goals"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns), flush=True)
    chosen = stages(args.device, args.quick) if suite == "cpu" else gpu_stages(args.tiny, args.quick)
    budget = Budget(args.budget_seconds)
    host_bound: float | None = None
    outcomes = {"ran": 0, "failed": 0, "skipped": 0}
    path_rows: list[Row] = []
    for stage in chosen:
        label = dtype_label(stage.dtype)
        if not budget.allows(stage):
            outcomes["skipped"] += 1
            print(
                f"| {stage.name} | {label} | SKIPPED: budget ({budget.elapsed():.0f} s spent, "
                f"~{budget.estimate(stage):.0f} s more of {budget.seconds:.0f} s) |",
                flush=True,
            )
            continue
        began = time.perf_counter()
        try:
            rows = bench_stage(stage, args.device)
        except Exception as error:  # one stage's failure must not end the run
            outcomes["failed"] += 1
            traceback.print_exc(file=sys.stderr)
            print(f"| {stage.name} | {label} | FAILED: {type(error).__name__}: {str(error)[:200]} |", flush=True)
            rows = []
        else:
            outcomes["ran"] += 1
            budget.ran(stage, time.perf_counter() - began)
        finally:
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
        for row in rows:
            print(format_row(row, wide), flush=True)
            if row.mode == "path":
                path_rows.append(row)
            if stage.name == HOST_BOUND and row.mode == "path":
                host_bound = row.ratio
    if wide:
        measured = [r for r in path_rows if r.stage != HOST_BOUND]
        met_ratio = sum(r.ratio <= GOAL_RATIO["fp32" if r.dtype == "fp32" else "bf16"] for r in measured)
        met_held = sum(r.held_ratio <= GOAL_HELD for r in measured)
        print(
            f"goals over {len(measured)} path rows: (B+W)/fused <= 1.01 fp32 / 1.05 bf16 met by {met_ratio}; "
            f"held <= {GOAL_HELD}x met by {met_held}; stages ran {outcomes['ran']}, failed {outcomes['failed']}, "
            f"skipped {outcomes['skipped']}; {budget.elapsed():.0f} s",
            flush=True,
        )
    if host_bound is None:
        print("host-bound (B+W)/fused: n/a (the host-bound stage did not run)")
    else:
        print(f"host-bound (B+W)/fused: {host_bound:.3f}")
    if outcomes["failed"]:
        raise SystemExit(1)  # every row is printed; the exit status tells that a stage failed


if __name__ == "__main__":
    main()
