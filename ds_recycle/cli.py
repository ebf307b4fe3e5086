"""``ds-recycle``: the command-line entry point.

Subcommands are registered in :data:`COMMANDS` (name -> :class:`Command`); only implemented ones
are listed, so ``ds-recycle --help`` never advertises something that does not run. ``simulate``
and ``launch`` (DESIGN.md §1) plug in the same way.

Exit codes: 0 success, 2 bad arguments (argparse's convention, also used for a failure set that
leaves a stage without survivors: that needs a checkpoint fallback, not a plan).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

USAGE_ERROR = 2


class UsageError(Exception):
    """A bad argument: the message names the problem and the allowed values."""


@dataclass(frozen=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed usage and the message to stderr
        return int(exc.code) if isinstance(exc.code, int) else USAGE_ERROR
    try:
        return COMMANDS[args.command].run(args)
    except UsageError as exc:
        print(f"ds-recycle {args.command}: error: {exc}", file=sys.stderr)
        return USAGE_ERROR


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ds-recycle", description="ReCycle for DeepSpeed pipelines: plans for failure sets."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in COMMANDS.items():
        command.add_arguments(sub.add_parser(name, help=command.help, description=command.help))
    return parser


# ----- plan -----------------------------------------------------------------------------------


def _add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pipelines", "-D", type=_positive_int, required=True, help="data-parallel pipelines D")
    parser.add_argument("--stages", "-P", type=_positive_int, required=True, help="pipeline stages P")
    parser.add_argument(
        "--microbatches", "-m", type=_positive_int, required=True, help="micro-batches per pipeline per iteration"
    )
    parser.add_argument(
        "--fail",
        action="append",
        default=[],
        metavar="p:s",
        help="a failed worker (pipeline p, stage s); repeat for several (also p:s,p:s)",
    )
    costs = parser.add_mutually_exclusive_group()
    costs.add_argument(
        "--costs", metavar="F,B,W", help="durations of F, B and W, the same on every stage (default 1,1,1)"
    )
    costs.add_argument(
        "--cost-file",
        metavar="FILE",
        help="JSON or YAML with F, B, W lists (one value per stage) and optional comm and step",
    )
    parser.add_argument("--comm", type=float, default=None, metavar="C", help="p2p latency between workers (default 0)")
    parser.add_argument("--step", type=float, default=None, metavar="T", help="duration of S: all-reduce + optimizer")
    parser.add_argument(
        "--memory-cap", type=int, default=None, metavar="N", help="micro-batches a worker may hold (default P)"
    )
    parser.add_argument("--solver", choices=("heuristic", "milp"), default="heuristic")
    parser.add_argument("--time-limit", type=float, default=10.0, metavar="S", help="MILP time limit in seconds")
    parser.add_argument("--json", metavar="OUT", help="write the plan as JSON")
    parser.add_argument("--png", metavar="OUT", help="write a Gantt chart as PNG")
    parser.add_argument("--width", type=int, default=120, help="maximum columns of the text Gantt")


def _run_plan(args: argparse.Namespace) -> int:
    from ds_recycle.planner.lower_bound import NoSurvivorError, check_survivors

    D, P, m = args.pipelines, args.stages, args.microbatches
    failed = parse_failures(args.fail, D, P)
    costs = load_costs(args, P)
    if args.memory_cap is not None and args.memory_cap < 1:
        raise UsageError(f"--memory-cap {args.memory_cap}: a worker must hold at least 1 micro-batch (N >= 1)")
    if args.time_limit <= 0:
        raise UsageError(f"--time-limit {args.time_limit:g}: must be > 0 seconds")
    try:
        check_survivors(D, P, failed)
    except NoSurvivorError as exc:
        raise UsageError(str(exc)) from exc

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
    if args.json:
        plan.to_json(args.json)
        print(f"plan written to {args.json}")
    if args.png:
        save_png(plan, args.png)
        print(f"Gantt chart written to {args.png}")
    return 0


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


_FAILURE = re.compile(r"^\s*(-?\d+)\s*:\s*(-?\d+)\s*$")


def parse_failures(values: Sequence[str], pipelines: int, stages: int) -> list[tuple[int, int]]:
    """``["0:1", "2:3,1:1"]`` -> ``[(0, 1), (2, 3), (1, 1)]``, checked against the grid."""
    allowed = f"p in 0..{pipelines - 1}, s in 0..{stages - 1}"
    out = []
    for value in values:
        for item in value.split(","):
            match = _FAILURE.match(item)
            if not match:
                raise UsageError(f"--fail {item!r} is malformed: expected p:s (pipeline:stage) with {allowed}")
            p, s = int(match.group(1)), int(match.group(2))
            if not (0 <= p < pipelines and 0 <= s < stages):
                raise UsageError(
                    f"--fail {p}:{s} is outside the grid of {pipelines} pipelines x {stages} stages: {allowed}"
                )
            if (p, s) not in out:
                out.append((p, s))
    return out


def load_costs(args: argparse.Namespace, stages: int):
    """The cost model from ``--costs``/``--cost-file`` plus ``--comm``/``--step`` (which override the file)."""
    from ds_recycle.planner.plan import CostModel

    comm, step = 0.0, 0.0
    if args.cost_file:
        data = _read_cost_file(args.cost_file)
        F, B, W = (_per_stage(data, name, stages, args.cost_file) for name in ("F", "B", "W"))
        comm = _number(data.get("comm", 0.0), f"'comm' in {args.cost_file}")
        step = _number(data.get("step", 0.0), f"'step' in {args.cost_file}")
    elif args.costs:
        parts = args.costs.split(",")
        if len(parts) != 3:
            raise UsageError(f"--costs {args.costs!r}: expected three numbers F,B,W (e.g. 1,1,1)")
        f, b, w = (_number(x, f"--costs {args.costs!r}") for x in parts)
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
                raise UsageError(f"negative cost {where} = {v:g}: durations and latencies must be >= 0")
    return CostModel(tuple(F), tuple(B), tuple(W), comm, step)


def _read_cost_file(path: str) -> dict:
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"--cost-file {path}: no such file")
    text = file.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise UsageError(f"--cost-file {path}: neither valid JSON nor valid YAML ({exc})") from exc
    if not isinstance(data, dict):
        raise UsageError(f"--cost-file {path}: expected a mapping with keys F, B, W (optional comm, step)")
    unknown = set(data) - {"F", "B", "W", "comm", "step"}
    if unknown:
        raise UsageError(f"--cost-file {path}: unknown keys {sorted(unknown)}; allowed: F, B, W, comm, step")
    return data


def _per_stage(data: dict, name: str, stages: int, path: str) -> tuple[float, ...]:
    if name not in data:
        raise UsageError(f"--cost-file {path}: missing key {name!r} (a list of {stages} durations, one per stage)")
    value = data[name]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (float(value),) * stages
    if not isinstance(value, list) or len(value) != stages:
        raise UsageError(f"--cost-file {path}: {name!r} must be a list of {stages} numbers (one per stage)")
    return tuple(_number(v, f"{name!r} in {path}") for v in value)


def _number(value, where: str) -> float:
    try:
        if isinstance(value, bool):
            raise ValueError
        return float(value)
    except (TypeError, ValueError):
        raise UsageError(f"{where}: {value!r} is not a number") from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer (expected >= 1)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


COMMANDS: dict[str, Command] = {
    "plan": Command(
        help="plan one iteration for a failure set: text Gantt, figures, JSON and PNG",
        add_arguments=_add_plan_arguments,
        run=_run_plan,
    ),
}
"""Implemented subcommands. ``simulate`` and ``launch`` are added here when they exist."""


if __name__ == "__main__":
    sys.exit(main())
