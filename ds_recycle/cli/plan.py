"""``ds-recycle plan``: the plan for one failure set, as a text Gantt, figures, JSON and PNG
(docs/planner.md).

Every argument, the planner's size limits (ds_recycle/planner/limits.py) and the output paths are
checked before planning starts. A failure set that leaves a stage without survivors is a usage
error too (exit 2): it needs a checkpoint fallback, not a plan. The planner's modules are imported
when the command runs.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Sequence
from pathlib import Path

from ds_recycle.cli.common import Outputs, UsageError, duration, float_in, int_in, shorten
from ds_recycle.planner.limits import LIMITS, LimitError, check_costs, check_png, check_problem, duration_range
from ds_recycle.planner.plan import Worker

HELP = "plan one iteration for a failure set: text Gantt, figures, JSON and PNG"


def add_arguments(parser: argparse.ArgumentParser) -> None:
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


def run(args: argparse.Namespace) -> int:
    from ds_recycle.planner.lower_bound import NoSurvivorError, check_survivors

    D, P, m = args.pipelines, args.stages, args.microbatches
    try:
        check_problem(D, P, m, args.solver)
    except LimitError as exc:
        flag = "--solver milp with " if args.solver == "milp" and "MILP" in str(exc) else ""
        raise UsageError(f"{flag}--pipelines/--stages/--microbatches: {exc}") from None
    failed = parse_failures(args.fail, D, P)
    costs = load_costs(args, P)
    outputs = Outputs.prepare(
        {"--json": args.json, "--png": args.png},
        {"--cost-file": args.cost_file},
        check_png=lambda: _check_png(D, P, m),
    )
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

        from ds_recycle.planner.viz import save_png, text_gantt

        print(text_gantt(plan, max_columns=args.width))
        print()
        print(format_figures(plan))
        writers = {"--json": lambda path: path.write_text(plan.to_json()), "--png": lambda path: save_png(plan, path)}
        for line in outputs.write(writers, {"--json": "plan", "--png": "Gantt chart"}):
            print(line)
    finally:
        outputs.discard()
    return 0


def _check_png(D: int, P: int, m: int) -> None:
    try:
        check_png(D, P, m)
    except LimitError as exc:
        raise UsageError(f"--png: {exc}; leave out --png (the text Gantt and --json have no limit)") from None


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


def parse_failures(values: Sequence[str], pipelines: int, stages: int) -> list[Worker]:
    """``["0:1", "2:3,1:1"]`` -> ``[(0, 1), (2, 3), (1, 1)]``, checked against the grid; a worker
    named twice is an error."""
    allowed = f"p in 0..{pipelines - 1}, s in 0..{stages - 1}"
    out: list[Worker] = []
    seen: set[Worker] = set()
    for value in values:
        for item in value.split(","):
            match = _FAILURE.match(item)
            if not match:
                raise UsageError(
                    f"--fail {shorten(item, 40)!r} is malformed: expected p:s (pipeline:stage) with {allowed}"
                )
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
        shown = shorten(args.costs, 40)
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
            raise UsageError(
                f"--cost-file {path}: neither valid JSON nor valid YAML ({first}); expected a mapping with keys "
                "F, B, W (optional comm, step)"
            ) from None
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
        raise UsageError(f"{where}: {shorten(repr(value), 40)} is not a number; {duration_range()}") from None
    if not math.isfinite(number):
        raise UsageError(f"{where}: {value!r} is not finite; {duration_range()}")
    return number
