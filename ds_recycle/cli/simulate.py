"""``ds-recycle simulate``: ReCycle against Oobleck, Bamboo and checkpoint-restart (docs/simulator.md).

::

    ds-recycle simulate sweep   --model M --pipelines D --stages P --microbatches m [--placement ...]
    ds-recycle simulate trace   --trace NAME|FILE --model M --stages P --microbatches m
    ds-recycle simulate poisson --model M --gpus N --stages P --rate R --hours H [--repair-hours T]
    ds-recycle simulate ettr    --model M --stages P [--preset meta|llama3|both] [--scales 1024,...] [--plot OUT.png]
                                [--failures causes|single] [--recycle-costs measured|paper]

The mode is a positional argument (it may stand anywhere); an option of another mode is refused.
Every argument is checked before the study runs; a bad one exits 2 with one line naming it and the
allowed values. Outputs are written to temporary files and renamed when complete. Only argparse
and the standard library are imported here: the study's modules come in when it runs.
"""

from __future__ import annotations

import argparse

from ds_recycle.cli.common import Outputs, UsageError, float_in, given_options, int_in, shorten

HELP = "simulate ReCycle, Oobleck, Bamboo and checkpoint-restart at paper scale (sweep, trace, poisson, ettr)"
MODES = ("sweep", "trace", "poisson", "ettr")
SYSTEM_NAMES = ("recycle", "replica-restart", "job-restart", "oobleck", "bamboo", "checkpoint")
DEFAULT_SYSTEMS = ("recycle", "oobleck", "bamboo", "checkpoint")
"""sweep, trace and poisson; ettr runs every system of SYSTEM_NAMES."""
ETTR_PRESETS = ("meta", "llama3", "both")
ETTR_SCALES = (1024, 16384, 131072)
ETTR_HOURS = 168.0
ETTR_SPARES = 0.01
ETTR_FAILURES = ("causes", "single")
RECYCLE_COSTS = ("measured", "paper")
"""sim/ettr.py DEFAULT_SPARE_FRACTION (not imported: the CLI imports no study module up front)."""
PLACEMENT_NAMES = ("spread", "stage", "pipeline")
PRESET_NAMES = ("350M", "1.3B", "2.7B", "6.7B", "13B", "39B", "175B")
REBALANCE_NAMES = ("off", "migrate", "repartition")
DEFAULT_REBALANCE = "migrate"
"""What the study recommends (docs/simulator.md, "Rebalancing"): migration closes the gap on every
shipped trace; re-partitioning adds a few percent at several times the planning work."""


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
    "hours": ("poisson", "ettr"),
    "repair_hours": ("poisson", "ettr"),
    "spares": ("poisson", "ettr"),
    "seeds": ("poisson", "ettr"),
    "png": ("sweep", "trace", "poisson"),
    "preset": ("ettr",),
    "scales": ("ettr",),
    "plot": ("ettr",),
    "failures": ("ettr",),
    "recycle_costs": ("ettr",),
}
REQUIRED: dict[str, tuple[str, ...]] = {
    "sweep": ("pipelines", "microbatches"),
    "trace": ("trace", "microbatches"),
    "poisson": ("gpus", "hours"),
    "ettr": (),
}


def _systems(text: str) -> tuple[str, ...]:
    names = [n.strip() for n in text.split(",")]
    allowed = f"a comma list of {', '.join(SYSTEM_NAMES)}"
    if not text.strip() or any(n not in SYSTEM_NAMES for n in names):
        raise argparse.ArgumentTypeError(f"{shorten(text, 40)!r}: allowed {allowed}")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r} names a system twice: allowed {allowed}, each once")
    return tuple(names)


def _scales(text: str) -> tuple[int, ...]:
    allowed = f"a comma list of {', '.join(map(str, ETTR_SCALES))}"
    parts = [n.strip() for n in text.split(",")]
    if not text.strip() or any(p not in {str(g) for g in ETTR_SCALES} for p in parts):
        raise argparse.ArgumentTypeError(f"{shorten(text, 40)!r}: allowed {allowed}")
    if len(set(parts)) != len(parts):
        raise argparse.ArgumentTypeError(f"{text!r} names a scale twice: allowed {allowed}, each once")
    return tuple(sorted(int(p) for p in parts))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "mode",
        choices=MODES,
        help="sweep: concurrent failures; trace: replay; poisson: production scale; ettr: ETTR against GPUs",
    )
    parser.add_argument(
        "--model", required=True, metavar="M", help=f"a preset ({', '.join(PRESET_NAMES)}) or a JSON file of ModelSpec"
    )
    parser.add_argument("--stages", "-P", type=int_in(1, MAX_STAGES), required=True, help=f"stages P (1..{MAX_STAGES})")
    parser.add_argument(
        "--pipelines",
        "-D",
        type=int_in(1, MAX_SWEEP_PIPELINES),
        help=f"sweep, trace: pipelines D (1..{MAX_SWEEP_PIPELINES}; trace default: peak nodes // P)",
    )
    parser.add_argument(
        "--microbatches",
        "-m",
        type=int_in(1, MAX_MICROBATCHES),
        help=f"micro-batches per pipeline (1..{MAX_MICROBATCHES}; poisson default 2P)",
    )
    parser.add_argument("--tp", type=int_in(1, 64), help="tensor-parallel GPUs per worker (default: the preset's)")
    parser.add_argument(
        "--systems",
        type=_systems,
        help=f"comma list of {','.join(SYSTEM_NAMES)} (default: {','.join(DEFAULT_SYSTEMS)}; ettr: all)",
    )
    parser.add_argument("--placement", choices=PLACEMENT_NAMES, default="spread", help="sweep: where failures land")
    parser.add_argument(
        "--window", type=float_in(1, MAX_SECONDS), default=3600.0, metavar="S", help="sweep: seconds after the failure"
    )
    parser.add_argument(
        "--trace",
        metavar="NAME|FILE",
        help="trace: a shipped trace's name (e.g. bamboo-p3) or a file of time_ms,add|remove,node lines",
    )
    parser.add_argument("--gpus", type=int_in(1, MAX_GPUS), help=f"poisson: GPUs (1..{MAX_GPUS})")
    parser.add_argument(
        "--rate",
        type=float_in(0, MAX_RATE),
        default=1.0,
        metavar="R",
        help=f"poisson: failure rate as a multiple of Llama 3's 4.7e-4 per GPU-day ([0, {MAX_RATE:g}])",
    )
    parser.add_argument(
        "--hours",
        type=float_in(0, MAX_HOURS, low_open=True),
        metavar="H",
        help=f"poisson, ettr: duration (ettr: {ETTR_HOURS:g})",
    )
    parser.add_argument(
        "--repair-hours", type=float_in(0, MAX_HOURS), default=2.0, metavar="T", help="poisson: repair time (2)"
    )
    parser.add_argument(
        "--spares", type=float_in(0, 1), metavar="FRAC", help=f"poisson, ettr: spare workers (0; ettr {ETTR_SPARES:g})"
    )
    parser.add_argument("--seeds", type=int_in(1, MAX_SEEDS), default=1, metavar="N", help="poisson: repetitions")
    parser.add_argument(
        "--checkpoint-cost", type=float_in(0, 1e5), default=60.0, metavar="S", help="seconds per checkpoint (60)"
    )
    parser.add_argument("--restart", type=float_in(0, 1e5), default=300.0, metavar="S", help="restart seconds (300)")
    parser.add_argument(
        "--checkpoint-interval",
        type=float_in(0, MAX_SECONDS, low_open=True),
        metavar="S",
        help="seconds between checkpoints (default: Young's optimum; sweep: 1800)",
    )
    parser.add_argument(
        "--checkpoint-policy", choices=("shrink", "wait"), default="shrink", help="checkpoint-restart after a failure"
    )
    parser.add_argument(
        "--recycle-detect", type=float_in(0, 1e5), default=5.0, metavar="S", help="ReCycle detection (5)"
    )
    parser.add_argument(
        "--recycle-rebuild", type=float_in(0, 1e5), default=10.0, metavar="S", help="ReCycle group rebuild (10)"
    )
    parser.add_argument(
        "--rebalance",
        choices=REBALANCE_NAMES,
        default=DEFAULT_REBALANCE,
        help=f"ReCycle re-shapes its grid when failures unbalance it ({DEFAULT_REBALANCE})",
    )
    parser.add_argument(
        "--oobleck-remove", type=float_in(0, 1e5), default=57.0, metavar="S", help="Oobleck downtime per removal (57)"
    )
    parser.add_argument(
        "--oobleck-add", type=float_in(0, 1e5), default=100.0, metavar="S", help="Oobleck downtime per re-add (100)"
    )
    parser.add_argument("--oobleck-f", type=int_in(0, 4096), metavar="F", help="Oobleck's tolerated failures (D-1)")
    parser.add_argument(
        "--bamboo-depth", type=float_in(1, 4), default=1.5, metavar="X", help="Bamboo pipeline depth / P (1.5)"
    )
    parser.add_argument(
        "--bamboo-reconfigure", type=float_in(0, 1e5), default=20.0, metavar="S", help="Bamboo reconfiguration (20)"
    )
    parser.add_argument(
        "--preset", choices=ETTR_PRESETS, default="both", help="ettr: failure rate (Meta's MTTFs, Llama 3's, both)"
    )
    parser.add_argument(
        "--scales",
        type=_scales,
        default=ETTR_SCALES,
        metavar="N,...",
        help=f"ettr: GPU counts, a comma list of {','.join(map(str, ETTR_SCALES))} (all)",
    )
    parser.add_argument("--plot", metavar="OUT.png", help="ettr: write ETTR against GPUs as PNG (needs matplotlib)")
    parser.add_argument(
        "--failures",
        choices=ETTR_FAILURES,
        default="causes",
        help="ettr: causes: the Llama 3 mix, host/network failures take a node, lognormal repairs (default); "
        "single: one worker per failure, constant --repair-hours",
    )
    parser.add_argument(
        "--recycle-costs",
        choices=RECYCLE_COSTS,
        default="measured",
        help="ettr: ReCycle's detection and rebuild, measured (1 s + 3 s, default) or paper (5 s + 10 s); "
        "--recycle-detect/--recycle-rebuild override",
    )
    parser.add_argument("--json", metavar="OUT", help="write the study as JSON")
    parser.add_argument("--png", metavar="OUT.png", help="write a plot as PNG (needs matplotlib)")


def run(args: argparse.Namespace) -> int:
    mode = args.mode
    for option, modes in MODE_OPTIONS.items():
        if option in given_options(args) and mode not in modes:
            flag = "--" + option.replace("_", "-")
            raise UsageError(f"{flag} is not allowed with {mode}: it applies to {', '.join(modes)} only")
    for option in REQUIRED[mode]:
        if getattr(args, option) is None:
            flag = "--" + option.replace("_", "-")
            raise UsageError(f"{flag} is required with {mode}")
    if args.systems is None:
        args.systems = SYSTEM_NAMES if mode == "ettr" else DEFAULT_SYSTEMS
    if args.spares is None:
        args.spares = ETTR_SPARES if mode == "ettr" else 0.0
    if mode == "ettr":
        return _run_ettr(args)
    outputs = Outputs.prepare(
        {"--json": args.json, "--png": args.png},
        {"--trace file": args.trace, "--model file": args.model},
        check_png=_check_matplotlib,
    )
    try:
        study = _study(args)
        from ds_recycle.sim.report import json_text, save_png, text_report

        text = json_text(study) if args.json is not None else ""
        print(text_report(study))
        writers = {"--json": lambda path: path.write_text(text), "--png": lambda path: save_png(study, path)}
        for line in outputs.write(writers, {"--json": "study", "--png": "plot"}):
            print(line)
    finally:
        outputs.discard()
    return 0


def _run_ettr(args: argparse.Namespace) -> int:
    if args.plot is not None:
        if not args.plot.lower().endswith(".png"):
            raise UsageError(f"--plot {shorten(args.plot, 80)}: the file name must end in .png")
        if args.json is not None and args.json == args.plot:
            raise UsageError(f"--json and --plot name the same file {shorten(args.plot, 80)}: give two different paths")
        _check_matplotlib("--plot")
    outputs = Outputs.prepare({"--json": args.json, "--plot": args.plot}, {"--model file": args.model})
    try:
        table = _ettr_table(args)
        import dataclasses
        import json

        from ds_recycle.sim.ettr import save_plot, text_table

        print(text_table(table))
        text = json.dumps(dataclasses.asdict(table), indent=1, allow_nan=False)
        writers = {"--json": lambda path: path.write_text(text), "--plot": lambda path: save_plot(table, str(path))}
        for line in outputs.write(writers, {"--json": "table", "--plot": "plot"}):
            print(line)
    finally:
        outputs.discard()
    return 0


def _ettr_table(args: argparse.Namespace):
    import dataclasses

    from ds_recycle.sim.causes import FailureModel
    from ds_recycle.sim.ettr import RATE_PRESETS, ettr_study, failures_per_hour
    from ds_recycle.sim.presets import RECYCLE_COSTS as COSTS

    model, P, checkpointing, params = _common(args)
    given = given_options(args)
    costs = COSTS[args.recycle_costs]
    recycle = dataclasses.replace(
        params.recycle,
        detect_s=args.recycle_detect if "recycle_detect" in given else costs.detect_s,
        rebuild_s=args.recycle_rebuild if "recycle_rebuild" in given else costs.rebuild_s,
    )
    params = dataclasses.replace(params, recycle=recycle)
    if args.failures == "causes" and "repair_hours" in given:
        raise UsageError("--repair-hours applies to --failures single only: --failures causes draws repair times")
    presets = RATE_PRESETS if args.preset == "both" else (args.preset,)
    hours = args.hours if args.hours is not None else ETTR_HOURS
    for gpus in args.scales:
        if gpus // model.tp // P < 1:
            raise UsageError(
                f"--scales {gpus}: fewer than one pipeline of {P} workers x tp {model.tp}; needs {P * model.tp} GPUs"
            )
        worst = max(failures_per_hour(p, gpus) for p in presets)
        expected = worst * hours * (1 + args.spares) * args.seeds
        if expected > MAX_POISSON_EVENTS:
            raise UsageError(
                f"--hours/--seeds: about {expected:,.0f} failures expected at {gpus} GPUs; at most "
                f"{MAX_POISSON_EVENTS:,} allowed (give fewer --hours or --seeds)"
            )
    try:
        return ettr_study(
            model,
            P,
            args.microbatches,
            args.scales,
            presets,
            hours,
            args.repair_hours,
            args.spares,
            args.systems,
            params,
            checkpointing,
            tuple(range(args.seeds)),
            FailureModel() if args.failures == "causes" else None,
        )
    except ValueError as exc:
        raise UsageError(f"--model/--stages/--microbatches: {exc}") from None


def _check_matplotlib(flag: str = "--png") -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError(
            f"{flag} needs matplotlib, which is not installed: pip install matplotlib (or leave out {flag})"
        ) from None


def _common(args: argparse.Namespace):
    """The model, stages, checkpointing and system parameters every mode shares."""
    from ds_recycle.sim import experiments as ex
    from ds_recycle.sim.bamboo import BambooParams
    from ds_recycle.sim.checkpoint import CheckpointParams
    from ds_recycle.sim.job import Checkpointing
    from ds_recycle.sim.oobleck import OobleckParams
    from ds_recycle.sim.presets import get_model
    from ds_recycle.sim.rebalance import RebalanceParams
    from ds_recycle.sim.recycle import RecycleParams

    try:
        model = get_model(args.model, args.tp)
    except ValueError as exc:
        raise UsageError(f"--model: {exc}") from None
    P = args.stages
    if model.layers < P:
        raise UsageError(f"--stages {P}: {model.name} has {model.layers} layers; allowed 1..{model.layers}")
    interval = args.checkpoint_interval
    if interval is None and args.mode == "sweep":
        interval = max(1800.0, 2 * args.checkpoint_cost + 1)
    if interval is not None and interval <= args.checkpoint_cost:
        raise UsageError(
            f"--checkpoint-interval {interval:g} must be greater than --checkpoint-cost {args.checkpoint_cost:g}"
        )
    checkpointing = Checkpointing(args.checkpoint_cost, args.restart, interval)
    params = ex.SystemParams(
        recycle=RecycleParams(
            detect_s=args.recycle_detect, rebuild_s=args.recycle_rebuild, rebalance=RebalanceParams(args.rebalance)
        ),
        oobleck=OobleckParams(f=args.oobleck_f, remove_downtime_s=args.oobleck_remove, add_downtime_s=args.oobleck_add),
        bamboo=BambooParams(depth_factor=args.bamboo_depth, reconfigure_s=args.bamboo_reconfigure),
        checkpoint=CheckpointParams(args.checkpoint_policy),
    )
    return model, P, checkpointing, params


def _study(args: argparse.Namespace):
    from ds_recycle.sim import experiments as ex
    from ds_recycle.sim.job import LLAMA3_RATE_PER_GPU_DAY, Job
    from ds_recycle.sim.traces import TraceError, find_trace, read_trace

    model, P, checkpointing, params = _common(args)

    def job(D: int, m: int, flag: str, rate: float | None = None) -> Job:
        try:
            return Job(model, D, P, m, checkpointing=checkpointing, failures_per_hour=rate)
        except ValueError as exc:
            raise UsageError(f"{flag}: {exc}") from None

    if args.mode == "sweep":
        return ex.sweep(
            job(args.pipelines, args.microbatches, "--stages"), args.placement, args.systems, params, args.window
        )
    if args.mode == "trace":
        try:
            trace = read_trace(find_trace(args.trace))
        except TraceError as exc:
            raise UsageError(f"--trace {exc}") from None
        D = args.pipelines if args.pipelines is not None else trace.peak // P
        if D < 1:
            raise UsageError(
                f"--stages {P}: the trace has at most {trace.peak} nodes, fewer than one pipeline; "
                f"allowed 1..{trace.peak}"
            )
        if D > MAX_SWEEP_PIPELINES:
            raise UsageError(f"--pipelines: the trace needs {D} pipelines; allowed at most {MAX_SWEEP_PIPELINES}")
        rate = trace.removals / (trace.duration / 3600)
        return ex.trace_replay(job(D, args.microbatches, "--stages", rate), trace, args.systems, params)
    workers = args.gpus // model.tp
    D = workers // P
    if D < 1:
        raise UsageError(
            f"--gpus {args.gpus}: fewer than one pipeline of {P} workers x tp {model.tp}; needs at least {P * model.tp}"
        )
    m = args.microbatches if args.microbatches is not None else 2 * P
    gpus = D * P * model.tp
    expected = args.rate * LLAMA3_RATE_PER_GPU_DAY * gpus * args.hours / 24 * (1 + args.spares) * args.seeds
    if expected > MAX_POISSON_EVENTS:
        raise UsageError(
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
