"""``ds-recycle simulate``: ReCycle against Oobleck, Bamboo and checkpoint-restart (docs/simulator.md).

::

    ds-recycle simulate sweep   --model M --pipelines D --stages P --microbatches m [--placement ...]
    ds-recycle simulate trace   --trace NAME|FILE --model M --stages P --microbatches m
    ds-recycle simulate poisson --model M --gpus N --stages P --rate R --hours H [--repair-hours T]

The mode is a positional argument (it may stand anywhere); an option of another mode is refused.
Every argument is checked before the study runs; a bad one exits 2 with one line naming it and the
allowed values. Outputs are written to temporary files and renamed when complete. Only argparse
and the standard library are imported here: the study's modules come in when it runs.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path

HELP = "simulate ReCycle, Oobleck, Bamboo and checkpoint-restart at paper scale (sweep, trace, poisson)"
MODES = ("sweep", "trace", "poisson")
SYSTEM_NAMES = ("recycle", "oobleck", "bamboo", "checkpoint")
PLACEMENT_NAMES = ("spread", "stage", "pipeline")
PRESET_NAMES = ("350M", "1.3B", "2.7B", "6.7B", "13B", "39B", "175B")


class SimulateUsageError(Exception):
    """A bad argument of ``ds-recycle simulate``: the message names it and the allowed values."""


# Limits: keep every accepted run bounded (minutes at most on a laptop); docs/simulator.md.
MAX_SWEEP_PIPELINES = 64
MAX_STAGES = 128
MAX_MICROBATCHES = 4096
MAX_GPUS = 131072
MAX_HOURS = 24 * 366
MAX_RATE = 1000.0
MAX_POISSON_EVENTS = 20000
MAX_SEEDS = 20
MAX_SECONDS = 1e7

# option -> modes it applies to (None: every mode)
MODE_OPTIONS: dict[str, tuple[str, ...]] = {
    "pipelines": ("sweep", "trace"),
    "placement": ("sweep",),
    "window": ("sweep",),
    "trace": ("trace",),
    "gpus": ("poisson",),
    "rate": ("poisson",),
    "hours": ("poisson",),
    "repair_hours": ("poisson",),
    "spares": ("poisson",),
    "seeds": ("poisson",),
}
REQUIRED: dict[str, tuple[str, ...]] = {
    "sweep": ("pipelines", "microbatches"),
    "trace": ("trace", "microbatches"),
    "poisson": ("gpus", "hours"),
}


def _int_in(low: int, high: int) -> Callable[[str], int]:
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


def _float_in(low: float, high: float, *, low_open: bool = False) -> Callable[[str], float]:
    allowed = f"allowed {'(' if low_open else '['}{low:g}, {high:g}]"

    def convert(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a number: {allowed}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not finite: {allowed}")
        if value < low or (low_open and value == low) or value > high:
            raise argparse.ArgumentTypeError(f"{value:g} is out of range: {allowed}")
        return value

    return convert


def _systems(text: str) -> tuple[str, ...]:
    names = [n.strip() for n in text.split(",")]
    allowed = f"a comma list of {', '.join(SYSTEM_NAMES)}"
    if not text.strip() or any(n not in SYSTEM_NAMES for n in names):
        shown = text if len(text) <= 40 else text[:37] + "..."
        raise argparse.ArgumentTypeError(f"{shown!r}: allowed {allowed}")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r} names a system twice: allowed {allowed}, each once")
    return tuple(names)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "mode", choices=MODES, help="sweep: concurrent failures; trace: replay; poisson: production scale"
    )
    parser.add_argument(
        "--model", required=True, metavar="M", help=f"a preset ({', '.join(PRESET_NAMES)}) or a JSON file of ModelSpec"
    )
    parser.add_argument(
        "--stages", "-P", type=_int_in(1, MAX_STAGES), required=True, help=f"stages P (1..{MAX_STAGES})"
    )
    parser.add_argument(
        "--pipelines",
        "-D",
        type=_int_in(1, MAX_SWEEP_PIPELINES),
        help=f"sweep, trace: pipelines D (1..{MAX_SWEEP_PIPELINES}; trace default: peak nodes // P)",
    )
    parser.add_argument(
        "--microbatches",
        "-m",
        type=_int_in(1, MAX_MICROBATCHES),
        help=f"micro-batches per pipeline (1..{MAX_MICROBATCHES}; poisson default 2P)",
    )
    parser.add_argument("--tp", type=_int_in(1, 64), help="tensor-parallel GPUs per worker (default: the preset's)")
    parser.add_argument(
        "--systems", type=_systems, default=SYSTEM_NAMES, help=f"comma list of {','.join(SYSTEM_NAMES)}"
    )
    parser.add_argument("--placement", choices=PLACEMENT_NAMES, default="spread", help="sweep: where failures land")
    parser.add_argument(
        "--window", type=_float_in(1, MAX_SECONDS), default=3600.0, metavar="S", help="sweep: seconds after the failure"
    )
    parser.add_argument(
        "--trace",
        metavar="NAME|FILE",
        help="trace: a shipped trace's name (e.g. bamboo-p3) or a file of time_ms,add|remove,node lines",
    )
    parser.add_argument("--gpus", type=_int_in(1, MAX_GPUS), help=f"poisson: GPUs (1..{MAX_GPUS})")
    parser.add_argument(
        "--rate",
        type=_float_in(0, MAX_RATE),
        default=1.0,
        metavar="R",
        help=f"poisson: failure rate as a multiple of Llama 3's 4.7e-4 per GPU-day ([0, {MAX_RATE:g}])",
    )
    parser.add_argument("--hours", type=_float_in(0, MAX_HOURS, low_open=True), metavar="H", help="poisson: duration")
    parser.add_argument(
        "--repair-hours", type=_float_in(0, MAX_HOURS), default=2.0, metavar="T", help="poisson: repair time (2)"
    )
    parser.add_argument("--spares", type=_float_in(0, 1), default=0.0, metavar="FRAC", help="poisson: spare workers")
    parser.add_argument("--seeds", type=_int_in(1, MAX_SEEDS), default=1, metavar="N", help="poisson: repetitions")
    parser.add_argument(
        "--checkpoint-cost", type=_float_in(0, 1e5), default=60.0, metavar="S", help="seconds per checkpoint (60)"
    )
    parser.add_argument("--restart", type=_float_in(0, 1e5), default=300.0, metavar="S", help="restart seconds (300)")
    parser.add_argument(
        "--checkpoint-interval",
        type=_float_in(0, MAX_SECONDS, low_open=True),
        metavar="S",
        help="seconds between checkpoints (default: Young's optimum; sweep: 1800)",
    )
    parser.add_argument(
        "--checkpoint-policy", choices=("shrink", "wait"), default="shrink", help="checkpoint-restart after a failure"
    )
    parser.add_argument(
        "--recycle-detect", type=_float_in(0, 1e5), default=5.0, metavar="S", help="ReCycle detection (5)"
    )
    parser.add_argument(
        "--recycle-rebuild", type=_float_in(0, 1e5), default=10.0, metavar="S", help="ReCycle group rebuild (10)"
    )
    parser.add_argument(
        "--oobleck-remove", type=_float_in(0, 1e5), default=57.0, metavar="S", help="Oobleck downtime per removal (57)"
    )
    parser.add_argument(
        "--oobleck-add", type=_float_in(0, 1e5), default=100.0, metavar="S", help="Oobleck downtime per re-add (100)"
    )
    parser.add_argument("--oobleck-f", type=_int_in(0, 4096), metavar="F", help="Oobleck's tolerated failures (D-1)")
    parser.add_argument(
        "--bamboo-depth", type=_float_in(1, 4), default=1.5, metavar="X", help="Bamboo pipeline depth / P (1.5)"
    )
    parser.add_argument(
        "--bamboo-reconfigure", type=_float_in(0, 1e5), default=20.0, metavar="S", help="Bamboo reconfiguration (20)"
    )
    parser.add_argument("--json", metavar="OUT", help="write the study as JSON")
    parser.add_argument("--png", metavar="OUT.png", help="write a plot as PNG (needs matplotlib)")


def run(args: argparse.Namespace) -> int:
    from ds_recycle.cli import UsageError

    try:
        return _run(args)
    except SimulateUsageError as exc:
        raise UsageError(str(exc)) from None


def _run(args: argparse.Namespace) -> int:
    mode = args.mode
    for option, modes in MODE_OPTIONS.items():
        given = args.__dict__.get("_given_options", {})
        if option in given and mode not in modes:
            flag = "--" + option.replace("_", "-")
            raise SimulateUsageError(f"{flag} is not allowed with {mode}: it applies to {', '.join(modes)} only")
    for option in REQUIRED[mode]:
        if getattr(args, option) is None:
            flag = "--" + option.replace("_", "-")
            raise SimulateUsageError(f"{flag} is required with {mode}")
    outputs = _prepare_outputs(args)
    try:
        study = _study(args)
        from ds_recycle.sim.report import json_text, save_png, text_report

        texts = {}
        if outputs.get("--json"):
            texts["--json"] = json_text(study)
        print(text_report(study))
        for flag, (target, temporary) in outputs.items():
            try:
                if flag == "--json":
                    temporary.write_text(texts["--json"])
                else:
                    save_png(study, temporary)
            except OSError as exc:
                raise SimulateUsageError(f"{flag} {target}: writing failed ({exc.strerror or exc})") from None
        mask = os.umask(0o022)
        os.umask(mask)
        for flag, (target, temporary) in list(outputs.items()):
            os.chmod(temporary, 0o666 & ~mask)
            os.replace(temporary, target)
            del outputs[flag]
            print(f"{'study' if flag == '--json' else 'plot'} written to {target}")
    finally:
        for _target, temporary in outputs.values():
            try:
                temporary.unlink()
            except OSError:
                pass
    return 0


def _prepare_outputs(args: argparse.Namespace) -> dict[str, tuple[Path, Path]]:
    from ds_recycle.cli import UsageError, _check_output_path, _same_path, _temporary_next_to

    try:
        paths = {}
        for flag, value in (("--json", args.json), ("--png", args.png)):
            if value is None:
                continue
            path = _check_output_path(flag, value, None)
            for input_flag, input_value in (("--trace", args.trace), ("--model", args.model)):
                if input_value and path.exists() and _same_path(path, Path(input_value)):
                    raise SimulateUsageError(f"{flag} {value}: is the {input_flag} file; give another path")
            paths[flag] = path
        if len(paths) == 2 and _same_path(paths["--json"], paths["--png"]):
            raise SimulateUsageError(f"--json and --png name the same file {args.json}: give two different paths")
        if "--png" in paths:
            if paths["--png"].suffix.lower() != ".png":
                raise SimulateUsageError(f"--png {args.png}: the file name must end in .png")
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                raise SimulateUsageError(
                    "--png needs matplotlib, which is not installed: pip install matplotlib (or leave out --png)"
                ) from None
    except UsageError as exc:
        raise SimulateUsageError(str(exc)) from None
    outputs: dict[str, tuple[Path, Path]] = {}
    try:
        for flag, path in paths.items():
            outputs[flag] = (path, _temporary_next_to(flag, path))
    except UsageError as exc:
        for _target, temporary in outputs.values():
            temporary.unlink(missing_ok=True)
        raise SimulateUsageError(str(exc)) from None
    return outputs


def _study(args: argparse.Namespace):
    from ds_recycle.sim import experiments as ex
    from ds_recycle.sim.bamboo import BambooParams
    from ds_recycle.sim.checkpoint import CheckpointParams
    from ds_recycle.sim.job import LLAMA3_RATE_PER_GPU_DAY, Checkpointing, Job
    from ds_recycle.sim.oobleck import OobleckParams
    from ds_recycle.sim.presets import get_model
    from ds_recycle.sim.recycle import RecycleParams
    from ds_recycle.sim.traces import TraceError, find_trace, read_trace

    try:
        model = get_model(args.model, args.tp)
    except ValueError as exc:
        raise SimulateUsageError(f"--model: {exc}") from None
    P = args.stages
    if model.layers < P:
        raise SimulateUsageError(f"--stages {P}: {model.name} has {model.layers} layers; allowed 1..{model.layers}")
    interval = args.checkpoint_interval
    if interval is None and args.mode == "sweep":
        interval = max(1800.0, 2 * args.checkpoint_cost + 1)
    if interval is not None and interval <= args.checkpoint_cost:
        raise SimulateUsageError(
            f"--checkpoint-interval {interval:g} must be greater than --checkpoint-cost {args.checkpoint_cost:g}"
        )
    checkpointing = Checkpointing(args.checkpoint_cost, args.restart, interval)
    params = ex.SystemParams(
        recycle=RecycleParams(detect_s=args.recycle_detect, rebuild_s=args.recycle_rebuild),
        oobleck=OobleckParams(f=args.oobleck_f, remove_downtime_s=args.oobleck_remove, add_downtime_s=args.oobleck_add),
        bamboo=BambooParams(depth_factor=args.bamboo_depth, reconfigure_s=args.bamboo_reconfigure),
        checkpoint=CheckpointParams(args.checkpoint_policy),
    )

    def job(D: int, m: int, flag: str, rate: float | None = None) -> Job:
        try:
            return Job(model, D, P, m, checkpointing=checkpointing, failures_per_hour=rate)
        except ValueError as exc:
            raise SimulateUsageError(f"{flag}: {exc}") from None

    if args.mode == "sweep":
        return ex.sweep(
            job(args.pipelines, args.microbatches, "--stages"), args.placement, args.systems, params, args.window
        )
    if args.mode == "trace":
        try:
            trace = read_trace(find_trace(args.trace))
        except TraceError as exc:
            raise SimulateUsageError(f"--trace {exc}") from None
        D = args.pipelines if args.pipelines is not None else trace.peak // P
        if D < 1:
            raise SimulateUsageError(
                f"--stages {P}: the trace has at most {trace.peak} nodes, fewer than one pipeline; "
                f"allowed 1..{trace.peak}"
            )
        if D > MAX_SWEEP_PIPELINES:
            raise SimulateUsageError(
                f"--pipelines: the trace needs {D} pipelines; allowed at most {MAX_SWEEP_PIPELINES}"
            )
        rate = trace.removals / (trace.duration / 3600)
        return ex.trace_replay(job(D, args.microbatches, "--stages", rate), trace, args.systems, params)
    workers = args.gpus // model.tp
    D = workers // P
    if D < 1:
        raise SimulateUsageError(
            f"--gpus {args.gpus}: fewer than one pipeline of {P} workers x tp {model.tp}; needs at least {P * model.tp}"
        )
    m = args.microbatches if args.microbatches is not None else 2 * P
    gpus = D * P * model.tp
    expected = args.rate * LLAMA3_RATE_PER_GPU_DAY * gpus * args.hours / 24 * (1 + args.spares) * args.seeds
    if expected > MAX_POISSON_EVENTS:
        raise SimulateUsageError(
            f"--rate/--hours/--gpus: about {expected:,.0f} failures expected; at most {MAX_POISSON_EVENTS:,} allowed "
            "(give fewer --hours or --seeds)"
        )
    rate = args.rate * LLAMA3_RATE_PER_GPU_DAY * gpus / 24
    return ex.poisson(
        job(D, m, "--gpus/--stages", rate),
        args.rate,
        args.hours,
        args.repair_hours,
        args.spares,
        args.systems,
        params,
        seeds=tuple(range(args.seeds)),
    )
