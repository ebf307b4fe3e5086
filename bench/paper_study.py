"""The paper study (issue 8): ReCycle vs Oobleck, Bamboo and checkpoint-restart, three experiments.

    .venv/bin/python bench/paper_study.py [--quick]

E1 concurrent-failure sweep, E2 replay of every shipped trace, E3 production-scale Poisson, then a
sensitivity line per main parameter. Prints the tables and the maximum ratios with their settings.
Pure Python (the planner and the models of ds_recycle/sim); a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from ds_recycle.sim.experiments import SystemParams, poisson, sweep, trace_replay
from ds_recycle.sim.job import LLAMA3_RATE_PER_GPU_DAY, Checkpointing, Job
from ds_recycle.sim.presets import get_model
from ds_recycle.sim.traces import read_trace, shipped_traces

SWEEP_CKPT = Checkpointing(60.0, 300.0, 1800.0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer grids and Poisson sizes")
    quick = parser.parse_args().quick
    began = time.perf_counter()
    best: dict[str, tuple[float, str]] = {}

    def track(name: str, value: float | None, where: str) -> None:
        if value is not None and value > best.get(name, (0.0, ""))[0]:
            best[name] = (value, where)

    print("== E1: concurrent-failure sweep (1 h window after f failures at once; samples/s incl. event costs)")
    grids = [(4, 4), (8, 4), (4, 8), (8, 8)] if not quick else [(4, 4), (8, 8)]
    models = ["1.3B", "6.7B"]
    print(
        f"{'model':>6} {'DxP':>5} {'m':>3} {'placement':>9} {'f':>2} {'recycle':>9} {'oobleck':>9} {'bamboo':>9} "
        f"{'ckpt':>9} {'R/O':>6} {'R/B':>6}"
    )
    for model in models:
        for D, P in grids:
            for m in (P, 2 * P):
                job = Job(get_model(model), D, P, m, checkpointing=SWEEP_CKPT)
                for placement in ("spread", "stage", "pipeline"):
                    study = sweep(job, placement)
                    for row in study.rows:
                        r = {n: run.samples_per_s for n, run in row.runs.items()}
                        ro = r["recycle"] / r["oobleck"] if r["oobleck"] else None
                        rb = r["recycle"] / r["bamboo"] if r["bamboo"] else None
                        where = f"{model} {D}x{P} m={m} {placement} f={row.failures}"
                        track("sweep recycle/oobleck", ro, where)
                        track("sweep recycle/bamboo", rb, where)
                        if row.failures in (0, 1, D // 2, D - 1):
                            print(
                                f"{model:>6} {D}x{P:<3} {m:>3} {placement:>9} {row.failures:>2} "
                                f"{r['recycle']:9.1f} {r['oobleck']:9.1f} {r['bamboo']:9.1f} {r['checkpoint']:9.1f} "
                                f"{_fmt(ro)} {_fmt(rb)}"
                            )
    print()
    print("== E2: trace replay (samples/s averaged over the trace, downtime included)")
    print(
        f"{'trace':>22} {'model':>5} {'DxP':>5} {'recycle':>9} {'oobleck':>9} {'bamboo':>9} {'ckpt':>9} "
        f"{'R/O':>6} {'R/B':>6}"
    )
    for path in shipped_traces():
        trace = read_trace(path)
        for model, P in (("1.3B", 4), ("6.7B", 8)):
            D = trace.peak // P
            rate = trace.removals / (trace.duration / 3600)
            job = Job(get_model(model), D, P, 2 * P, failures_per_hour=rate)
            study = trace_replay(job, trace)
            r = {n: run.samples_per_s for n, run in study.runs.items()}
            ro = r["recycle"] / r["oobleck"] if r["oobleck"] else None
            rb = r["recycle"] / r["bamboo"] if r["bamboo"] else None
            track("trace recycle/oobleck", ro, f"{trace.name} {model} {D}x{P}")
            track("trace recycle/bamboo", rb, f"{trace.name} {model} {D}x{P}")
            print(
                f"{trace.name:>22} {model:>5} {D}x{P:<3} {r['recycle']:9.1f} {r['oobleck']:9.1f} {r['bamboo']:9.1f} "
                f"{r['checkpoint']:9.1f} {_fmt(ro)} {_fmt(rb)}"
            )
    print()
    print("== E3: production-scale Poisson (13B tp=8 x P=8, m=2P, 1 week, repair 2 h; per-GPU rate x Llama 3's)")
    print(
        f"{'GPUs':>6} {'rate':>5} {'fails':>5} {'recycle':>9} {'oobleck':>9} {'bamboo':>9} {'ckpt':>9} {'R/O':>6} "
        f"{'R/B':>6} {'R/C':>6}"
    )
    sizes = [1024, 4096, 16384] if not quick else [1024, 16384]
    for gpus in sizes:
        for multiple in (1, 4, 10):
            model = get_model("13B", tp=8)
            D = gpus // 8 // 8
            rate = multiple * LLAMA3_RATE_PER_GPU_DAY * gpus / 24
            job = Job(model, D, 8, 16, failures_per_hour=rate)
            study = poisson(job, multiple, 168, 2.0)
            r = {n: run.samples_per_s for n, run in study.runs.items()}
            ro, rb, rc = (r["recycle"] / r[k] if r[k] else None for k in ("oobleck", "bamboo", "checkpoint"))
            track("poisson recycle/oobleck", ro, f"{gpus} GPUs x{multiple}")
            track("poisson recycle/bamboo", rb, f"{gpus} GPUs x{multiple}")
            print(
                f"{gpus:>6} {multiple:>5} {study.series[0]['failures']:>5} {r['recycle']:9.1f} {r['oobleck']:9.1f} "
                f"{r['bamboo']:9.1f} {r['checkpoint']:9.1f} {_fmt(ro)} {_fmt(rb)} {_fmt(rc)}"
            )
    print()
    print("== Sensitivity: ratio recycle/oobleck and recycle/bamboo on bamboo-p3 (6.7B 4x8, m=16)")
    trace = read_trace(next(p for p in shipped_traces() if p.stem == "bamboo-p3"))
    rate = trace.removals / (trace.duration / 3600)
    job = Job(get_model("6.7B"), trace.peak // 8, 8, 16, failures_per_hour=rate)
    base = SystemParams()
    variants = {
        "defaults": base,
        "oobleck remove 10 s (artifact)": replace(base, oobleck=replace(base.oobleck, remove_downtime_s=10.0)),
        "oobleck add 0 s": replace(base, oobleck=replace(base.oobleck, add_downtime_s=0.0)),
        "oobleck remove 10 s + add 0 s": replace(
            base, oobleck=replace(base.oobleck, remove_downtime_s=10.0, add_downtime_s=0.0)
        ),
        "bamboo reconfigure 450 s (artifact 6.7B)": replace(base, bamboo=replace(base.bamboo, reconfigure_s=450.0)),
        "bamboo depth 1.0 x P": replace(base, bamboo=replace(base.bamboo, depth_factor=1.0)),
        "bamboo FRC fills all bubbles": replace(base, bamboo=replace(base.bamboo, frc_bubble_fill=1.0)),
        "recycle rebuild 60 s": replace(base, recycle=replace(base.recycle, rebuild_s=60.0)),
        "recycle detect 30 s": replace(base, recycle=replace(base.recycle, detect_s=30.0)),
    }
    for label, params in variants.items():
        study = trace_replay(job, trace, params=params)
        r = {n: run.samples_per_s for n, run in study.runs.items()}
        print(f"  {label:<42} R/O {_fmt(r['recycle'] / r['oobleck'])}  R/B {_fmt(r['recycle'] / r['bamboo'])}")
    print()
    for name, (value, where) in sorted(best.items()):
        print(f"max {name}: {value:.3f} at {where}")
    print(f"({time.perf_counter() - began:.0f} s)")


def _fmt(value: float | None) -> str:
    return f"{value:6.2f}" if value is not None else f"{'-':>6}"


if __name__ == "__main__":
    main()
