"""``ds-recycle launch``: the command-line form of :class:`~ds_recycle.runtime.node.launcher.Launcher`.

Arguments are checked before anything starts; a bad one exits 2 with one line that names it and
the allowed values. Nothing heavy is imported here: torch comes in only when the job runs, so
``ds-recycle --help`` stays instant.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
from pathlib import Path

from ds_recycle.cli import coordinator, nodes
from ds_recycle.cli.common import UsageError
from ds_recycle.runtime.shared import keys

MAX_NPROC = 1024
"""More ranks than this on one host is a typo, not a job."""
HELP = "start the ranks of this node, host or join the coordinator store, detect failures and respawn ranks"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=None, metavar="N", help="one node: number of ranks (slots)")
    nodes.add_arguments(parser)
    parser.add_argument(
        "--respawn", action="store_true", help="start a rank that ended again (it re-joins); restart on exit code 75"
    )
    parser.add_argument(
        "--respawn-delay", type=float, default=1.0, metavar="S", help="seconds before a respawn (default 1)"
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=None,
        metavar="N",
        help="respawn a rank that keeps failing soon after its start at most N times in a row (default: no cap); "
        "the delay doubles with each such failure",
    )
    parser.add_argument(
        "--rebalance",
        choices=("migrate", "off"),
        default="migrate",
        help="migrate (default): a rank given up past --max-restarts is retired, and a survivor of a stage with "
        "workers to spare moves into it when the planner predicts it pays; off: the grid stays as failures left it",
    )
    parser.add_argument(
        "--preload",
        action="store_true",
        help="import torch (and torch._dynamo), deepspeed and ds_recycle.api once and fork every rank from that "
        "process: a (re)started rank skips seconds of imports",
    )
    parser.add_argument(
        "--preload-module",
        action="append",
        default=[],
        metavar="MODULE",
        help="also import MODULE before forking (repeatable; implies --preload); only a module that does not read "
        "the rank's environment (RANK, WORLD_SIZE, ...) at import",
    )
    parser.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        default=None,
        help="the ranks' communication: nccl (each rank on a CUDA device, LOCAL_RANK mod GPUs; the default where "
        "torch sees a GPU) or gloo (CPU; the default elsewhere)",
    )
    parser.add_argument("--timeout", type=float, default=None, metavar="S", help="kill everything after S seconds")
    parser.add_argument("--log-dir", default=None, metavar="DIR", help="write rank<R>.log here (default: stdout)")
    parser.add_argument("--host", default="127.0.0.1", help="address the store listens on (default loopback)")
    coordinator.add_coordination_arguments(parser)
    parser.add_argument(
        "--grace", type=float, default=5.0, metavar="S", help="seconds from SIGTERM to SIGKILL when stopping ranks"
    )
    parser.add_argument("script", metavar="SCRIPT", help="the training script (run with this Python)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="the script's arguments")


def run(args: argparse.Namespace) -> int:
    node = nodes.resolve(args)
    _validate(args, node)
    for flag, name in nodes.ETCD_TLS_FLAGS.items():  # read by every etcd client, the ranks' included
        if getattr(args, name) is not None:
            os.environ["DS_RECYCLE_ETCD_" + flag.removeprefix("--etcd-").upper()] = str(
                Path(getattr(args, name)).resolve()
            )
    from ds_recycle.runtime.node.launcher import Launcher

    config = dataclasses.replace(
        coordinator.job_config(args, node, args.coordinator_wait),
        argv=[args.script, *args.script_args],
        node_rank=node.node_rank,
        external_coordinator=args.external_coordinator,
        coordinator_timeout=args.coordinator_timeout,
        domain=node.domain,
        env=_rank_env(args, node),
        respawn=args.respawn,
        respawn_delay=args.respawn_delay,
        max_restarts=args.max_restarts,
        rebalance=args.rebalance == "migrate",
        timeout=args.timeout,
        log_dir=None if args.log_dir is None else Path(args.log_dir),
        host=args.host,
        python=sys.executable,
        preload=_preload_modules(args),
        grace=args.grace,
        backend=_backend(args),
    )
    return Launcher(config).run(handle_signals=True)


def _rank_env(args: argparse.Namespace, node: nodes.NodeSpec) -> dict[str, str] | None:
    """The ranks' extra environment: --allow-unsafe-placement, and the GPUs --include/--exclude chose."""
    env: dict[str, str] = {}
    if args.allow_unsafe_placement:
        env[keys.ENV_ALLOW_UNSAFE_PLACEMENT] = "1"
    if node.visible_devices is not None:
        env[nodes.VISIBLE_DEVICES] = node.visible_devices
    return env or None


def _backend(args: argparse.Namespace) -> str:
    backend = args.backend
    if backend is None:
        import torch

        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and (args.preload or args.preload_module):
        raise UsageError(
            "--preload with --backend nccl (the default where a GPU is present): ranks forked from one "
            "process do not each get CUDA; leave out --preload and --preload-module, or give --backend gloo"
        )
    return backend


def _preload_modules(args: argparse.Namespace) -> tuple[str, ...]:
    if not (args.preload or args.preload_module):
        return ()
    from ds_recycle.runtime.node.preload import PRELOAD_MODULES

    return tuple(dict.fromkeys([*PRELOAD_MODULES, *args.preload_module]))


def _validate(args: argparse.Namespace, node: nodes.NodeSpec) -> None:
    error = UsageError
    for module in args.preload_module:
        if not all(part.isidentifier() for part in module.split(".")):
            raise error(f"--preload-module {module!r}: must be a dotted module name (e.g. transformers)")
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise error(
                f"--preload-module {module}: no such module in {sys.executable} "
                "(expected a module the ranks import, installed in this Python)"
            )
    if not 1 <= node.nproc_per_node <= MAX_NPROC:
        raise error(f"--nproc {node.nproc_per_node}: must be an integer in 1..{MAX_NPROC}")
    for name in ("respawn_delay", "grace"):
        value = getattr(args, name)
        if not value >= 0:  # also catches nan
            raise error(f"--{name.replace('_', '-')} {value:g}: must be >= 0 seconds")
    if args.max_restarts is not None and args.max_restarts < 0:
        raise error(f"--max-restarts {args.max_restarts}: must be an integer >= 0 (leave it out for no cap)")
    coordinator.validate_coordination(args)
    if args.coordinator_timeout is not None and args.coordinator_timeout > args.node_lease:
        raise error(
            f"--coordinator-timeout {args.coordinator_timeout:g}: must be at most --node-lease {args.node_lease:g} "
            "(an agent fences its ranks by the time its lease lapses)"
        )
    if args.external_coordinator and node.etcd is not None:
        raise error("--external-coordinator is for the c10d store: on --rdzv-backend etcd every agent may coordinate")
    if args.external_coordinator and node.nnodes < 2:
        raise error("--external-coordinator is for several nodes: give --nnodes N (2..4096) and --rdzv-endpoint")
    if args.timeout is not None and not args.timeout > 0:
        raise error(f"--timeout {args.timeout:g}: must be > 0 seconds (leave it out for no bound)")
    script = Path(args.script)
    if not script.is_file():
        raise error(f"SCRIPT {args.script}: no such file (expected a Python script to run as each rank)")
    if args.log_dir is not None:
        log_dir = Path(args.log_dir)
        try:
            log_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise error(f"--log-dir {args.log_dir}: cannot create it ({exc.strerror})") from None
        if not os.access(log_dir, os.W_OK | os.X_OK):
            raise error(f"--log-dir {args.log_dir}: not writable (expected a directory this user can write)")
