"""Gantt views of a Plan: text for terminals, PNG (matplotlib, Agg) for reports.

Text: one row per worker ``(pipeline, stage)``, one column per time slot. A cell shows the op that
covers the middle of the slot: ``F``, ``B`` or ``W`` followed by the home pipeline of the
micro-batch (``F0``, ``B2``...), ``S`` for the step and ``.`` for idle; failed workers show ``x``.
PNG: the same rows; colour = home pipeline, F solid, B lighter and hatched, W lightest and dotted,
every bar lettered when wide enough; S is a black bar; failed workers are empty grey rows.
"""

from __future__ import annotations

from pathlib import Path

from ds_recycle.planner.plan import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, STEP, Op, Plan, Worker

CELL = 2
"""Characters per time slot in the text Gantt (op letter + home pipeline digit)."""


def text_gantt(plan: Plan, max_columns: int = 120) -> str:
    """The plan as text. Time is split into slots of the smallest positive op duration, or coarser
    so that at most ``max_columns`` slots fit on a line."""
    makespan = max((op.end for ops in plan.workers.values() for op in ops), default=0.0)
    durations = [op.end - op.start for ops in plan.workers.values() for op in ops if op.end > op.start]
    unit = min(durations, default=1.0)
    if makespan <= 0:
        unit = 1.0
    slots = max(1, int(round(makespan / unit + 0.4999)))
    if slots > max_columns:
        unit = makespan / max_columns
        slots = max_columns
    slots += 1  # a zero-length step at the very end still gets a column
    failed = {tuple(w) for w in plan.failed}
    rows = _all_workers(plan)
    label_width = max(len(_row_label(w)) for w in rows) + 1
    lines = [
        f"{'':{label_width}}time 0 .. {makespan:g}, one column = {unit:g}; F/B/W + home pipeline, S = step, . = idle",
    ]
    for worker in rows:
        label = _row_label(worker)
        if worker in failed:
            lines.append(f"{label:{label_width}}" + "x" * (CELL * slots) + "  failed")
            continue
        cells = ["." * CELL] * slots
        for op in plan.workers.get(worker, []):
            first = int(op.start / unit + 1e-9)
            last = max(first + 1, int(op.end / unit - 1e-9) + 1) if op.end > op.start else first + 1
            for slot in range(first, min(last, slots)):
                if op.end > op.start or cells[slot] == "." * CELL:  # an instant op never hides work
                    cells[slot] = _cell(op)
        lines.append(f"{label:{label_width}}" + "".join(cells))
    return "\n".join(lines)


def save_png(plan: Plan, path: str | Path, title: str | None = None) -> Path:
    """Write the plan's Gantt chart to ``path`` (PNG) and return the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = _all_workers(plan)
    failed = {tuple(w) for w in plan.failed}
    makespan = max((op.end for ops in plan.workers.values() for op in ops), default=1.0) or 1.0
    colours = plt.get_cmap("tab10" if plan.pipelines <= 10 else "tab20")
    height = max(2.5, 0.38 * len(rows) + 1.4)
    width = min(24.0, max(8.0, makespan * 0.25 + 2.5))
    fig, ax = plt.subplots(figsize=(width, height), dpi=110)
    style = {
        FORWARD: {"alpha": 1.0, "hatch": None},
        BACKWARD_INPUT: {"alpha": 0.65, "hatch": "//"},
        BACKWARD_WEIGHT: {"alpha": 0.35, "hatch": ".."},
    }
    for y, worker in enumerate(rows):
        if worker in failed:
            ax.broken_barh([(0, makespan)], (y - 0.4, 0.8), facecolors="none", edgecolors="0.6", linestyles="--")
            ax.text(makespan / 2, y, "failed", ha="center", va="center", fontsize=8, color="0.4")
            continue
        for op in plan.workers.get(worker, []):
            duration = max(op.end - op.start, 0.0)
            if op.kind == STEP:
                ax.broken_barh([(op.start, max(duration, makespan * 0.004))], (y - 0.4, 0.8), facecolors="black")
                continue
            colour = colours(op.home % colours.N)
            kind = style[op.kind]
            ax.broken_barh(
                [(op.start, duration)],
                (y - 0.4, 0.8),
                facecolors=colour,
                alpha=kind["alpha"],
                edgecolors="black",
                linewidth=0.4,
                hatch=kind["hatch"],
            )
            if duration >= makespan / 90:
                ax.text(op.start + duration / 2, y, f"{op.kind}{op.mb}", ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([_row_label(w) for w in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, makespan * 1.01)
    ax.set_xlabel("time (cost-model units)")
    ax.set_ylabel("worker (pipeline, stage)")
    failures = ", ".join(f"({p},{s})" for p, s in sorted(failed)) or "none"
    ax.set_title(
        title
        or (
            f"{plan.solver} plan: D={plan.pipelines} P={plan.stages} m={plan.microbatches}, failed {failures}; "
            f"iteration {plan.iteration_time:g}, lower bound {plan.lower_bound:g}"
        ),
        fontsize=9,
    )
    handles = [Patch(facecolor=colours(h % colours.N), label=f"home pipeline {h}") for h in range(plan.pipelines)]
    handles += [
        Patch(facecolor="0.5", alpha=style[FORWARD]["alpha"], label="F forward"),
        Patch(facecolor="0.5", alpha=style[BACKWARD_INPUT]["alpha"], hatch="//", label="B backward-input"),
        Patch(facecolor="0.5", alpha=style[BACKWARD_WEIGHT]["alpha"], hatch="..", label="W backward-weight"),
        Patch(facecolor="black", label="S step"),
    ]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def _all_workers(plan: Plan) -> list[Worker]:
    """Every worker of the grid, pipeline-major, so a pipeline's stages sit together."""
    return [(p, s) for p in range(plan.pipelines) for s in range(plan.stages)]


def _row_label(worker: Worker) -> str:
    return f"p{worker[0]} s{worker[1]}"


def _cell(op: Op) -> str:
    if op.kind == STEP:
        return "S" * CELL
    return f"{op.kind}{op.home % 10}"
