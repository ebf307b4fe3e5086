"""The paper study (issues 8, 20): ReCycle vs Oobleck, Bamboo and checkpoint-restart, three experiments.

    .venv/bin/python bench/paper_study.py [--quick | --smoke]

E1 concurrent-failure sweep, E2 replay of every shipped trace, E3 production-scale Poisson, each
with ReCycle's rebalancing off, ``migrate`` and ``repartition`` (sim/rebalance.py); then the
checkpoint-restart model against Oobleck's artifact, a sensitivity line per main parameter, and a
summary per rebalancing mode (the worst ratio to each baseline, the largest over Oobleck).
Pure Python (the planner and the models of ds_recycle/sim); about 12 minutes on 2 shared cores (--quick:
fewer grids, trace configurations and Poisson sizes; --smoke: one point of each part, for the test
suite).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field, replace

from ds_recycle.sim.experiments import SystemParams, poisson, sweep, trace_replay
from ds_recycle.sim.job import LLAMA3_RATE_PER_GPU_DAY, Checkpointing, Job
from ds_recycle.sim.presets import get_model
from ds_recycle.sim.rebalance import MODES, RebalanceParams
from ds_recycle.sim.traces import Trace, read_trace, shipped_traces

SWEEP_CKPT = Checkpointing(60.0, 300.0, 1800.0)
BASELINES = ("oobleck", "bamboo", "checkpoint")
SHORT = {"oobleck": "O", "bamboo": "B", "checkpoint": "C"}

ARTIFACT_VARUNA_OVER_OOBLECK = {"10m": 0.072, "30m": 0.257, "1h": 0.637, "3h": 0.920, "6h": 0.957}
"""Varuna / Oobleck average throughput in Oobleck's artifact (branch sosp23-artifact,
tools/simulator: varuna_simulator.py and oobleck_simulator.py, model GPT-3-6_7b, on the same
synthetic traces, time_hard_stop, as eval_tput_vs_freq.py runs them), run by us."""
ARTIFACT_CKPT = Checkpointing(120.0, 581.0, 1950.0)
"""The artifact's Varuna for GPT-3 6.7B: checkpointing_overhead 120 s; restart = the rendezvous
(local_rendezvous_timeout_delta 701 s) minus the checkpoint it includes; a checkpoint every 10
iterations of its ~195 s (1024 samples at its 30-node 5.24 samples/s)."""


TRACE_CONFIGS = (("6.7B", 5, 16), ("1.3B", 4, 8), ("6.7B", 8, 16))
"""(model, P, m): the issue's configuration (6.7B, P = 5, m = 16: 30 GPUs on the Oobleck traces)
first, then the two of the original study."""


@dataclass(frozen=True)
class Size:
    """What each part of the study covers."""

    models: tuple[str, ...] = ("1.3B", "6.7B")
    grids: tuple[tuple[int, int], ...] = ((4, 4), (8, 4), (4, 8), (8, 8))
    """(D, P) of the sweep; m is P and 2 P (``m_per_p``)."""
    m_per_p: tuple[int, ...] = (1, 2)
    placements: tuple[str, ...] = ("spread", "stage", "pipeline")
    trace_configs: tuple[tuple[str, int, int], ...] = ()
    """(model, P, m) of the trace replay (empty: TRACE_CONFIGS)."""
    traces: tuple[str, ...] = ()
    """The shipped traces replayed (empty: all)."""
    poisson_sizes: tuple[int, ...] = (1024, 4096, 16384)
    poisson_multiples: tuple[int, ...] = (1, 4, 10)
    checkpoint_traces: tuple[str, ...] = ("10m", "30m", "1h", "3h", "6h")
    variants: int | None = None
    """The first this many sensitivity variants (None: all)."""


FULL = Size()
QUICK = replace(FULL, grids=((4, 4), (4, 8)), trace_configs=TRACE_CONFIGS[:1], poisson_sizes=(1024, 16384))
SMOKE = Size(
    models=("1.3B",),
    grids=((4, 4),),
    m_per_p=(1,),
    placements=("spread",),
    trace_configs=(("1.3B", 4, 8),),
    traces=("oobleck-synthetic-30m",),
    poisson_sizes=(1024,),
    poisson_multiples=(4,),
    checkpoint_traces=("1h",),
    variants=1,
)


def params_for(mode: str, base: SystemParams = SystemParams()) -> SystemParams:
    return replace(base, recycle=replace(base.recycle, rebalance=RebalanceParams(mode)))


@dataclass
class Tally:
    """Per rebalancing mode: the smallest ratio to each baseline (and where), the largest over
    Oobleck, and how many points fell below 1.0 against the best baseline."""

    worst: dict[tuple[str, str, str], tuple[float, str]] = field(default_factory=dict)
    best: dict[tuple[str, str], tuple[float, str]] = field(default_factory=dict)
    below: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    points: dict[tuple[str, str], int] = field(default_factory=dict)

    def add(self, experiment: str, mode: str, recycle: float, others: dict[str, float], where: str) -> None:
        self.points[(experiment, mode)] = self.points.get((experiment, mode), 0) + 1
        ratios = {k: recycle / v for k, v in others.items() if v > 0}
        for name, value in ratios.items():
            key = (experiment, mode, name)
            if value < self.worst.get(key, (float("inf"), ""))[0]:
                self.worst[key] = (value, where)
        if "oobleck" in ratios and ratios["oobleck"] > self.best.get((experiment, mode), (0.0, ""))[0]:
            self.best[(experiment, mode)] = (ratios["oobleck"], where)
        if ratios and min(ratios.values()) < 1.0:
            self.below.setdefault((experiment, mode), []).append(where)

    def report(self) -> list[str]:
        lines = []
        for experiment in ("sweep", "trace", "poisson"):
            for mode in MODES:
                if (experiment, mode) not in self.points:
                    continue
                worst = "  ".join(
                    f"R/{SHORT[n]} {self.worst[(experiment, mode, n)][0]:.3f} ({self.worst[(experiment, mode, n)][1]})"
                    for n in BASELINES
                    if (experiment, mode, n) in self.worst
                )
                lines.append(f"  {experiment:<7} {mode:<11} worst {worst}")
                best = self.best.get((experiment, mode))
                below = len(self.below.get((experiment, mode), []))
                top = f"max R/O {best[0]:.3f} ({best[1]}); " if best else ""
                lines.append(
                    f"  {'':<19} {top}{below}/{self.points[(experiment, mode)]} points below 1.0 against a baseline"
                )
        return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer grids, trace configurations and Poisson sizes")
    parser.add_argument("--smoke", action="store_true", help="one point of each part (for the test suite)")
    args = parser.parse_args()
    size = SMOKE if args.smoke else QUICK if args.quick else FULL
    began = time.perf_counter()
    tally = Tally()
    sweep_study(size, tally)
    trace_study(size, tally)
    poisson_study(size, tally)
    checkpoint_check(size)
    sensitivity(size)
    print("== Summary per rebalancing mode (R/X = recycle / X; worst point, its place)")
    for line in tally.report():
        print(line)
    print(f"({time.perf_counter() - began:.0f} s)")


def sweep_study(size: Size, tally: Tally) -> None:
    print("== E1: concurrent-failure sweep (1 h window after f failures at once; samples/s incl. event costs)")
    print("   recycle columns: rebalancing off / migrate / repartition; R/O for each")
    print(
        f"{'model':>6} {'DxP':>5} {'m':>3} {'placement':>9} {'f':>2} {'off':>7} {'migr':>7} {'repart':>7} "
        f"{'oobleck':>8} {'bamboo':>8} {'ckpt':>8} {'R/O off':>8} {'migr':>6} {'repart':>6}"
    )
    for model in size.models:
        for D, P in size.grids:
            for m in (k * P for k in size.m_per_p):
                job = Job(get_model(model), D, P, m, checkpointing=SWEEP_CKPT)
                for placement in size.placements:
                    base = sweep(job, placement, params=params_for("off"))
                    modes = {"off": base} | {
                        mode: sweep(job, placement, ("recycle",), params_for(mode)) for mode in MODES[1:]
                    }
                    for i, row in enumerate(base.rows):
                        others = {n: row.runs[n].samples_per_s for n in BASELINES}
                        rec = {mode: s.rows[i].runs["recycle"].samples_per_s for mode, s in modes.items()}
                        where = f"{model} {D}x{P} m={m} {placement} f={row.failures}"
                        for mode, value in rec.items():
                            tally.add("sweep", mode, value, others, where)
                        if row.failures in (0, 1, D // 2, D - 1):
                            ro = [_fmt(rec[mode] / others["oobleck"] if others["oobleck"] else None) for mode in MODES]
                            print(
                                f"{model:>6} {D}x{P:<3} {m:>3} {placement:>9} {row.failures:>2} "
                                + " ".join(f"{rec[mode]:7.1f}" for mode in MODES)
                                + f" {others['oobleck']:8.1f} {others['bamboo']:8.1f} {others['checkpoint']:8.1f} "
                                + f"{ro[0]:>8} {ro[1]} {ro[2]}"
                            )
    print()


def trace_study(size: Size, tally: Tally) -> None:
    print("== E2: trace replay (samples/s averaged over the trace, downtime included)")
    print("   R/O, R/B, R/C with rebalancing off | migrate | repartition")
    print(
        f"{'trace':>22} {'model':>5} {'DxP':>5} {'off':>7} {'migr':>7} {'repart':>7} {'oobleck':>8} {'bamboo':>7} "
        f"{'ckpt':>7}  {'off: R/O R/B R/C':>20}  {'migrate':>18}  {'repartition':>18}"
    )
    for model, P, m in size.trace_configs or TRACE_CONFIGS:
        for path in (p for p in shipped_traces() if not size.traces or p.stem in size.traces):
            trace = read_trace(path)
            D = trace.peak // P
            job = Job(get_model(model), D, P, m, failures_per_hour=trace.removals / (trace.duration / 3600))
            base = trace_replay(job, trace, params=params_for("off"))
            others = {n: base.runs[n].samples_per_s for n in BASELINES}
            rec = {"off": base.runs["recycle"].samples_per_s}
            for mode in MODES[1:]:
                rec[mode] = trace_replay(job, trace, ("recycle",), params_for(mode)).runs["recycle"].samples_per_s
            where = f"{trace.name} {model} {D}x{P} m={m}"
            cells = []
            for mode in MODES:
                tally.add("trace", mode, rec[mode], others, where)
                cells.append(" ".join(_fmt(rec[mode] / others[n] if others[n] else None, 5) for n in BASELINES))
            print(
                f"{trace.name:>22} {model:>5} {D}x{P:<3} "
                + " ".join(f"{rec[mode]:7.1f}" for mode in MODES)
                + f" {others['oobleck']:8.1f} {others['bamboo']:7.1f} {others['checkpoint']:7.1f}  "
                + "  ".join(f"{c:>18}" for c in cells)
            )
    print()


def poisson_study(size: Size, tally: Tally) -> None:
    print("== E3: production-scale Poisson (13B tp=8 x P=8, m=2P, 1 week, repair 2 h; per-GPU rate x Llama 3's)")
    print(
        f"{'GPUs':>6} {'rate':>5} {'fails':>5} {'off':>9} {'migr':>9} {'repart':>9} {'oobleck':>9} {'bamboo':>9} "
        f"{'ckpt':>9}  {'R/O off':>7} {'migr':>6} {'repart':>6}  {'R/C off':>7} {'migr':>6}"
    )
    for gpus in size.poisson_sizes:
        for multiple in size.poisson_multiples:
            model = get_model("13B", tp=8)
            D = gpus // 8 // 8
            rate = multiple * LLAMA3_RATE_PER_GPU_DAY * gpus / 24
            job = Job(model, D, 8, 16, failures_per_hour=rate)
            base = poisson(job, multiple, 168, 2.0, params=params_for("off"))
            others = {n: base.runs[n].samples_per_s for n in BASELINES}
            rec = {"off": base.runs["recycle"].samples_per_s}
            for mode in MODES[1:]:
                study = poisson(job, multiple, 168, 2.0, systems=("recycle",), params=params_for(mode))
                rec[mode] = study.runs["recycle"].samples_per_s
            where = f"{gpus} GPUs x{multiple}"
            for mode in MODES:
                tally.add("poisson", mode, rec[mode], others, where)
            ro = [_fmt(rec[mode] / others["oobleck"]) for mode in MODES]
            rc = [_fmt(rec[mode] / others["checkpoint"]) for mode in MODES[:2]]
            print(
                f"{gpus:>6} {multiple:>5} {base.series[0]['failures']:>5} "
                + " ".join(f"{rec[mode]:9.1f}" for mode in MODES)
                + f" {others['oobleck']:9.1f} {others['bamboo']:9.1f} {others['checkpoint']:9.1f}  "
                + f"{ro[0]:>7} {ro[1]} {ro[2]}  {rc[0]:>7} {rc[1]}"
            )
    print()


def checkpoint_check(size: Size) -> None:
    """checkpoint / oobleck on the synthetic traces: our defaults, our model with the artifact's
    Varuna parameters (Oobleck then pays no checkpoint, as in the artifact), and the artifact."""
    print("== Checkpoint-restart against Oobleck's artifact (6.7B 6x5, m=16; checkpoint / oobleck samples/s)")
    print(
        f"{'trace':>22} {'ours':>7} {'R=581':>7} {'+C=120':>7} {'+tau=1950':>9} {'+Oobleck no ckpt':>16} "
        f"{'artifact':>8}"
    )
    for label in size.checkpoint_traces:
        trace = read_trace(next(p for p in shipped_traces() if p.stem == f"oobleck-synthetic-{label}"))
        rate = trace.removals / (trace.duration / 3600)

        def run(system: str, ckpt: Checkpointing, tr: Trace = trace, job_rate: float = rate) -> float:
            job = Job(get_model("6.7B"), 6, 5, 16, checkpointing=ckpt, failures_per_hour=job_rate)
            return trace_replay(job, tr, (system,)).runs[system].samples_per_s

        ours = Checkpointing()
        oobleck = run("oobleck", ours)
        cells = [
            run("checkpoint", ours) / oobleck,
            run("checkpoint", replace(ours, restart_s=581.0)) / oobleck,
            run("checkpoint", replace(ours, restart_s=581.0, cost_s=120.0)) / oobleck,
            run("checkpoint", ARTIFACT_CKPT) / oobleck,
            run("checkpoint", ARTIFACT_CKPT) / run("oobleck", replace(ARTIFACT_CKPT, cost_s=0.0, interval_s=None)),
        ]
        print(
            f"{trace.name:>22} "
            + f"{cells[0]:7.3f} {cells[1]:7.3f} {cells[2]:7.3f} {cells[3]:9.3f} {cells[4]:16.3f} "
            + f"{ARTIFACT_VARUNA_OVER_OOBLECK[label]:8.3f}"
        )
    print()


def sensitivity(size: Size) -> None:
    print("== Sensitivity: ratio recycle/oobleck and recycle/bamboo on bamboo-p3 (6.7B 4x8, m=16)")
    trace = read_trace(next(p for p in shipped_traces() if p.stem == "bamboo-p3"))
    rate = trace.removals / (trace.duration / 3600)
    job = Job(get_model("6.7B"), trace.peak // 8, 8, 16, failures_per_hour=rate)
    base = SystemParams()
    variants = {
        "defaults (rebalancing off)": base,
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
        "migrate": params_for("migrate"),
        "repartition": params_for("repartition"),
        "migrate, repair prior 10 min": params_for("migrate", _prior(base, 600.0)),
        "migrate, repair prior 1 day": params_for("migrate", _prior(base, 86400.0)),
        "migrate, recycle rebuild 60 s": params_for(
            "migrate", replace(base, recycle=replace(base.recycle, rebuild_s=60.0))
        ),
        "migrate, oobleck remove 10 s + add 0 s": params_for(
            "migrate", replace(base, oobleck=replace(base.oobleck, remove_downtime_s=10.0, add_downtime_s=0.0))
        ),
    }
    for label, params in list(variants.items())[: size.variants]:
        study = trace_replay(job, trace, params=params)
        r = {n: run.samples_per_s for n, run in study.runs.items()}
        print(f"  {label:<42} R/O {_fmt(r['recycle'] / r['oobleck'])}  R/B {_fmt(r['recycle'] / r['bamboo'])}")
    print()


def _prior(base: SystemParams, seconds: float) -> SystemParams:
    return replace(base, recycle=replace(base.recycle, repair_prior_s=seconds))


def _fmt(value: float | None, width: int = 6) -> str:
    return f"{value:{width}.2f}" if value is not None else f"{'-':>{width}}"


if __name__ == "__main__":
    main()
