"""``ds-recycle``: the command-line entry point.

Subcommands are registered in :data:`COMMANDS` (name -> :class:`Command`); only implemented ones
are listed, so ``ds-recycle --help`` never advertises something that does not run. ``simulate``
and ``launch`` plug in the same way.

Exit codes: 0 success, 2 bad arguments (argparse's convention, also used for a failure set that
leaves a stage without survivors: that needs a checkpoint fallback, not a plan).

A bad argument prints one line, ``ds-recycle COMMAND: error: ...``, naming the argument and the
allowed values (no usage block, no traceback), and nothing else: every argument, the size limits
(ds_recycle/planner/limits.py) and the output paths are checked before the long work starts, and
output files are written to a temporary name and renamed, so a failed run leaves none behind.

Nothing here imports DeepSpeed: ``ds-recycle --help`` and ``ds-recycle plan`` stay fast. A command
imports what it needs inside its ``run``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ds_recycle.planner.limits import LIMITS, LimitError, check_costs, check_png, check_problem, duration_range
from ds_recycle.runtime import launch_cli
from ds_recycle.sim import cli as simulate_cli

USAGE_ERROR = 2


class UsageError(Exception):
    """A bad argument: the message names the problem and the allowed values."""


@dataclass(frozen=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error (``PROG: error: MESSAGE``, exit 2) instead of usage + error."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(USAGE_ERROR, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


class StoreOnce(argparse.Action):
    """Store an option's value, refusing a second occurrence (``-D 2 --pipelines 3`` included)."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = namespace.__dict__.setdefault("_given_options", {})
        if self.dest in given:
            raise argparse.ArgumentError(
                self, f"given twice ({given[self.dest]} and {option_string} {values}); give it once"
            )
        given[self.dest] = f"{option_string} {values}"
        setattr(namespace, self.dest, values)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed its one line to stderr (or the help)
        return int(exc.code) if isinstance(exc.code, int) else USAGE_ERROR
    try:
        return COMMANDS[args.command].run(args)
    except UsageError as exc:
        print(f"ds-recycle {args.command}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return USAGE_ERROR


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="ds-recycle", description="ReCycle for DeepSpeed pipelines: plans for failure sets.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=Parser)
    for name, command in COMMANDS.items():
        subparser = sub.add_parser(name, help=command.help, description=command.help)
        command.add_arguments(subparser)
        _store_once(subparser)
    return parser


def _store_once(parser: argparse.ArgumentParser) -> None:
    """Every single-valued option of every subcommand may be given once: ``--x 1 --x 2`` is a
    contradiction, not "the last one wins"."""
    for action in parser._actions:
        if type(action) is argparse._StoreAction and action.option_strings:
            action.__class__ = StoreOnce


# ----- argument types: each names the allowed values -------------------------------------------


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer in ``low..high``."""

    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not an integer: allowed {low}..{high}") from None
        if not low <= value <= high:
            shown = str(value) if len(str(value)) <= 40 else f"{str(value)[:20]}...({len(str(value))} digits)"
            raise argparse.ArgumentTypeError(f"{shown} is out of range: allowed {low}..{high}")
        return value

    return convert


def float_in(
    low: float, high: float, *, low_open: bool = False, zero: bool = False, cost: str | None = None
) -> Callable[[str], float]:
    """An argparse type: a finite number in ``[low, high]`` (``(low, high]`` if ``low_open``), or 0
    when ``zero``; ``cost`` names a cost-model duration in the message for a negative value."""
    left = "(" if low_open else "["
    allowed = f"allowed {'0 or ' if zero else ''}{left}{low:g}, {high:g}]"

    def convert(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a number: {allowed}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not finite: {allowed}")
        if zero and value == 0:
            return 0.0
        if value < low or (low_open and value == low) or value > high:
            if value < 0 and cost is not None:
                raise argparse.ArgumentTypeError(f"negative cost {cost} = {value:g}: {allowed}")
            raise argparse.ArgumentTypeError(f"{value:g} is out of range: {allowed}")
        return value

    return convert


def duration(name: str) -> Callable[[str], float]:
    """An argparse type for the cost-model duration ``name`` (``comm``, ``step``): 0 or in [1e-3, 1e6]."""
    return float_in(LIMITS.min_duration, LIMITS.max_duration, zero=True, cost=name)


# ----- plan -----------------------------------------------------------------------------------


def _add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    lim = LIMITS
    parser.add_argument(
        "--pipelines",
        "-D",
        type=int_in(1, lim.max_pipelines),
        required=True,
        help=f"data-parallel pipelines D (1..{lim.max_pipelines})",
    )
    parser.add_argument(
        "--stages",
        "-P",
        type=int_in(1, lim.max_stages),
        required=True,
        help=f"pipeline stages P (1..{lim.max_stages})",
    )
    parser.add_argument(
        "--microbatches",
        "-m",
        type=int_in(1, lim.max_microbatches),
        required=True,
        help=f"micro-batches per pipeline per iteration (1..{lim.max_microbatches}); 3*D*P*m <= {lim.max_ops:,}",
    )
    parser.add_argument(
        "--fail",
        action="append",
        default=[],
        metavar="p:s",
        help="a failed worker (pipeline p, stage s); repeat for several (also p:s,p:s); each worker once",
    )
    costs = parser.add_mutually_exclusive_group()
    costs.add_argument(
        "--costs",
        metavar="F,B,W",
        help=f"durations of F, B and W, the same on every stage (default 1,1,1; each {duration_range()})",
    )
    costs.add_argument(
        "--cost-file",
        metavar="FILE",
        help="JSON or YAML with F, B, W lists (one value per stage) and optional comm and step",
    )
    parser.add_argument(
        "--comm",
        type=duration("comm"),
        default=None,
        metavar="C",
        help="p2p latency between workers (default 0)",
    )
    parser.add_argument(
        "--step", type=duration("step"), default=None, metavar="T", help="duration of S: all-reduce + optimizer"
    )
    parser.add_argument(
        "--memory-cap",
        type=int_in(1, lim.max_memory_cap),
        default=None,
        metavar="N",
        help=f"micro-batches a worker may hold (default P; 1..{lim.max_memory_cap})",
    )
    parser.add_argument(
        "--solver",
        choices=("heuristic", "milp"),
        default="heuristic",
        help=f"milp: only up to 3*D*P*m = {lim.max_milp_ops:,} ops",
    )
    parser.add_argument(
        "--time-limit",
        type=float_in(0, lim.max_time_limit, low_open=True),
        default=10.0,
        metavar="S",
        help=f"MILP time limit in seconds (0, {lim.max_time_limit:g}]",
    )
    parser.add_argument("--json", metavar="OUT", help="write the plan as JSON")
    parser.add_argument(
        "--png",
        metavar="OUT.png",
        help=f"write a Gantt chart as PNG (at most {lim.max_png_rows} workers, {lim.max_png_ops:,} ops)",
    )
    parser.add_argument(
        "--width",
        type=int_in(lim.min_width, lim.max_width),
        default=120,
        help=f"maximum columns of the text Gantt ({lim.min_width}..{lim.max_width})",
    )


def _run_plan(args: argparse.Namespace) -> int:
    from ds_recycle.planner.lower_bound import NoSurvivorError, check_survivors

    D, P, m = args.pipelines, args.stages, args.microbatches
    try:
        check_problem(D, P, m, args.solver)
    except LimitError as exc:
        flag = "--solver milp with " if args.solver == "milp" and "MILP" in str(exc) else ""
        raise UsageError(f"{flag}--pipelines/--stages/--microbatches: {exc}") from None
    failed = parse_failures(args.fail, D, P)
    costs = load_costs(args, P)
    outputs = Outputs.prepare(args, D, P, m)
    try:
        try:
            check_survivors(D, P, failed)
        except NoSurvivorError as exc:
            raise UsageError(f"--fail: {exc}") from exc

        if args.solver == "milp":
            from ds_recycle.planner.milp import plan_milp

            plan = plan_milp(D, P, m, failed, costs, args.memory_cap, time_limit=args.time_limit)
        else:
            from ds_recycle.planner.heuristic import plan_heuristic

            plan = plan_heuristic(D, P, m, failed, costs, args.memory_cap)

        from ds_recycle.planner.viz import text_gantt

        print(text_gantt(plan, max_columns=args.width))
        print()
        print(format_figures(plan))
        for line in outputs.write(plan):
            print(line)
    finally:
        outputs.discard()
    return 0


@dataclass
class Outputs:
    """The ``--json`` and ``--png`` files: checked and opened (as temporary files next to their
    targets) before planning, renamed into place only when everything is written."""

    json: Path | None = None
    png: Path | None = None
    temporary: dict[str, Path] = field(default_factory=dict)

    @classmethod
    def prepare(cls, args: argparse.Namespace, D: int, P: int, m: int) -> Outputs:
        out = cls()
        targets = {"--json": args.json, "--png": args.png}
        for flag, value in targets.items():
            if value is not None:
                setattr(out, flag[2:], _check_output_path(flag, value, getattr(args, "cost_file", None)))
        if out.json is not None and out.png is not None and _same_path(out.json, out.png):
            raise UsageError(f"--json and --png name the same file {args.json}: give two different paths")
        if out.png is not None:
            if out.png.suffix.lower() != ".png":
                raise UsageError(f"--png {args.png}: the file name must end in .png")
            try:
                check_png(D, P, m)
            except LimitError as exc:
                raise UsageError(f"--png: {exc}; leave out --png (the text Gantt and --json have no limit)") from None
        try:
            for flag in targets:
                path = getattr(out, flag[2:])
                if path is not None:
                    out.temporary[flag] = _temporary_next_to(flag, path)
        except BaseException:
            out.discard()
            raise
        return out

    def write(self, plan) -> list[str]:
        """Write every output to its temporary file, then rename them all into place."""
        lines = []
        try:
            if self.json is not None:
                self.temporary["--json"].write_text(plan.to_json())
            if self.png is not None:
                from ds_recycle.planner.viz import save_png

                save_png(plan, self.temporary["--png"])
        except OSError as exc:
            raise UsageError(f"writing the output failed: {exc.strerror or exc}") from None
        mode = 0o666 & ~_umask()
        for flag, target, what in (("--json", self.json, "plan"), ("--png", self.png, "Gantt chart")):
            if target is not None:
                temporary = self.temporary.pop(flag)
                os.chmod(temporary, mode)
                os.replace(temporary, target)
                lines.append(f"{what} written to {target}")
        return lines

    def discard(self) -> None:
        for path in self.temporary.values():
            try:
                path.unlink()
            except OSError:
                pass
        self.temporary.clear()


def _check_output_path(flag: str, value: str, cost_file: str | None) -> Path:
    shown = value if len(value) <= 80 else value[:77] + "..."
    try:
        path = Path(value)
        if value == "" or path.is_dir():
            raise UsageError(f"{flag} {shown!r}: is a directory; give a file path")
        parent = path.parent
        if not parent.is_dir():
            raise UsageError(f"{flag} {shown}: directory {str(parent)[:80]} does not exist; give a path in a directory")
        if len(path.name.encode("utf-8", "surrogateescape")) > 255:
            raise UsageError(f"{flag} {shown}: the file name is longer than 255 bytes")
        if path.exists() and not path.is_file():
            raise UsageError(f"{flag} {shown}: exists and is not a regular file; give a file path")
        if cost_file is not None and path.exists() and _same_path(path, Path(cost_file)):
            raise UsageError(f"{flag} {shown}: is the --cost-file; give another path")
    except (OSError, ValueError) as exc:  # an embedded NUL, a name too long for the system...
        raise UsageError(f"{flag} {shown!r}: not a usable path ({exc})") from None
    return path


def _temporary_next_to(flag: str, path: Path) -> Path:
    try:
        fd, name = tempfile.mkstemp(prefix=f".{path.name[:100]}.", suffix=f".tmp{path.suffix[:10]}", dir=path.parent)
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot write in {path.parent} ({exc.strerror or exc})") from None
    os.close(fd)
    return Path(name)


def _same_path(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except (OSError, ValueError, RuntimeError):
        return False


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def format_figures(plan) -> str:
    gap = "n/a (heuristic)" if plan.gap is None else f"{100 * plan.gap:.2f}%"
    failures = ", ".join(f"{p}:{s}" for p, s in sorted(plan.failed)) or "none"
    return "\n".join(
        [
            f"failed workers:      {failures}",
            f"solver:              {plan.solver}",
            f"iteration time:      {plan.iteration_time:g}",
            f"lower bound:         {plan.lower_bound:g}",
            f"ratio:               {plan.ratio:.4f}",
            f"steady-state period: {plan.steady_state_period:g}",
            f"solve time:          {plan.solve_seconds:.3f} s",
            f"gap:                 {gap}",
        ]
    )


_FAILURE = re.compile(r"^\s*(-?\d{1,9})\s*:\s*(-?\d{1,9})\s*$", re.ASCII)


def parse_failures(values: Sequence[str], pipelines: int, stages: int) -> list[tuple[int, int]]:
    """``["0:1", "2:3,1:1"]`` -> ``[(0, 1), (2, 3), (1, 1)]``, checked against the grid; a worker
    named twice is an error."""
    allowed = f"p in 0..{pipelines - 1}, s in 0..{stages - 1}"
    out: list[tuple[int, int]] = []
    seen: set[tuple[int, int]] = set()
    for value in values:
        for item in value.split(","):
            match = _FAILURE.match(item)
            if not match:
                shown = item if len(item) <= 40 else item[:37] + "..."
                raise UsageError(f"--fail {shown!r} is malformed: expected p:s (pipeline:stage) with {allowed}")
            p, s = int(match.group(1)), int(match.group(2))
            if not (0 <= p < pipelines and 0 <= s < stages):
                raise UsageError(
                    f"--fail {p}:{s} is outside the grid of {pipelines} pipelines x {stages} stages: allowed {allowed}"
                )
            if (p, s) in seen:
                raise UsageError(f"--fail {p}:{s} is given twice: name each failed worker once ({allowed})")
            seen.add((p, s))
            out.append((p, s))
    return out


def load_costs(args: argparse.Namespace, stages: int):
    """The cost model from ``--costs``/``--cost-file`` plus ``--comm``/``--step`` (which override the file)."""
    from ds_recycle.planner.plan import CostModel

    comm, step = 0.0, 0.0
    source = "--costs"
    if args.cost_file:
        source = f"--cost-file {args.cost_file}"
        data = _read_cost_file(args.cost_file)
        F, B, W = (_per_stage(data, name, stages, args.cost_file) for name in ("F", "B", "W"))
        comm = _number(data.get("comm", 0.0), f"--cost-file {args.cost_file}: 'comm'")
        step = _number(data.get("step", 0.0), f"--cost-file {args.cost_file}: 'step'")
    elif args.costs is not None:
        parts = args.costs.split(",")
        shown = args.costs if len(args.costs) <= 40 else args.costs[:37] + "..."
        if len(parts) != 3:
            raise UsageError(f"--costs {shown!r}: expected three numbers F,B,W (e.g. 1,1,1)")
        f, b, w = (_number(x, f"--costs {shown!r}") for x in parts)
        F, B, W = (f,) * stages, (b,) * stages, (w,) * stages
    else:
        F = B = W = (1.0,) * stages
    if args.comm is not None:
        comm = args.comm
    if args.step is not None:
        step = args.step
    for name, values in (("F", F), ("B", B), ("W", W), ("comm", (comm,)), ("step", (step,))):
        for s, v in enumerate(values):
            if v < 0:
                where = f"{name}[{s}]" if len(values) > 1 or name in "FBW" else name
                raise UsageError(f"{source}: negative cost {where} = {v:g}: {duration_range()}")
    costs = CostModel(tuple(F), tuple(B), tuple(W), comm, step)
    try:
        check_costs(costs)
    except LimitError as exc:
        raise UsageError(f"{source}: {exc}") from None
    return costs


def _read_cost_file(path: str) -> dict:
    file = Path(path)
    try:
        if not file.is_file():
            raise UsageError(f"--cost-file {path}: no such file (a JSON or YAML file with keys F, B, W)")
        size = file.stat().st_size
        if size > LIMITS.max_cost_file_bytes:
            raise UsageError(f"--cost-file {path}: {size:,} bytes; at most {LIMITS.max_cost_file_bytes:,} allowed")
        raw = file.read_bytes()
    except (OSError, ValueError) as exc:
        raise UsageError(f"--cost-file {path}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"--cost-file {path}: not UTF-8 text; expected JSON or YAML with keys F, B, W") from None
    depth = deepest = 0
    for char in text:  # the parsers take seconds on (or crash on) thousands of nested brackets
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    if deepest > LIMITS.max_cost_file_nesting:
        raise UsageError(
            f"--cost-file {path}: brackets nested {deepest} deep; at most {LIMITS.max_cost_file_nesting} allowed "
            "(expected a mapping with keys F, B, W of numbers or lists of numbers)"
        )
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        import yaml

        try:
            data = yaml.safe_load(text)
        except (yaml.YAMLError, ValueError, TypeError, RecursionError, OverflowError) as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise UsageError(f"--cost-file {path}: neither valid JSON nor valid YAML ({first})") from None
    if not isinstance(data, dict):
        raise UsageError(f"--cost-file {path}: expected a mapping with keys F, B, W (optional comm, step)")
    unknown = sorted(str(k)[:40] for k in set(data) - {"F", "B", "W", "comm", "step"})
    if unknown:
        raise UsageError(f"--cost-file {path}: unknown keys {unknown[:5]}; allowed: F, B, W, comm, step")
    return data


def _per_stage(data: dict, name: str, stages: int, path: str) -> tuple[float, ...]:
    if name not in data:
        raise UsageError(f"--cost-file {path}: missing key {name!r} (a list of {stages} durations, one per stage)")
    value = data[name]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (_number(value, f"--cost-file {path}: {name!r}"),) * stages
    if not isinstance(value, list) or len(value) != stages:
        raise UsageError(f"--cost-file {path}: {name!r} must be a list of {stages} numbers (one per stage)")
    return tuple(_number(v, f"--cost-file {path}: {name!r}") for v in value)


def _number(value, where: str) -> float:
    try:
        if isinstance(value, bool):
            raise ValueError
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise UsageError(f"{where}: {shown} is not a number; {duration_range()}") from None
    if not math.isfinite(number):
        raise UsageError(f"{where}: {value!r} is not finite; {duration_range()}")
    return number


COMMANDS: dict[str, Command] = {
    "plan": Command(
        help="plan one iteration for a failure set: text Gantt, figures, JSON and PNG",
        add_arguments=_add_plan_arguments,
        run=_run_plan,
    ),
    "launch": Command(help=launch_cli.HELP, add_arguments=launch_cli.add_arguments, run=launch_cli.run),
    "simulate": Command(help=simulate_cli.HELP, add_arguments=simulate_cli.add_arguments, run=simulate_cli.run),
}
"""Implemented subcommands. ``simulate`` and ``launch`` are added here when they exist."""


if __name__ == "__main__":
    sys.exit(main())
