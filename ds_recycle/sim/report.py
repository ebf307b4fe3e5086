"""Text tables, JSON and PNG for a :class:`~ds_recycle.sim.experiments.Study`."""

from __future__ import annotations

import json
from pathlib import Path

from ds_recycle.sim.experiments import Study


def text_report(study: Study) -> str:
    lines = [f"{study.experiment}: {study.config.get('label', '')}"]
    cfg = study.config
    lines.append(
        f"  {cfg['gpus']} GPUs (tp={cfg['tp']}), global batch {cfg['global_batch']} sequences, "
        f"checkpoint every {cfg['checkpoint_interval_s']:.0f} s (cost {cfg['checkpoint_cost_s']:g} s, "
        f"restart {cfg['restart_s']:g} s); ReCycle rebalancing: {cfg.get('recycle_rebalance', 'off')}"
    )
    names = list(study.runs)
    if study.rows:
        lines.append("")
        lines.append("samples/s over the window after f concurrent failures (steady rate after recovery in brackets)")
        header = f"{'f':>4}  " + "  ".join(f"{n:>22}" for n in names) + "   recycle: iter/bound  reroute-only"
        lines.append(header)
        for row in study.rows:
            cells = [f"{row.runs[n].samples_per_s:10.2f} ({row.steady[n]:9.2f})" for n in names]
            ref = row.recycle
            iteration, bound = ref.get("iteration_s"), ref.get("bound_s")
            reroute = ref.get("rerouting_only_samples_per_s")
            fits = isinstance(iteration, float) and isinstance(bound, float) and bound > 0
            extra = f"{iteration / bound:19.3f}" if fits else f"{'-':>19}"
            extra += f"  {reroute:12.2f}" if isinstance(reroute, float) else f"  {'-':>12}"
            lines.append(f"{row.failures:>4}  " + "  ".join(f"{c:>22}" for c in cells) + "   " + extra)
        lines.append("")
        lines.append("mean over the rows (samples/s, wall time, downtime included)")
    else:
        lines.append("")
    with_ettr = bool(study.fault_free)
    lines.append(
        f"{'system':<16}{'samples/s':>12}" + (f"{'ETTR':>8}" if with_ettr else "") + f"{'downtime s':>14}  events"
    )
    for name, run in study.runs.items():
        notes = ", ".join(f"{k} x{v}" for k, v in run.to_dict()["notes"].items()) or "-"
        value = study.ettr(name)
        cell = (f"{value:8.4f}" if value is not None else f"{'-':>8}") if with_ettr else ""
        lines.append(f"{name:<16}{run.samples_per_s:12.2f}{cell}{run.downtime:14.0f}  {notes}")
    lines.append(ratio_line(study))
    return "\n".join(lines)


def ratio_line(study: Study) -> str:
    """``max ratio recycle/oobleck X (at ...), recycle/bamboo Y (at ...)``; n/a where a system was
    not simulated or a baseline never ran (out of memory, down)."""
    ratios = study.ratios()
    parts = []
    for other in ("oobleck", "bamboo"):
        entry = ratios.get(f"recycle/{other}")
        if entry is None:
            parts.append(f"recycle/{other} n/a (not simulated)")
        elif entry["max"] is None:
            parts.append(f"recycle/{other} n/a ({other} never ran)")
        else:
            parts.append(f"recycle/{other} {entry['max']:.3f} (at {entry['at']})")
    return "max ratio " + ", ".join(parts)


def json_text(study: Study) -> str:
    return json.dumps(study.to_dict(segments=study.experiment != "sweep"), indent=1, allow_nan=False)


def save_png(study: Study, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    if study.rows:
        xs = [row.failures for row in study.rows]
        for name in study.runs:
            ax.plot(xs, [row.runs[name].samples_per_s for row in study.rows], marker="o", label=name)
        ax.set_xlabel("concurrent failed workers")
    else:
        for name, run in study.runs.items():
            xs, ys = [], []
            for start, end, rate in run.segments:
                xs += [start / 3600, end / 3600]
                ys += [rate, rate]
            ax.plot(xs, ys, label=f"{name} ({run.samples_per_s:.1f} avg)", linewidth=1)
        ax.set_xlabel("hours")
    ax.set_ylabel("samples/s")
    ax.set_title(study.config.get("label", study.experiment))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)
