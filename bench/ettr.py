"""ETTR at production scale (issue 44): ReCycle against replica restart, job restart, Oobleck, Bamboo
and checkpoint-restart, at 1,024, 16,384 and 131,072 GPUs, under Meta's and Llama 3's failure rates.

    .venv/bin/python bench/ettr.py [--smoke]

13B (tp 8) on P = 8 stages, m = 16, one week, repair 2 h, 1% hot spares for every system, ReCycle
with migration (the CLI's default); the ETTR of every system against its own fault-free rate
(sim/ettr.py). The last line is Meta's rate at 16,384 GPUs. Pure Python; a few minutes on 2 shared
cores (--smoke: 1,024 and 16,384 GPUs, 6 hours, in seconds).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from ds_recycle.sim.ettr import DEFAULT_SPARE_FRACTION, EttrTable, ettr_study, text_table
from ds_recycle.sim.experiments import ALL_SYSTEMS, SystemParams
from ds_recycle.sim.job_restart import JobRestartParams
from ds_recycle.sim.presets import get_model
from ds_recycle.sim.rebalance import RebalanceParams
from ds_recycle.sim.replica_restart import ReplicaRestartParams

SCALE = 16384


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="two scales, 6 hours (seconds)")
    args = parser.parse_args()
    scales = (1024, SCALE) if args.smoke else (1024, SCALE, 131072)
    hours = 6.0 if args.smoke else 168.0
    base = SystemParams()
    params = replace(base, recycle=replace(base.recycle, rebalance=RebalanceParams("migrate")))
    print(
        f"parameters: replica-restart {ReplicaRestartParams().restart_s:g} s per replica (FT-HSDP), "
        f"job-restart {JobRestartParams().restart_s:g} s per failure (FlashRecovery), checkpoint-restart "
        f"{params.checkpoint.policy} with a 300 s restart; spares {DEFAULT_SPARE_FRACTION:g}; "
        "rates: Meta (arXiv 2410.21680), Llama 3 (419 in 54 days at 16,384 GPUs)"
    )
    start = time.perf_counter()
    table = ettr_study(get_model("13B", tp=8), 8, 16, scales, hours=hours, params=params)
    print(text_table(table))
    print()
    print(samples_table(table))
    print(f"({time.perf_counter() - start:.0f} s)")
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
