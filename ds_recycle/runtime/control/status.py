"""A live, read-only view of a running job: the status page (``--status-port``) and ``ds-recycle status``.

:func:`read_status` reads everything fresh from the job's store, through a client of its own, and
writes nothing: the epoch and its members; per slot its worker, its state, its heartbeat age and
iteration time; per node its lease age; the coordinator's latest changes; and what the ranks
publish under ``status`` (:class:`~ds_recycle.runtime.shared.status_schema.StatusReport`): the plan the
members run (predicted iteration time against fault-free and the lower bound, the workers it routes
around, its Gantt chart) and the last membership changes with their detection and recovery
latencies. The measured throughput is the samples of one iteration over the slowest member's last
iteration time.

A slot's state: ``live``; ``slow`` (live, and the plan routes around it as a straggler); ``failed``
(its failure is published: it stays failed until its respawn asks to join); ``joining`` (its join
is accepted, not yet decided); ``leaving`` (its leave is accepted, not yet decided); ``out`` (it
left, or never joined).

:class:`StatusServer` serves ``GET /`` (an HTML page that reloads itself every two seconds: the
P x D grid of workers coloured by state, the plan against fault-free and the lower bound, the
measured throughput, the last changes and the plan's Gantt chart as SVG; no script, no form) and
``GET /status.json`` (the same as JSON). It binds to loopback unless told otherwise and answers
any other method with 405. Neither shows the job token or any request: only the keys above are read.
"""

from __future__ import annotations

import html
import json
import threading
import time
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ds_recycle.runtime.shared import records
from ds_recycle.runtime.shared.c10d_store import C10dJobStore
from ds_recycle.runtime.shared.job_store import JobStore
from ds_recycle.runtime.shared.records import Change, Membership
from ds_recycle.runtime.shared.status_schema import ChangeReport, StatusReport

LIVE, SLOW, FAILED, JOINING, LEAVING, OUT = "live", "slow", "failed", "joining", "leaving", "out"
STATES = (LIVE, SLOW, FAILED, JOINING, LEAVING, OUT)
COLOURS = {
    LIVE: "#2e9e44",
    SLOW: "#f08c00",
    FAILED: "#d62728",
    JOINING: "#1f77d4",
    LEAVING: "#e6c700",
    OUT: "#a0a0a0",
}
"""The page's colour of each state (the grid's cells and the legend)."""
PENDING_SHOWN = 20
REFRESH_SECONDS = 2
PIPELINE_COLOURS = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#17becf",
    "#bcbd22",
    "#7f7f7f",
    "#393b79",
)
"""The Gantt chart's colour of a micro-batch's home pipeline (F solid, B lighter, W lightest)."""
OP_OPACITY = {"F": 1.0, "B": 0.6, "W": 0.3}


@dataclass(frozen=True)
class SlotStatus:
    slot: int
    node: int
    worker: tuple[int, int] | None
    """``(pipeline, stage)``; None until the ranks published their first record."""
    state: str
    heartbeat_age_s: float | None
    iteration_s: float | None
    """The slot's last measured iteration time."""


@dataclass(frozen=True)
class NodeStatus:
    node: int
    lease_age_s: float | None
    """None on the coordinator's own node (its agent holds no lease) or before the first renewal."""


@dataclass(frozen=True)
class Measured:
    iteration_s: float | None
    """The slowest member's last iteration time."""
    samples_per_iteration: int | None
    samples_per_s: float | None


@dataclass(frozen=True)
class JobStatus:
    generation: int
    membership: Membership
    world_size: int
    nnodes: int
    slots: tuple[SlotStatus, ...]
    nodes: tuple[NodeStatus, ...]
    pending: tuple[Change, ...]
    """The coordinator's latest changes (at most :data:`PENDING_SHOWN`), oldest first."""
    report: StatusReport | None
    measured: Measured
    time: float

    def live(self) -> int:
        """Members still running (a leaving one runs until its boundary)."""
        return sum(slot.state in (LIVE, SLOW, LEAVING) for slot in self.slots)

    def to_dict(self) -> dict:
        """The JSON of ``/status.json`` and ``ds-recycle status --json``."""
        report = self.report
        plan = None
        if report is not None:
            p = report.plan
            plan = {
                "epoch": report.epoch,
                "plan_id": p.plan_id,
                "unit": p.unit,
                "failed": [list(w) for w in p.failed],
                "slow": [list(entry) for entry in p.slow],
                "predicted_iteration_time": p.predicted_iteration_time,
                "fault_free_iteration_time": p.fault_free_iteration_time,
                "lower_bound": p.lower_bound,
                "ratio_to_fault_free": _ratio(p.predicted_iteration_time, p.fault_free_iteration_time),
                "ratio_to_lower_bound": _ratio(p.predicted_iteration_time, p.lower_bound),
                "rerouted_microbatches": p.rerouted_microbatches,
                "gantt": {"ops": [op.to_list() for op in p.gantt], "omitted": p.gantt_omitted},
            }
        return {
            "generation": self.generation,
            "epoch": self.membership.epoch,
            "since_iteration": self.membership.iteration,
            "members": list(self.membership.members),
            "world_size": self.world_size,
            "nnodes": self.nnodes,
            "live": self.live(),
            "grid": None if report is None else {"pipelines": report.pipelines, "stages": report.stages},
            "slots": [asdict(slot) for slot in self.slots],
            "nodes": [asdict(node) for node in self.nodes],
            "pending": [asdict(change) for change in self.pending],
            "plan": plan,
            "measured": asdict(self.measured),
            "changes": [] if report is None else [asdict(change) for change in report.changes],
            "time": self.time,
        }


def read_status(store: JobStore, generation: int, nnodes: int | None = None) -> JobStatus:
    """The job's status, read from ``store`` (a client under the generation's prefix)."""
    membership = store.membership()
    world = store.world_size()
    if nnodes is None:
        nnodes = store.node_count() or 1
    per_node = max(1, world // max(1, nnodes))
    history = store.changes()
    report = store.status_report()
    leases = store.leases(list(range(nnodes)))
    beats = {slot: beat for lease in leases.values() for slot, beat in lease.beats.items()}
    now = time.time()
    last = {change.slot: change for change in history}
    slow = set() if report is None else {(p, s) for p, s, _ in report.plan.slow}
    slots = []
    for slot in range(world):
        worker = report.workers[slot] if report is not None and slot < len(report.workers) else None
        beat = beats.get(slot)
        slots.append(
            SlotStatus(
                slot=slot,
                node=slot // per_node,
                worker=worker,
                state=slot_state(slot in membership.members, last.get(slot), worker in slow),
                heartbeat_age_s=None if beat is None or beat.stopped else round(now - beat.time, 3),
                iteration_s=None if beat is None else beat.iteration_seconds,
            )
        )
    nodes = tuple(
        NodeStatus(node, round(now - leases[node].time, 3) if node in leases else None) for node in range(nnodes)
    )
    times = [slots[s].iteration_s for s in membership.members if slots[s].iteration_s]
    iteration = max(times, default=None)
    samples = None if report is None else report.samples_per_iteration
    measured = Measured(iteration, samples, None if iteration is None or samples is None else samples / iteration)
    return JobStatus(
        generation,
        membership,
        world,
        nnodes,
        tuple(slots),
        nodes,
        tuple(history[-PENDING_SHOWN:]),
        report,
        measured,
        now,
    )


def slot_state(member: bool, last: Change | None, slow: bool) -> str:
    """A slot's state from whether it is a member of the current epoch and its last change in
    ``pending`` (the whole history: a change not yet decided is the last one of its slot)."""
    if member:
        if last is not None and last.kind == records.FAILED:
            return FAILED
        if last is not None and last.kind in (records.LEAVE, records.MOVE):
            return LEAVING
        return SLOW if slow else LIVE
    if last is None or last.kind in (records.LEAVE, records.MOVE, records.RETIRED):
        return OUT
    return JOINING if last.kind == records.JOIN else FAILED


class StatusServer:
    """Serves :func:`read_status` as a page and as JSON (see the module doc); read-only."""

    def __init__(self, address: str, generation: int, token: str, host: str, port: int) -> None:
        self._store = C10dJobStore.connect(address, generation, token, timeout=5.0)
        self._lock = threading.Lock()
        self.generation = generation
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                self._answer(body=True)

            def do_HEAD(self) -> None:  # noqa: N802
                self._answer(body=False)

            def _answer(self, body: bool) -> None:
                path = self.path.split("?", 1)[0]
                if path not in ("/", "/status.json"):
                    self._send(404, "text/plain; charset=utf-8", "not found: try / or /status.json\n", body)
                    return
                try:
                    status = server.status()
                except Exception as exc:  # the store went away (the job ended) or answered late
                    self._send(503, "text/plain; charset=utf-8", f"the job's store did not answer: {exc}\n", body)
                    return
                if path == "/status.json":
                    self._send(200, "application/json", json.dumps(status.to_dict(), indent=1), body)
                else:
                    self._send(200, "text/html; charset=utf-8", page(status), body)

            def _refuse(self) -> None:
                self.send_response(405)
                self.send_header("Allow", "GET, HEAD")
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse

            def _send(self, code: int, kind: str, text: str, body: bool) -> None:
                data = text.encode()
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Cache-Control", "no-store")
                self.send_header("X-Content-Type-Options", "nosniff")
                self.send_header("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'")
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self._http = ThreadingHTTPServer((host, port), Handler)
        self.host, self.port = self._http.server_address[:2]
        self._thread = threading.Thread(target=self._http.serve_forever, name="recycle-status", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def start(self) -> StatusServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._http.shutdown()
        self._http.server_close()

    def status(self) -> JobStatus:
        with self._lock:
            return read_status(self._store, self.generation)


def _ratio(value: float, reference: float) -> float | None:
    return value / reference if reference else None


def _seconds(value: float | None, unit: str = "s") -> str:
    if value is None:
        return "-"
    return f"{value * 1e3:.0f} ms" if unit == "ms" else f"{value:.2f} s"


def _workers(workers) -> str:
    return ", ".join(f"({p}, {s})" for p, s in workers)


def describe_change(change: ChangeReport) -> str:
    """One change as the page and the terminal show it."""
    parts = [
        f"{kind} {_workers(getattr(change, kind))}" for kind in ("failed", "left", "joined") if getattr(change, kind)
    ]
    line = f"epoch {change.epoch} from iteration {change.iteration}: {'; '.join(parts) or 'no change of workers'}"
    line += f"; detected and decided in {_seconds(change.detection_seconds, 'ms')}, switched in "
    line += _seconds(change.switch_seconds, "ms")
    if change.recovery_seconds is not None:
        line += f", running again {_seconds(change.recovery_seconds, 'ms')} after the failure"
    return line + (", in-flight iteration rolled back" if change.rolled_back else "")


def describe_plan(status: JobStatus) -> list[str]:
    report = status.report
    measured = status.measured
    lines = []
    if report is not None:
        p = report.plan
        ff = _ratio(p.predicted_iteration_time, p.fault_free_iteration_time)
        lb = _ratio(p.predicted_iteration_time, p.lower_bound)
        lines.append(
            f"plan {p.plan_id} (epoch {report.epoch}): predicts {p.predicted_iteration_time:.1f} {p.unit} "
            f"per iteration = "
            f"{_times(ff)} fault-free ({p.fault_free_iteration_time:.1f}), {_times(lb)} the lower bound "
            f"({p.lower_bound:.1f}); {p.rerouted_microbatches} micro-batch stage-ops re-routed"
        )
        if p.failed:
            lines.append(f"routed around failed workers {_workers(p.failed)}")
        if p.slow:
            lines.append("routed around stragglers " + ", ".join(f"({q}, {s}) x{f:.2f}" for q, s, f in p.slow))
    else:
        lines.append("plan: not published yet (the ranks publish it once they start training)")
    if measured.iteration_s is not None:
        rate = "" if measured.samples_per_s is None else f", {measured.samples_per_s:.1f} samples/s"
        per = "" if measured.samples_per_iteration is None else f" ({measured.samples_per_iteration} per iteration)"
        lines.append(f"measured: {measured.iteration_s * 1e3:.0f} ms per iteration{rate}{per}")
    else:
        lines.append("measured: no iteration finished yet")
    return lines


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _grid_rows(status: JobStatus) -> tuple[list[str], list[list[SlotStatus | None]]] | None:
    report = status.report
    if report is None:
        return None
    cells: list[list[SlotStatus | None]] = [[None] * report.pipelines for _ in range(report.stages)]
    for slot in status.slots:
        if slot.worker is not None:
            cells[slot.worker[1]][slot.worker[0]] = slot
    return [f"pipeline {p}" for p in range(report.pipelines)], cells


# ---- the page ------------------------------------------------------------------------------------

STYLE = (
    "body{font:14px/1.4 system-ui,sans-serif;margin:16px 24px;color:#222;background:#fff}"
    "h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:18px 0 6px}"
    "table{border-collapse:collapse}td,th{padding:3px 8px;text-align:left}"
    ".data td,.data th{border-bottom:1px solid #ddd}"
    ".grid td.cell{width:104px;height:44px;color:#fff;text-align:center;border:3px solid #fff;"
    "font-weight:600}.grid td.cell small{font-weight:400}.grid th{text-align:center}"
    ".legend span{display:inline-block;padding:1px 8px;margin-right:8px;border-left:14px solid;"
    "border-color:var(--c)}.muted{color:#777}"
    + "".join(f".s-{state}{{background:{colour}}}" for state, colour in COLOURS.items())
)


def page(status: JobStatus) -> str:
    """The status page: HTML with inline CSS and SVG, no script and no form."""
    e = html.escape
    report = status.report
    title = f"epoch {status.membership.epoch} (from iteration {status.membership.iteration})"
    parts = [
        "<!doctype html><html lang=en><meta charset=utf-8>",
        f"<meta http-equiv=refresh content={REFRESH_SECONDS}>",
        f"<title>ds-recycle: {e(title)}</title><style>{STYLE}</style>",
        f"<h1>ds-recycle job: {e(title)}</h1>",
        f"<p id=summary>{status.live()} of {status.world_size} workers live &middot; generation "
        f"{status.generation} &middot; {status.nnodes} node(s) &middot; "
        f"{time.strftime('%H:%M:%S', time.localtime(status.time))}</p>",
        "<h2>Workers</h2>",
        _grid_html(status),
        "<p class=legend>"
        + "".join(f"<span style='--c:{COLOURS[s]}'>{s}</span>" for s in STATES)
        + "</p><h2>Plan</h2><ul id=plan>"
        + "".join(f"<li>{e(line)}</li>" for line in describe_plan(status))
        + "</ul><h2>Last changes</h2>",
    ]
    changes = [] if report is None else list(reversed(report.changes))
    if changes:
        parts.append(
            "<table class=data id=changes><tr><th>epoch<th>from iteration<th>failed<th>left<th>joined"
            "<th>detected and decided<th>switched<th>running again after the failure<th>rolled back</tr>"
        )
        for c in changes:
            parts.append(
                f"<tr><td>{c.epoch}<td>{c.iteration}<td>{e(_workers(c.failed))}<td>{e(_workers(c.left))}"
                f"<td>{e(_workers(c.joined))}<td>{_seconds(c.detection_seconds, 'ms')}"
                f"<td>{_seconds(c.switch_seconds, 'ms')}<td>{_seconds(c.recovery_seconds, 'ms')}"
                f"<td>{'yes' if c.rolled_back else 'no'}</tr>"
            )
        parts.append("</table>")
    else:
        parts.append("<p class=muted>none since the start</p>")
    parts.append("<h2>The coordinator's latest events</h2>")
    if status.pending:
        parts.append("<table class=data id=pending><tr><th>#<th>kind<th>slot<th>seconds ago<th>detail</tr>")
        for c in reversed(status.pending):
            parts.append(
                f"<tr><td>{c.seq}<td>{e(c.kind)}<td>{c.slot}<td>{status.time - c.time:.1f}<td>{e(c.detail)}</tr>"
            )
        parts.append("</table>")
    else:
        parts.append("<p class=muted>none</p>")
    parts.append("<h2>The plan's Gantt chart</h2>")
    parts.append(gantt_svg(status) if report is not None else "<p class=muted>not published yet</p>")
    if status.nnodes > 1:
        parts.append("<h2>Nodes</h2><table class=data id=nodes><tr><th>node<th>lease age</tr>")
        parts += [f"<tr><td>{n.node}<td>{_seconds(n.lease_age_s)}</tr>" for n in status.nodes]
        parts.append("</table>")
    return "".join(parts) + "</html>\n"


def _grid_html(status: JobStatus) -> str:
    rows = _grid_rows(status)
    if rows is None:
        header, cells, labels = ["" for _ in status.slots], [list(status.slots)], ["slots"]
    else:
        header, cells = rows
        labels = [f"stage {s}" for s in range(len(cells))]
    out = ["<table class=grid id=grid><tr><th>" + "".join(f"<th>{h}" for h in header) + "</tr>"]
    for label, row in zip(labels, cells, strict=True):
        out.append(f"<tr><th>{label}")
        for slot in row:
            if slot is None:
                out.append("<td>")
                continue
            where = "" if slot.worker is None else f" worker {slot.worker}"
            tip = f"slot {slot.slot}{where} node {slot.node}: heartbeat {_seconds(slot.heartbeat_age_s)} ago"
            tip += f", iteration {_seconds(slot.iteration_s)}"
            out.append(
                f"<td class='cell s-{slot.state}' id=slot-{slot.slot} data-state={slot.state} "
                f"title='{html.escape(tip)}'>"
                f"slot {slot.slot}<br><small>{slot.state}</small>"
            )
        out.append("</tr>")
    return "".join(out) + "</table>"


def gantt_svg(status: JobStatus) -> str:
    """The published plan's Gantt chart: one row per worker, one bar per op, coloured by the
    micro-batch's home pipeline (F solid, B lighter, W lightest; S black); failed workers dashed."""
    report = status.report
    plan = report.plan
    rows = [(p, s) for p in range(report.pipelines) for s in range(report.stages)]
    failed = set(plan.failed)
    makespan = max((op.end for op in plan.gantt), default=0.0) or 1.0
    left, width, height = 110, 900, 18
    scale = width / makespan
    out = [
        f"<svg id=gantt xmlns='http://www.w3.org/2000/svg' width={left + width + 10} "
        f"height={height * len(rows) + 24} font-size=11 font-family=sans-serif>"
    ]
    y_of = {worker: 4 + i * height for i, worker in enumerate(rows)}
    for worker, y in y_of.items():
        out.append(f"<text x=4 y={y + 12}>worker ({worker[0]}, {worker[1]})</text>")
        if worker in failed:
            out.append(
                f"<rect x={left} y={y + 2} width={width} height={height - 4} fill=none stroke='#999' "
                f"stroke-dasharray='4 3'/><text x={left + width / 2} y={y + 12} fill='#777'>failed</text>"
            )
    for op in plan.gantt:
        y = y_of.get((op.pipeline, op.stage))
        if y is None:
            continue
        x, w = left + op.start * scale, max(2.0, (op.end - op.start) * scale)
        if op.kind == "S":
            fill, opacity, stroke = "#000", 1.0, "none"
        else:
            fill, opacity = PIPELINE_COLOURS[op.home % len(PIPELINE_COLOURS)], OP_OPACITY.get(op.kind, 1.0)
            stroke = "#fff"
        label = f"{op.kind}{op.home}.{op.mb}" if op.kind != "S" else "S"
        out.append(
            f"<rect x={x:.1f} y={y + 2} width={w:.1f} height={height - 4} fill='{fill}' "
            f"fill-opacity={opacity} stroke='{stroke}'>"
            f"<title>{label} on ({op.pipeline}, {op.stage}): {op.start:g}-{op.end:g} {plan.unit}</title></rect>"
        )
    axis = height * len(rows) + 18
    out.append(f"<text x={left} y={axis}>0</text><text x={left + width - 60} y={axis}>{makespan:g} {plan.unit}</text>")
    if plan.gantt_omitted:
        out.append(f"<text x={left + 200} y={axis}>{plan.gantt_omitted} ops not shown</text>")
    return "".join(out) + "</svg>"


# ---- the terminal --------------------------------------------------------------------------------


def text(status: JobStatus, where: str) -> str:
    """What ``ds-recycle status`` prints: the page's content for a terminal."""
    from ds_recycle.planner.plan import CostModel, Op, Plan
    from ds_recycle.planner.viz import text_gantt

    m = status.membership
    lines = [
        f"ds-recycle job at {where}, generation {status.generation}: epoch {m.epoch} from iteration "
        f"{m.iteration}, {status.live()} of {status.world_size} workers live"
    ]
    rows = _grid_rows(status)
    if rows is None:
        lines.append("slots: " + ", ".join(f"{s.slot} {s.state}" for s in status.slots))
    else:
        header, cells = rows
        lines.append("workers (stage x pipeline):")
        lines.append(f"  {'':9}" + "".join(f"{h:<16}" for h in header))
        for stage, row in enumerate(cells):
            shown = [
                "" if s is None else f"slot {s.slot} {s.state.upper() if s.state != LIVE else s.state}" for s in row
            ]
            lines.append(f"  {f'stage {stage}':9}" + "".join(f"{c:<16}" for c in shown))
    lines += describe_plan(status)
    report = status.report
    lines.append("last changes:" if report is not None and report.changes else "last changes: none")
    if report is not None:
        lines += [f"  {describe_change(c)}" for c in report.changes]
    lines.append("coordinator's latest events:" if status.pending else "coordinator's latest events: none")
    lines += [
        f"  #{c.seq} {c.kind} slot {c.slot}, {status.time - c.time:.1f} s ago{f' ({c.detail})' if c.detail else ''}"
        for c in status.pending[-8:]
    ]
    if report is not None and report.plan.gantt:
        plan = report.plan
        workers: dict[tuple[int, int], list[Op]] = {}
        for op in plan.gantt:
            workers.setdefault((op.pipeline, op.stage), []).append(
                Op(op.kind, op.home, op.mb, op.stage, op.start, op.end)
            )
        gantt = Plan(
            report.pipelines,
            report.stages,
            report.microbatches,
            tuple(plan.failed),
            CostModel.uniform(report.stages),
            0,
            workers,
        )
        lines.append(f"the plan's Gantt chart ({plan.unit}):")
        lines.append(text_gantt(gantt, max_columns=60))
    return "\n".join(lines)
