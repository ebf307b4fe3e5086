"""Node availability traces: ``time_ms,add|remove,node_name`` lines.

The public traces of Bamboo and Oobleck ship with the package in ``ds_recycle/sim/data/traces/``
(their README gives the source and licence of each); :func:`find_trace` takes one by name.

Times are milliseconds from the start of the trace, never decreasing; events at one instant share
their time. A node is added before it is removed, and not added twice while present. The replay
starts at the first event: the nodes added then are the initial nodes; it ends at the last event.
Any other content is refused with a :class:`TraceError` naming the line and what was expected.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from ds_recycle.sim.timeline import Event

MAX_TRACE_BYTES = 16 << 20
"""The shipped traces are under 8 KiB; 16 MiB is ~500k events."""
MAX_TIME_MS = 1e12
"""About 31 years."""
_NAME = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")
_TIME = re.compile(r"^\d{1,13}(\.\d{1,6})?$")


class TraceError(ValueError):
    """A trace file that cannot be replayed: the message names the line and the expected format."""


@dataclass(frozen=True)
class Trace:
    name: str
    initial: tuple[str, ...]
    """Nodes present at the start (added at the first event's time)."""
    events: tuple[Event, ...]
    """Later events, times in seconds from the start."""
    duration: float
    """Seconds from the first to the last event."""
    peak: int
    """Most nodes present at once."""
    removals: int


def read_trace(path: str | Path) -> Trace:
    file = Path(path)
    expected = "expected lines 'time_ms,add|remove,node_name' with non-decreasing times"
    try:
        if not file.is_file():
            raise TraceError(f"{path}: no such file ({expected})")
        size = file.stat().st_size
        if size > MAX_TRACE_BYTES:
            raise TraceError(f"{path}: {size:,} bytes; at most {MAX_TRACE_BYTES:,} allowed")
        raw = file.read_bytes()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise TraceError(f"{path}: not UTF-8 text; {expected}") from None
    return parse_trace(text, file.stem, str(path))


def parse_trace(text: str, name: str = "trace", where: str = "trace") -> Trace:
    expected = "expected 'time_ms,add|remove,node_name' with non-decreasing times"
    present: set[str] = set()
    rows: list[tuple[float, str, str]] = []
    last = -math.inf
    peak = removals = 0
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        shown = line if len(line) <= 60 else line[:57] + "..."
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            raise TraceError(f"{where} line {number}: {shown!r} has {len(parts)} fields; {expected}")
        time_text, kind, node = parts
        if not _TIME.match(time_text):
            raise TraceError(f"{where} line {number}: time {time_text[:30]!r} is not a number of ms >= 0; {expected}")
        time = float(time_text)
        if not time <= MAX_TIME_MS:
            raise TraceError(
                f"{where} line {number}: time {time_text[:30]} ms is out of range: allowed 0..{MAX_TIME_MS:g}"
            )
        if time < last:
            raise TraceError(f"{where} line {number}: time {time_text} ms is before the previous line's; {expected}")
        if kind not in ("add", "remove"):
            raise TraceError(f"{where} line {number}: event {kind[:20]!r} must be add or remove; {expected}")
        if not _NAME.match(node):
            raise TraceError(
                f"{where} line {number}: node name {node[:30]!r} must be 1-128 characters of letters, digits, _.:-"
            )
        if kind == "add":
            if node in present:
                raise TraceError(f"{where} line {number}: {node} is added twice without a removal; {expected}")
            present.add(node)
            peak = max(peak, len(present))
        else:
            if node not in present:
                raise TraceError(f"{where} line {number}: {node} is removed but not present; {expected}")
            present.remove(node)
            removals += 1
        last = time
        rows.append((time, kind, node))
    if not rows:
        raise TraceError(f"{where}: no events; {expected}")
    start = rows[0][0]
    initial = tuple(node for t, kind, node in rows if t == start and kind == "add")
    later = [r for r in rows if r[0] != start]
    removed_at_start = [node for t, kind, node in rows if t == start and kind == "remove"]
    initial = tuple(n for n in initial if n not in removed_at_start)
    events = tuple(Event((t - start) / 1e3, kind, node) for t, kind, node in later)
    duration = (rows[-1][0] - start) / 1e3
    if duration <= 0:
        raise TraceError(f"{where}: every event is at one instant; a trace needs a duration > 0")
    if peak == 0:
        raise TraceError(f"{where}: no node is ever added; {expected}")
    return Trace(name, initial, events, duration, peak, removals)


def shipped_traces(root: str | Path | None = None) -> list[Path]:
    """The CSV traces shipped with the package (or those in ``root``), sorted by name."""
    base = Path(root) if root is not None else default_trace_dir()
    return sorted(base.glob("*.csv")) if base.is_dir() else []


def shipped_trace_names() -> list[str]:
    """The names :func:`find_trace` accepts: the shipped files without ``.csv``."""
    return [path.stem for path in shipped_traces()]


def find_trace(name_or_path: str | Path) -> Path:
    """A trace file: ``name_or_path`` itself when it is a file, else the shipped trace of that name
    (``bamboo-p3`` or ``bamboo-p3.csv``). Raises :class:`TraceError` naming the allowed names."""
    path = Path(name_or_path)
    try:
        if path.is_file():
            return path
    except (OSError, ValueError):  # an embedded NUL, a name too long for the system...
        pass
    text = str(name_or_path)
    stem = text[:-4] if text.endswith(".csv") else text
    for shipped in shipped_traces():
        if shipped.stem == stem:
            return shipped
    shown = text if len(text) <= 80 else text[:77] + "..."
    names = ", ".join(shipped_trace_names()) or "none shipped"
    raise TraceError(
        f"{shown}: no such file and no shipped trace of that name; allowed: a file of "
        f"'time_ms,add|remove,node_name' lines or a shipped name ({names})"
    )


def default_trace_dir() -> Path:
    """Where the package keeps its traces: ``ds_recycle/sim/data/traces``."""
    return Path(__file__).resolve().parent / "data" / "traces"
