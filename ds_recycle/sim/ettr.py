"""Effective training time ratio (ETTR) against the number of GPUs, for every system, at two failure rates.

ETTR is the useful work a system does over what the same system would have done with no failure in
the same wall time (:func:`ds_recycle.sim.experiments.ettr`). Every point is a Poisson study
(:func:`ds_recycle.sim.experiments.poisson`) on the same job and the same failures for every system.
The reference is each system's own fault-free rate under the job's checkpointing, so the checkpoint
cost ``C / tau`` that every system pays alike is not counted; each row reports ``1 - C / tau``, and
the ETTR that counts it too is the product.

Failure-rate presets (per GPU, every worker of ``tp`` GPUs failing at ``tp`` times it):

- ``meta``: Meta's research clusters (Kokolis et al., arXiv 2410.21680): mean time to failure 7.9 h
  for a 1,024-GPU job, 1.8 h at 16,384 GPUs, about 14 minutes at 131,072 GPUs (their projection);
- ``llama3``: Llama 3 405B training, 419 unexpected interruptions in 54 days on 16,384 H100s
  (4.7e-4 per GPU-day, ``sim/job.py``).

Failures come by cause by default (``sim/causes.py``: the Llama 3 mix, a host or network failure
taking a node's 8 GPUs, lognormal repair times); ``failure_model=None`` is the single-cause model
(one worker per failure, a constant ``repair_hours``). ReCycle's recovery costs are the measured ones
(``presets.RECYCLE_COSTS``) unless ``params`` says otherwise (:func:`with_recycle_costs`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ds_recycle.sim.causes import FailureModel
from ds_recycle.sim.experiments import ALL_SYSTEMS, SystemParams, poisson
from ds_recycle.sim.job import LLAMA3_RATE_PER_GPU_DAY, Checkpointing, Job
from ds_recycle.sim.presets import RECYCLE_COSTS, ModelSpec

SCALES = (1024, 16384, 131072)
"""GPUs of the ETTR table (issue 44)."""
META_MTTF_HOURS: dict[int, float] = {1024: 7.9, 16384: 1.8, 131072: 14 / 60}
"""Job mean time to failure by GPU count on Meta's clusters (arXiv 2410.21680; 131,072: projected)."""
RATE_PRESETS = ("meta", "llama3")
DEFAULT_SPARE_FRACTION = 0.01
"""Hot spare workers, as a fraction of the job's, given to every system alike [A]: replica and job
restart (torchft, FlashRecovery) restart on a replacement node, which a cluster keeps at hand."""


def with_recycle_costs(params: SystemParams, costs: str = "measured") -> SystemParams:
    """``params`` with ReCycle's detection and rebuild from ``presets.RECYCLE_COSTS[costs]``."""
    if costs not in RECYCLE_COSTS:
        raise ValueError(f"unknown ReCycle costs {costs!r}: one of {', '.join(RECYCLE_COSTS)}")
    preset = RECYCLE_COSTS[costs]
    return replace(params, recycle=replace(params.recycle, detect_s=preset.detect_s, rebuild_s=preset.rebuild_s))


def failures_per_hour(preset: str, gpus: int) -> float:
    """The job's failures per hour at ``gpus`` GPUs under ``preset``."""
    if preset == "llama3":
        return gpus * LLAMA3_RATE_PER_GPU_DAY / 24
    if preset == "meta":
        known = sorted(META_MTTF_HOURS)
        if not known[0] <= gpus <= known[-1]:
            raise ValueError(f"meta rate: {gpus} GPUs is outside the reported {known[0]}..{known[-1]}")
        if gpus in META_MTTF_HOURS:
            return 1 / META_MTTF_HOURS[gpus]
        # between two reported scales: the per-GPU rate interpolated in log-log
        hi = next(g for g in known if g > gpus)
        lo = known[known.index(hi) - 1]
        per = {g: 1 / (META_MTTF_HOURS[g] * g) for g in (lo, hi)}
        w = math.log(gpus / lo) / math.log(hi / lo)
        return gpus * math.exp((1 - w) * math.log(per[lo]) + w * math.log(per[hi]))
    raise ValueError(f"unknown rate preset {preset!r}: one of {', '.join(RATE_PRESETS)}")


@dataclass(frozen=True)
class EttrRow:
    preset: str
    gpus: int
    """GPUs the job uses (``D P tp``)."""
    failures_per_hour: float
    failures: int
    """Failures drawn (every seed together)."""
    workers_removed: int
    """Workers those failures took (more than ``failures`` where a node holds several)."""
    checkpoint_efficiency: float
    """``1 - C / tau``: what every system keeps after its checkpoints (not counted in the ETTR)."""
    ettr: dict[str, float]
    samples_per_s: dict[str, float]


@dataclass
class EttrTable:
    config: dict
    rows: list[EttrRow] = field(default_factory=list)

    def systems(self) -> list[str]:
        return list(self.rows[0].ettr) if self.rows else []

    def row(self, preset: str, gpus: int) -> EttrRow:
        for row in self.rows:
            if row.preset == preset and row.gpus == gpus:
                return row
        raise KeyError(f"no row for {preset} at {gpus} GPUs")


def ettr_study(
    model: ModelSpec,
    stages: int,
    microbatches: int | None = None,
    scales: Sequence[int] = SCALES,
    presets: Sequence[str] = RATE_PRESETS,
    hours: float = 168.0,
    repair_hours: float = 2.0,
    spare_fraction: float = DEFAULT_SPARE_FRACTION,
    systems: Sequence[str] = ALL_SYSTEMS,
    params: SystemParams = SystemParams(),
    checkpointing: Checkpointing = Checkpointing(),
    seeds: Sequence[int] = (0,),
    failure_model: FailureModel | None = FailureModel(),
) -> EttrTable:
    """One Poisson study per (preset, scale); ``D = GPUs / tp / stages`` pipelines of ``stages``.
    ``repair_hours`` applies to the single-cause model (``failure_model=None``) only."""
    m = microbatches if microbatches is not None else 2 * stages
    rows = []
    for preset in presets:
        for gpus in scales:
            D = gpus // model.tp // stages
            if D < 1:
                raise ValueError(f"{gpus} GPUs make no pipeline of {stages} stages x tp {model.tp}")
            used = D * stages * model.tp
            rate = failures_per_hour(preset, used)
            job = Job(model, D, stages, m, checkpointing=checkpointing, failures_per_hour=rate)
            multiple = rate * 24 / used / LLAMA3_RATE_PER_GPU_DAY
            study = poisson(job, multiple, hours, repair_hours, spare_fraction, systems, params, seeds, failure_model)
            ettr = {name: study.ettr(name) or 0.0 for name in systems}
            rows.append(
                EttrRow(
                    preset,
                    used,
                    rate,
                    sum(entry["failures"] for entry in study.series),
                    sum(entry.get("workers_removed", entry["failures"]) for entry in study.series),
                    job.checkpoint_efficiency,
                    ettr,
                    {name: study.samples_per_s(name) for name in systems},
                )
            )
    config = {
        "model": model.name,
        "tp": model.tp,
        "stages": stages,
        "microbatches": m,
        "hours": hours,
        "failure_model": "causes" if failure_model is not None else "single",
        "repair_hours": repair_hours if failure_model is None else failure_model.repair_mean_hours,
        "recycle_detect_s": params.recycle.detect_s,
        "recycle_rebuild_s": params.recycle.rebuild_s,
        "spare_fraction": spare_fraction,
        "seeds": list(seeds),
    }
    return EttrTable(config, rows)


def text_table(table: EttrTable) -> str:
    cfg = table.config
    names = table.systems()
    if cfg["failure_model"] == "causes":
        repair = "Llama 3 causes, node-wide host/network failures, lognormal repair (mean h " + ", ".join(
            f"{k} {v:g}" for k, v in cfg["repair_hours"].items()
        )
        repair += ")"
    else:
        repair = f"single-GPU failures, repair {cfg['repair_hours']:g} h"
    lines = [
        f"ETTR: {cfg['model']} tp={cfg['tp']} P={cfg['stages']} m={cfg['microbatches']}, {cfg['hours']:g} h, "
        f"{repair}, spares {cfg['spare_fraction']:g}, seeds {len(cfg['seeds'])}, ReCycle detect "
        f"{cfg['recycle_detect_s']:g} s + rebuild {cfg['recycle_rebuild_s']:g} s",
        "(useful work / the same system's fault-free work in the same wall time; ckpt = 1 - C/tau, paid by every "
        "system and not counted)",
    ]
    header = f"{'rate':<7}{'GPUs':>7}{'MTTF h':>8}{'fails':>6}{'gone':>6}{'ckpt':>7}  " + "  ".join(
        f"{n:>15}" for n in names
    )
    lines.append(header)
    for row in table.rows:
        mttf = 1 / row.failures_per_hour if row.failures_per_hour > 0 else math.inf
        cells = "  ".join(f"{row.ettr[n]:15.4f}" for n in names)
        lines.append(
            f"{row.preset:<7}{row.gpus:>7}{mttf:8.2f}{row.failures:>6}{row.workers_removed:>6}"
            f"{row.checkpoint_efficiency:7.3f}  {cells}"
        )
    return "\n".join(lines)


def save_plot(table: EttrTable, path: str) -> None:
    """ETTR against GPUs (log scale), one panel per rate preset, one line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = list(dict.fromkeys(row.preset for row in table.rows))
    fig, axes = plt.subplots(1, len(presets), figsize=(6 * len(presets), 4.5), squeeze=False)
    for ax, preset in zip(axes[0], presets, strict=True):
        rows = [row for row in table.rows if row.preset == preset]
        for name in table.systems():
            ax.plot([r.gpus for r in rows], [r.ettr[name] for r in rows], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.set_ylabel("ETTR")
        ax.set_title(f"{preset} failure rate, {table.config['model']} P={table.config['stages']}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)
