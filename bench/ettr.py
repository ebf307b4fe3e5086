"""ETTR at production scale (issue 44): ReCycle against replica restart, job restart, Oobleck, Bamboo
and checkpoint-restart, at 1,024, 16,384 and 131,072 GPUs, under Meta's and Llama 3's failure rates.

    .venv/bin/python bench/ettr.py [--smoke] [--failures causes|single] [--recycle-costs measured|paper]

13B (tp 8) on P = 8 stages, m = 16, one week, 1% hot spares for every system, ReCycle with migration
(the CLI's default); failures by cause (the Llama 3 mix, host and network failures taking a node,
lognormal repairs; ``--failures single``: one worker per failure, 2 h repairs) and ReCycle's measured
recovery costs (``--recycle-costs paper``: 5 s + 10 s); the ETTR of every system against its own
fault-free rate (sim/ettr.py). The last line is Meta's rate at 16,384 GPUs. Pure Python; minutes on
2 shared cores (--smoke: 1,024 and 16,384 GPUs, 6 hours, in seconds).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from ds_recycle.sim.causes import FailureModel
from ds_recycle.sim.ettr import DEFAULT_SPARE_FRACTION, EttrTable, ettr_study, text_table, with_recycle_costs
from ds_recycle.sim.experiments import ALL_SYSTEMS, SystemParams
from ds_recycle.sim.job_restart import JobRestartParams
from ds_recycle.sim.presets import get_model
from ds_recycle.sim.rebalance import RebalanceParams
from ds_recycle.sim.replica_restart import ReplicaRestartParams

SCALE = 16384


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="two scales, 6 hours (seconds)")
    parser.add_argument("--failures", choices=("causes", "single"), default="causes")
    parser.add_argument("--recycle-costs", choices=("measured", "paper"), default="measured")
    parser.add_argument(
        "--join-with-recovery", action="store_true", help="ReCycle: a spare joins in the failure's own recovery [A]"
    )
    parser.add_argument("--scales", help="comma list of GPU counts (default: 1024,16384,131072; smoke: 1024,16384)")
    parser.add_argument("--hours", type=float, help="duration (default: 168; smoke: 6)")
    parser.add_argument("--systems", default=",".join(ALL_SYSTEMS), help="comma list (default: all six)")
    args = parser.parse_args()
    scales = (1024, SCALE) if args.smoke else (1024, SCALE, 131072)
    if args.scales:
        scales = tuple(int(g) for g in args.scales.split(","))
    hours = args.hours if args.hours else 6.0 if args.smoke else 168.0
    base = SystemParams()
    params = replace(base, recycle=replace(base.recycle, rebalance=RebalanceParams("migrate")))
    params = with_recycle_costs(params, args.recycle_costs)
    if args.join_with_recovery:
        params = replace(params, recycle=replace(params.recycle, join_with_recovery=True))
    systems = tuple(args.systems.split(","))
    failures = FailureModel() if args.failures == "causes" else None
    print(
        f"parameters: replica-restart {ReplicaRestartParams().restart_s:g} s per replica (FT-HSDP), "
        f"job-restart {JobRestartParams().restart_s:g} s per failure (FlashRecovery), checkpoint-restart "
        f"{params.checkpoint.policy} with a 300 s restart; ReCycle {args.recycle_costs} costs "
        f"({params.recycle.detect_s:g} s + {params.recycle.rebuild_s:g} s); spares {DEFAULT_SPARE_FRACTION:g}; "
        "rates: Meta (arXiv 2410.21680), Llama 3 (419 in 54 days at 16,384 GPUs)"
    )
    start = time.perf_counter()
    table = ettr_study(
        get_model("13B", tp=8), 8, 16, scales, hours=hours, params=params, failure_model=failures, systems=systems
    )
    print(text_table(table))
    print()
    print(samples_table(table))
    print(f"({time.perf_counter() - start:.0f} s)")
    if SCALE not in scales:
        return
    row = table.row("meta", SCALE)
    print(
        f"ETTR at {SCALE} GPUs: "
        + ", ".join(f"{name} {row.ettr[name]:.4f}" for name in ALL_SYSTEMS if name in row.ettr)
    )


def samples_table(table: EttrTable) -> str:
    """Samples/s of every system: ETTR is against each one's own fault-free rate."""
    names = table.systems()
    lines = ["samples/s (wall time, downtime included)"]
    lines.append(f"{'rate':<7}{'GPUs':>7}  " + "  ".join(f"{n:>15}" for n in names))
    for row in table.rows:
        lines.append(f"{row.preset:<7}{row.gpus:>7}  " + "  ".join(f"{row.samples_per_s[n]:15.1f}" for n in names))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
