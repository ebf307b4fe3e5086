"""What the engine measures on a GPU, against what the GPU says (issue 41).

One process, a world of one (NCCL on CUDA, gloo on CPU): a GPT stage (ds_recycle.models.gpt,
the whole model as one pipeline stage: embedding, 4 blocks of d = 2048 with head dimension 128,
sequence 2048, micro-batch 1, a 1024-token vocabulary so that the blocks dominate) trained by
ReCycle's engine under bf16 autocast, then by stock DeepSpeed under its ``bf16`` section, both
with a client ``torch.optim.AdamW`` (no DeepSpeed op is built). Every F, B, W (and stock's fused
backward) is timed on the host and with CUDA events, and the allocator is read around it.

(a) The engine's cost profiler (its median F, B, W, step, which it times on the host without a
    synchronization) against CUDA events of the same instructions; the plan's predicted
    iteration against the measured one; the memory governor's bytes per micro-batch, static bytes,
    limit and cap against the CUDA allocator (``memory_allocated`` around the micro-batch's F and
    B, ``max_memory_allocated`` over an iteration, ``mem_get_info``).
(b) Plans for the 1.3B model (24 layers, d = 2048) on P = 4 x D = 4, m = 8, fault-free and with
    worker (0, 1) failed (ds_recycle.planner: fault_free_plan, plan_heuristic), from three per-layer
    costs: the simulator's preset (an H100), the CUDA events and the profiler's host times; each
    with its predicted iteration times and the failure's slowdown.
(c) bf16: ReCycle (autocast, fp32 weights, F + B + W) against stock DeepSpeed's ``bf16`` (bf16
    weights, fp32 master weights in its BF16_Optimizer, F + fused backward): time per micro-batch,
    iteration time, memory (peak and at rest), and what ZeRO-1 sharding of the optimizer state
    over D = 8 would save each (ReCycle keeps each replica's state whole, so it does not shard).

Without a GPU it runs on the CPU at tiny sizes (``--smoke``), so that every line can be tested;
there the GPU figures read "n/a". Each measurement prints one line, or one ``FAILED`` line (its
traceback on stderr); the last line is the summary.

    python3 bench/gpu_costs.py [--device cuda] [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import logging
import math
import os
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if "--device" in sys.argv[:-1]:
    DEVICE = sys.argv[sys.argv.index("--device") + 1]
# DeepSpeed reads its accelerator once, at import; its CPU accelerator would compile an op at
# init_distributed on a machine meant for CUDA only.
os.environ["DS_ACCELERATOR"] = DEVICE

from ds_recycle.data import TokenWindowProvider, pipeline_iterator  # noqa: E402
from ds_recycle.engine.memory_cap import executed_peak, static_bytes  # noqa: E402
from ds_recycle.engine.timing import InstructionEvent  # noqa: E402
from ds_recycle.models.gpt import GPTConfig, build_gpt_pipeline  # noqa: E402
from ds_recycle.planner.fault_free import fault_free_plan  # noqa: E402
from ds_recycle.planner.heuristic import plan_heuristic  # noqa: E402
from ds_recycle.sim.cost_model import stage_costs  # noqa: E402
from ds_recycle.sim.presets import Hardware, get_model  # noqa: E402
from ds_recycle.testing.tiny import ds_config  # noqa: E402

MIB, GIB = 2**20, 2**30
CLIP = 1.0
ZERO_D = 8
PLAN_P, PLAN_D, PLAN_M = 4, 4, 8
PLAN_FAILED = (0, 1)
PRESET = "1.3B"


@dataclass(frozen=True)
class Sizes:
    d_model: int
    n_heads: int
    n_layers: int
    seq_len: int
    micro_batch: int
    micro_batches: int
    vocab: int
    iterations: int
    """Iterations each engine trains; the last ``measured`` are measured."""
    measured: int

    def describe(self) -> str:
        return (
            f"GPT d={self.d_model} heads={self.n_heads} L={self.n_layers} seq={self.seq_len} "
            f"mb={self.micro_batch} m={self.micro_batches} vocab={self.vocab}"
        )


CUDA_SIZES = Sizes(2048, 16, 4, 2048, 1, 4, 1024, iterations=8, measured=4)
SMOKE_SIZES = Sizes(64, 4, 2, 32, 2, 4, 128, iterations=7, measured=3)


@dataclass
class OpRecord:
    """One instruction: its label, micro-batch, host time, device time and the allocator around it."""

    label: str
    key: object
    host_ms: float
    device_ms: float = math.nan
    alloc_before: int = 0
    alloc_after: int = 0
    _events: tuple[Any, Any] | None = None


class OpClock:
    """Wraps an engine's instruction handlers (its own instruction map, per instance) so that each
    one is timed on the host and, on CUDA, with events on the current stream."""

    def __init__(self, engine: Any, labels: dict[type, str], cuda: bool) -> None:
        self.cuda = cuda
        self.records: list[OpRecord] = []
        table = dict(type(engine)._INSTRUCTION_MAP)
        for action, label in labels.items():
            if action in table:
                table[action] = self._timed(table[action], label)
        engine._INSTRUCTION_MAP = table

    def _timed(self, handler: Callable, label: str) -> Callable:
        clock = self

        def run(engine: Any, **kwargs: Any) -> None:
            before = torch.cuda.memory_allocated() if clock.cuda else 0
            events = None
            if clock.cuda:
                events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                events[0].record()
            began = time.perf_counter()
            handler(engine, **kwargs)
            host = (time.perf_counter() - began) * 1e3
            if events is not None:
                events[1].record()
            after = torch.cuda.memory_allocated() if clock.cuda else 0
            key = (kwargs.get("home"), kwargs.get("mb", kwargs.get("buffer_id")))
            clock.records.append(OpRecord(label, key, host, math.nan, before, after, events))

        return run

    def settle(self) -> None:
        """Wait for the device and read the events of every record so far."""
        if self.cuda:
            torch.cuda.synchronize()
        for record in self.records:
            if record._events is not None:
                record.device_ms = record._events[0].elapsed_time(record._events[1])
                record._events = None


@dataclass
class EngineRun:
    name: str
    optimizer: str
    params: int
    iteration_ms: list[float]
    device_ms: dict[str, list[float]]
    """Per label, the measured iterations' device times (host times on CPU)."""
    host_ms: dict[str, list[float]]
    peak_bytes: int | None
    """max_memory_allocated over the measured iterations (None off CUDA)."""
    rest_bytes: int | None
    """memory_allocated between iterations."""
    last_iteration: list[OpRecord]
    engine_events: list[InstructionEvent]
    extra: dict[str, Any] = field(default_factory=dict)

    def median(self, label: str, host: bool = False) -> float:
        values = (self.host_ms if host else self.device_ms).get(label, [])
        return statistics.median(values) if values else math.nan

    @property
    def per_microbatch_ms(self) -> float:
        labels = ("F", "B", "W") if "B" in self.device_ms else ("F", "BW")
        return sum(self.median(label) for label in labels)


class Report:
    """One line per measurement; FAILED lines for those that raised."""

    def __init__(self) -> None:
        self.lines = 0
        self.failed: list[str] = []

    def line(self, part: str, text: str) -> None:
        self.lines += 1
        print(f"{part} {text}", flush=True)

    @contextlib.contextmanager
    def measuring(self, part: str, what: str) -> Iterator[None]:
        try:
            yield
        except Exception as error:  # one measurement's failure must not end the run
            traceback.print_exc(file=sys.stderr)
            self.failed.append(f"{part} {what}")
            print(f"{part} {what}: FAILED: {type(error).__name__}: {str(error)[:300]}", flush=True)


def _fmt_ms(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.3f} ms"


def _ratio(a: float, b: float) -> str:
    return "n/a" if math.isnan(a) or math.isnan(b) or b == 0 else f"{a / b:.3f}"


def _gib(value: float | None) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value / GIB:.3f} GiB"


def _mib(value: float | None) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value / MIB:.1f} MiB"


# ---- the world and the engines ----------------------------------------------------------------


def start_world(device: str) -> str:
    """torch.distributed over one process: NCCL on CUDA, gloo on CPU."""
    import ds_recycle

    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(0)
    ds_recycle.init_distributed(dist_backend=backend)
    return backend


def quiet_loggers() -> None:
    """DeepSpeed's and ReCycle's log lines go to stderr, and only from WARNING: their INFO lines
    (config dumps, plans) would bury the measurements on stdout."""
    from deepspeed.utils import logger as deepspeed_logger

    from ds_recycle.log import logger as recycle_logger

    for logger in (deepspeed_logger, recycle_logger):
        logger.setLevel(logging.WARNING)
        for handler in logger.handlers:
            if isinstance(handler, logging.StreamHandler):
                handler.setStream(sys.stderr)


def build_engine(kind: str, sizes: Sizes, device: str) -> tuple[Any, TokenWindowProvider]:
    """``recycle``: ReCycle's engine under torch autocast (bf16); ``stock``: DeepSpeed's engine with
    ``bf16.enabled``. Both with a client AdamW and the same seed, data and micro-batching."""
    import deepspeed

    import ds_recycle

    cfg = GPTConfig(sizes.vocab, sizes.seq_len, sizes.d_model, sizes.n_heads, sizes.n_layers)
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed prints its layer map
        model = build_gpt_pipeline(cfg, num_stages=1, seed=0)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)
    tokens = torch.randint(0, sizes.vocab, (max(4 * sizes.seq_len, 4096),), generator=torch.Generator().manual_seed(0))
    provider = TokenWindowProvider(tokens, sizes.seq_len, sizes.micro_batch, seed=0)
    if kind == "recycle":
        recycle: dict[str, Any] = {"enabled": True, "profile": {"warmup": 2, "window": 4}}
        if device != "cuda":
            recycle["memory_limit_gb"] = 64  # the governor runs on a CPU only under a limit
        config = ds_config(sizes.micro_batches, CLIP, recycle, micro_batch_size=sizes.micro_batch)
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
        with contextlib.redirect_stdout(sys.stderr):
            engine = ds_recycle.initialize(model=model, optimizer=optimizer, config=config, training_data=provider)[0]
    else:
        config = ds_config(sizes.micro_batches, CLIP, None, micro_batch_size=sizes.micro_batch)
        config["bf16"] = {"enabled": True}
        with contextlib.redirect_stdout(sys.stderr):
            engine = deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]
    return engine, provider


def run_engine(kind: str, sizes: Sizes, device: str) -> EngineRun:
    from deepspeed.runtime.pipe import schedule as stock_schedule

    from ds_recycle.planner import actions

    cuda = device == "cuda"
    engine, provider = build_engine(kind, sizes, device)
    if kind == "recycle":
        labels = {
            actions.ForwardPass: "F",
            actions.BackwardInput: "B",
            actions.BackwardWeight: "W",
            actions.StaggeredStep: "S",
        }
        data = None
    else:
        labels = {stock_schedule.ForwardPass: "F", stock_schedule.BackwardPass: "BW", stock_schedule.OptimizerStep: "S"}
        data = pipeline_iterator(provider, 0, sizes.micro_batches)
    clock = OpClock(engine, labels, cuda)
    iteration_ms: list[float] = []
    device_ms: dict[str, list[float]] = {}
    host_ms: dict[str, list[float]] = {}
    first_measured = sizes.iterations - sizes.measured
    rest = None
    last: list[OpRecord] = []
    for i in range(sizes.iterations):
        if i == first_measured and cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        clock.records = []
        if cuda:
            torch.cuda.synchronize()
        began = time.perf_counter()
        with contextlib.redirect_stdout(sys.stderr):
            engine.train_batch(data)
        clock.settle()
        elapsed = (time.perf_counter() - began) * 1e3
        if i >= first_measured:
            iteration_ms.append(elapsed)
            for record in clock.records:
                device_ms.setdefault(record.label, []).append(record.device_ms if cuda else record.host_ms)
                host_ms.setdefault(record.label, []).append(record.host_ms)
        last = clock.records
    if cuda:
        torch.cuda.synchronize()
        rest = torch.cuda.memory_allocated()
    run = EngineRun(
        kind,
        type(engine.optimizer).__name__,
        sum(p.numel() for p in engine.module.parameters()),
        iteration_ms,
        device_ms,
        host_ms,
        torch.cuda.max_memory_allocated() if cuda else None,
        rest,
        last,
        list(getattr(engine, "instruction_events", [])),
    )
    if kind == "recycle":
        run.extra = recycle_figures(engine)
    else:
        run.extra = {"optimizer_state_bytes": optimizer_state_bytes(engine.optimizer)}
    del engine
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return run


def recycle_figures(engine: Any) -> dict[str, Any]:
    """What the cost profiler and the memory governor hold after the run."""
    costs = engine.costs
    governor = engine.memory
    budget = governor.budget
    stage = budget.stages[0] if budget is not None else None
    meter = governor.meter
    return {
        "profiler_row": costs.times.row(),
        "in_use": costs.in_use,
        "measured": costs.tracker.measured,
        "plan_ms": engine.plan.iteration_time,
        "plan_cap": engine.plan.memory_cap,
        "stage_memory": stage,
        "meter_first": None if meter is None else meter.first,
        "counted_static": static_bytes(engine.module, engine.optimizer, torch.device("cpu")),
        "optimizer_state_bytes": optimizer_state_bytes(engine.optimizer),
        "limit_bytes": governor.limit,
    }


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of the tensors in the optimizer's state (and a BF16_Optimizer's fp32 master copies)."""
    seen: dict[int, int] = {}

    def add(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        elif isinstance(value, dict):
            for v in value.values():
                add(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                add(v)

    inner = getattr(optimizer, "optimizer", optimizer)
    add(list(getattr(inner, "state", {}).values()))
    add(getattr(optimizer, "fp32_groups_flat_partition", []))
    return sum(seen.values())


# ---- (a) profiler and governor against the GPU ---------------------------------------------------


def part_a(report: Report, run: EngineRun, sizes: Sizes, cuda: bool) -> None:
    extra = run.extra
    row = extra["profiler_row"]
    for index, label in enumerate(("F", "B", "W", "S")):
        with report.measuring("(a)", f"{label} time"):
            profiled = row[index]
            events = run.median(label)
            host = run.median(label, host=True)
            source = "CUDA events" if cuda else "host (no GPU)"
            report.line(
                "(a)",
                f"{label}: cost profiler {profiled:.3f} ms (host, its window's median) vs {source} "
                f"{_fmt_ms(events)} -> profiler/events {_ratio(profiled, events)}; host issue time {_fmt_ms(host)}",
            )
    with report.measuring("(a)", "costs in use"):
        costs = extra["in_use"]
        report.line(
            "(a)",
            f"planner's costs in use ({'measured' if extra['measured'] else 'not measured: unit costs'}): "
            f"F {list(costs.F)} B {list(costs.B)} W {list(costs.W)} step {costs.step} ms",
        )
    with report.measuring("(a)", "iteration"):
        measured = statistics.median(run.iteration_ms)
        report.line(
            "(a)",
            f"iteration: plan predicts {extra['plan_ms']:.3f} ms, measured {measured:.3f} ms (wall, synchronized) "
            f"-> predicted/measured {_ratio(extra['plan_ms'], measured)}",
        )
    stage = extra["stage_memory"]
    with report.measuring("(a)", "memory per micro-batch"):
        if stage is None:
            raise RuntimeError("the memory governor has no budget (it did not measure)")
        counted = extra["meter_first"]
        after_f, between = allocator_per_microbatch(run.last_iteration)
        allocator = max(after_f, between) if cuda else math.nan
        report.line(
            "(a)",
            f"memory per micro-batch: governor {_mib(stage.per_microbatch)} (counted after F {_mib(counted[0])}, "
            f"B->W {_mib(counted[1])}) vs CUDA allocator {_mib(allocator)} (after F {_mib(after_f)}, "
            f"B->W {_mib(between)}) -> governor/allocator {_ratio(stage.per_microbatch, allocator)}",
        )
    with report.measuring("(a)", "static memory"):
        if stage is None:
            raise RuntimeError("the memory governor has no budget (it did not measure)")
        report.line(
            "(a)",
            f"static memory: governor {_gib(stage.static)} (its count of parameters, gradients, optimizer state "
            f"{_gib(extra['counted_static'])}) vs CUDA allocated at an iteration boundary {_gib(run.rest_bytes)} "
            f"-> governor/allocated {_ratio(stage.static, run.rest_bytes or math.nan)}",
        )
    with report.measuring("(a)", "limit and cap"):
        if stage is None:
            raise RuntimeError("the memory governor has no budget (it did not measure)")
        total = torch.cuda.mem_get_info()[1] if cuda else math.nan
        source = "recycle.memory_limit_gb" if extra["limit_bytes"] is not None else "free + reserved on the device"
        report.line(
            "(a)",
            f"limit: governor {_gib(stage.limit)} ({source}) vs device total {_gib(total)} -> limit/total "
            f"{_ratio(stage.limit, total)}; cap {stage.cap} micro-batches in flight, plan cap {extra['plan_cap']}",
        )
    with report.measuring("(a)", "peak memory"):
        if stage is None:
            raise RuntimeError("the memory governor has no budget (it did not measure)")
        in_flight = executed_peak(run.engine_events)
        predicted = stage.static + in_flight * stage.per_microbatch
        report.line(
            "(a)",
            f"peak memory: governor predicts static + {in_flight} in flight x per micro-batch = {_gib(predicted)} "
            f"vs max_memory_allocated {_gib(run.peak_bytes)} over {sizes.measured} iterations (optimizer step "
            f"temporaries included) -> measured/predicted {_ratio(run.peak_bytes or math.nan, predicted)}",
        )


def allocator_per_microbatch(records: list[OpRecord]) -> tuple[float, float]:
    """The CUDA allocator's bytes held by the last micro-batch of an iteration after its F, and
    between its B and W (its parameter gradients exist by then), from the bytes before its F."""
    forwards = [r for r in records if r.label == "F"]
    if not forwards or not any(r.alloc_before for r in records):
        return math.nan, math.nan
    forward = forwards[-1]
    after_f = float(forward.alloc_after - forward.alloc_before)
    later = records[records.index(forward) + 1 :]
    backward = next((r for r in later if r.label in ("B", "BW") and r.key == forward.key), None)
    between = float(backward.alloc_after - forward.alloc_before) if backward is not None else math.nan
    return after_f, between


# ---- (b) plans from measured costs against the preset's ----------------------------------------------


def part_b(report: Report, run: EngineRun, sizes: Sizes, cuda: bool) -> None:
    """The decoupled plans use F, B and W only; "fused" (B + W when measured) is for the record."""
    preset = get_model(PRESET)
    layers = sizes.n_layers
    sources = {f"preset {PRESET} (H100)": (preset.F_ms, preset.B_ms, preset.W_ms, preset.fused_ms)}
    events = tuple(run.median(k) / layers for k in ("F", "B", "W"))
    sources["CUDA events" if cuda else "host times (no GPU)"] = (*events, events[1] + events[2])
    profiled = tuple(v / layers for v in run.extra["profiler_row"][:3])
    sources["cost profiler (host)"] = (*profiled, profiled[1] + profiled[2])
    report.line(
        "(b)",
        f"per layer of the {sizes.describe()} stage (stage / {layers} layers, embedding and head included): "
        + "; ".join(
            f"{name} F {v[0]:.3f} B {v[1]:.3f} W {v[2]:.3f} fused {v[3]:.3f} ms" for name, v in sources.items()
        ),
    )
    baseline: float | None = None
    for name, (f, b, w, fused_ms) in sources.items():
        with report.measuring("(b)", f"plans from {name}"):
            spec = dataclasses.replace(preset, F_ms=f, B_ms=b, W_ms=w, fused_ms=fused_ms, source=name)
            layout = stage_costs(spec, PLAN_P, PLAN_D)
            cap = layout.memory_cap
            if cap < 1:
                raise RuntimeError(f"{PRESET} does not fit in the preset's GPU memory at P={PLAN_P}")
            cap = None if cap >= PLAN_P else cap
            ff = fault_free_plan(PLAN_D, PLAN_P, PLAN_M, costs=layout.costs, memory_cap=cap)
            failed = plan_heuristic(PLAN_D, PLAN_P, PLAN_M, failed=[PLAN_FAILED], costs=layout.costs, memory_cap=cap)
            baseline = ff.iteration_time if baseline is None else baseline
            report.line(
                "(b)",
                f"plans from {name} for {PRESET} P={PLAN_P} D={PLAN_D} m={PLAN_M}: "
                f"fault-free {ff.iteration_time:.2f} ms "
                f"({ff.iteration_time / baseline:.3f}x the preset's), worker {PLAN_FAILED} failed "
                f"{failed.iteration_time:.2f} ms = {failed.iteration_time / ff.iteration_time:.3f}x fault-free",
            )


# ---- (c) bf16: ours against stock DeepSpeed -----------------------------------------------------------


def part_c(report: Report, ours: EngineRun, stock: EngineRun, sizes: Sizes, cuda: bool) -> None:
    source = "CUDA events" if cuda else "host times"
    with report.measuring("(c)", "time per micro-batch"):
        a, b = ours.per_microbatch_ms, stock.per_microbatch_ms
        report.line(
            "(c)",
            f"time per micro-batch ({source}): ReCycle F+B+W {a:.3f} ms (F {ours.median('F'):.3f} B "
            f"{ours.median('B'):.3f} W {ours.median('W'):.3f}) vs stock bf16 F+fused {b:.3f} ms (F "
            f"{stock.median('F'):.3f} fused {stock.median('BW'):.3f}) -> ours/stock {_ratio(a, b)}",
        )
    with report.measuring("(c)", "iteration time"):
        a, b = statistics.median(ours.iteration_ms), statistics.median(stock.iteration_ms)
        report.line(
            "(c)",
            f"iteration ({sizes.micro_batches} micro-batches and the step, wall): ReCycle {a:.3f} ms vs stock "
            f"{b:.3f} ms -> ours/stock {_ratio(a, b)}; step ReCycle {_fmt_ms(ours.median('S'))} stock "
            f"{_fmt_ms(stock.median('S'))}",
        )
    with report.measuring("(c)", "memory"):
        report.line(
            "(c)",
            f"memory: ReCycle ({ours.optimizer}, fp32 weights and Adam state) peak {_gib(ours.peak_bytes)}, at rest "
            f"{_gib(ours.rest_bytes)}; stock ({stock.optimizer}, bf16 weights, fp32 master and Adam state) peak "
            f"{_gib(stock.peak_bytes)}, at rest {_gib(stock.rest_bytes)} -> ours/stock peak "
            f"{_ratio(ours.peak_bytes or math.nan, stock.peak_bytes or math.nan)}",
        )
    with report.measuring("(c)", "ZeRO-1 arithmetic"):
        n = ours.params
        ours_state = ours.extra["optimizer_state_bytes"]
        stock_state = stock.extra["optimizer_state_bytes"]
        saved = (ZERO_D - 1) / ZERO_D
        report.line(
            "(c)",
            f"ZeRO-1 at D={ZERO_D} on this stage ({n / 1e6:.1f} M parameters): ReCycle's optimizer state "
            f"{_gib(ours_state)} ({ours_state / n:.1f} B/param: Adam m, v) would shrink by {_gib(ours_state * saved)} "
            f"per GPU, stock bf16's {_gib(stock_state)} ({stock_state / n:.1f} B/param: fp32 master, m, v) by "
            f"{_gib(stock_state * saved)}; ReCycle keeps every replica's state whole (a failure must not lose a "
            "shard), so it gives that up",
        )
    with report.measuring("(c)", "ZeRO-1 at model scale"):
        preset = get_model(PRESET)
        layout = stage_costs(preset, PLAN_P, PLAN_D)
        params = max(layout.stage_state_bytes) / Hardware().state_bytes_per_param
        report.line(
            "(c)",
            f"ZeRO-1 at D={ZERO_D} for {PRESET} at P={PLAN_P} (largest stage, {params / 1e6:.0f} M parameters): "
            f"Adam m, v = {_gib(8 * params)} per GPU, sharded {_gib(8 * params / ZERO_D)} (saves "
            f"{_gib(8 * params * saved)}); with bf16 weights and fp32 master copies {_gib(12 * params)} -> "
            f"{_gib(12 * params / ZERO_D)} (saves {_gib(12 * params * saved)})",
        )


# ---- main ---------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=DEVICE, choices=["cuda", "cpu"])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (the default without a GPU)")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("summary: no CUDA device; nothing measured (run with --device cpu --smoke)")
        return
    sizes = SMOKE_SIZES if args.smoke or not cuda else CUDA_SIZES
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    report = Report()
    began = time.perf_counter()
    name = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"# gpu_costs: {name}, torch {torch.__version__}, {sizes.describe()}, bf16 autocast", flush=True)
    ours = stock = None
    with report.measuring("(setup)", "process group"):
        with contextlib.redirect_stdout(sys.stderr):
            quiet_loggers()
            backend = start_world(args.device)
        report.line("(setup)", f"world of 1 process on {backend}, DS_ACCELERATOR={os.environ['DS_ACCELERATOR']}")
    with report.measuring("(setup)", "ReCycle engine run"):
        ours = run_engine("recycle", sizes, args.device)
        report.line(
            "(setup)",
            f"ReCycle engine: {sizes.iterations} iterations, median {statistics.median(ours.iteration_ms):.3f} ms "
            f"over the last {sizes.measured}",
        )
    if ours is not None:  # printed before the stock run, which a time bound may cut
        with report.measuring("(a)", "profiler and governor"):
            part_a(report, ours, sizes, cuda)
        with report.measuring("(b)", "plans"):
            part_b(report, ours, sizes, cuda)
    with report.measuring("(setup)", "stock DeepSpeed bf16 run"):
        stock = run_engine("stock", sizes, args.device)
        report.line(
            "(setup)",
            f"stock DeepSpeed bf16 ({stock.optimizer}): {sizes.iterations} iterations, median "
            f"{statistics.median(stock.iteration_ms):.3f} ms over the last {sizes.measured}",
        )
    if ours is not None and stock is not None:
        with report.measuring("(c)", "bf16 against stock"):
            part_c(report, ours, stock, sizes, cuda)
    failed = "; ".join(report.failed) if report.failed else "none"
    print(
        f"summary: {report.lines} measurements printed, FAILED: {failed}; {time.perf_counter() - began:.0f} s",
        flush=True,
    )
    if report.failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
