"""``ds-recycle coordinator``: the job's store and coordinator on a host of its own (a login or
service node without ranks), :func:`ds_recycle.runtime.control.host.serve`::

    ds-recycle coordinator --nnodes N --nproc-per-node G --rdzv-endpoint HOST:PORT [--node-lease S] ...

Every node's agent then runs ``ds-recycle launch ... --external-coordinator`` (node 0's included)
and joins it. The coordinator waits for every node's agent to check in, runs the job's generation
(after a predecessor died, the generation after the last one the agents ran: they restart from
the latest checkpoint), and ends once every node's agent has ended: 0 iff each ended 0.

The flags that the coordinator and ``ds-recycle launch`` share (heartbeats, the status page, the
events file) are defined here, once. Arguments are checked before anything starts; a bad one exits
2 with one line naming it and the allowed values. torch comes in only when the coordinator runs.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ds_recycle.cli import nodes
from ds_recycle.cli.common import UsageError, float_in
from ds_recycle.runtime.shared.keys import HEARTBEAT_MIN_TIMEOUT_SECONDS

if TYPE_CHECKING:
    from ds_recycle.runtime.node.launcher import LaunchConfig

HELP = "host the job's store and coordinator on a host of its own (every node's agent joins it)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("the job (the same values as its agents')")
    nodes.add_job_arguments(group)
    parser.add_argument(
        "--check-in-timeout",
        type=float_in(0, nodes.MAX_WAIT_SECONDS, low_open=True),
        default=600.0,
        metavar="S",
        help="wait up to S seconds for every node's agent before starting the job (default 600)",
    )
    parser.add_argument(
        "--timeout", type=float_in(0, 1e12, low_open=True), default=None, metavar="S", help="end after S seconds"
    )
    add_coordination_arguments(parser)


def add_coordination_arguments(parser: argparse.ArgumentParser) -> None:
    """The coordinator's own flags, for ``ds-recycle coordinator`` and ``ds-recycle launch`` (node 0 hosts)."""
    parser.add_argument(
        "--events",
        default=None,
        metavar="FILE",
        help="also write every launcher and coordinator event to FILE as JSON lines, for programs that watch the job",
    )
    parser.add_argument(
        "--status-port",
        type=int,
        default=None,
        metavar="P",
        help="serve a live, read-only status page of the job on port P of the coordinator's host (0: any free port)",
    )
    parser.add_argument(
        "--status-host",
        default="127.0.0.1",
        metavar="ADDR",
        help="the address the status page binds to (default 127.0.0.1, loopback only; 0.0.0.0: every interface)",
    )
    parser.add_argument(
        "--heartbeat-min-timeout",
        type=float,
        default=HEARTBEAT_MIN_TIMEOUT_SECONDS,
        metavar="S",
        help=f"a member is hung after at least S seconds without heartbeat (default {HEARTBEAT_MIN_TIMEOUT_SECONDS:g})",
    )
    parser.add_argument(
        "--heartbeat-factor",
        type=float,
        default=3.0,
        metavar="K",
        help="... and at least K times the slowest published iteration time (default 3)",
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="a member must heartbeat within S seconds of its start (default 120)",
    )
    parser.add_argument("--no-heartbeat", action="store_true", help="do not declare hung members failed")


def validate_coordination(args: argparse.Namespace) -> None:
    """Raise UsageError for a bad coordinator flag (see :func:`add_coordination_arguments`)."""
    for name in ("heartbeat_min_timeout", "startup_timeout"):
        value = getattr(args, name)
        if not value >= 0:  # also catches nan
            raise UsageError(f"--{name.replace('_', '-')} {value:g}: must be >= 0 seconds")
    if not args.heartbeat_factor > 0:
        raise UsageError(f"--heartbeat-factor {args.heartbeat_factor:g}: must be > 0")
    if args.status_port is not None and not 0 <= args.status_port <= 65535:
        raise UsageError(f"--status-port {args.status_port}: must be an integer in 0..65535")
    if not re.fullmatch(r"[0-9A-Za-z.:\-]{1,253}", args.status_host):
        raise UsageError(f"--status-host {args.status_host[:60]!r}: must be a host name or an IP address")
    if not args.node_lease > 0:
        raise UsageError(f"--node-lease {args.node_lease:g}: must be > 0 seconds")
    if args.events is not None:
        events, folder = Path(args.events), Path(args.events).parent
        if events.is_dir():
            raise UsageError(f"--events {args.events}: a directory (expected a file to write the events to)")
        if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
            raise UsageError(f"--events {args.events}: its folder is not a writable directory")


def heartbeat_policy(args: argparse.Namespace):
    """The :class:`~ds_recycle.runtime.control.coordinator.HeartbeatPolicy` of the flags (imports the runtime)."""
    from ds_recycle.runtime.control.coordinator import HeartbeatPolicy

    return HeartbeatPolicy(
        min_timeout=args.heartbeat_min_timeout,
        factor=args.heartbeat_factor,
        startup_timeout=args.startup_timeout,
        enabled=not args.no_heartbeat,
    )


def job_config(args: argparse.Namespace, job: nodes.NodeSpec | nodes.JobSpec, coordinator_wait: float) -> LaunchConfig:
    """The job as the flags every node's agent and the coordinator share describe it, with no
    script (``ds-recycle launch`` adds its own flags): the one reading of those flags, so that a
    standalone coordinator and node 0's host are configured alike (:meth:`LaunchConfig.host_config`)."""
    from ds_recycle.runtime.node.launcher import LaunchConfig

    return LaunchConfig(
        argv=[],
        nproc=job.nproc_per_node,
        nnodes=job.nnodes,
        endpoint=job.endpoint,
        etcd=getattr(job, "etcd", None),
        token=job.token,
        node_lease=args.node_lease,
        coordinator_wait=coordinator_wait,
        status_port=args.status_port,
        status_host=args.status_host,
        heartbeat=heartbeat_policy(args),
        events=None if args.events is None else Path(args.events),
    )


def run(args: argparse.Namespace) -> int:
    validate_coordination(args)
    job = nodes.resolve_job(args)
    from ds_recycle.runtime.control.host import LOG_PREFIX, serve
    from ds_recycle.runtime.node.launcher import EventStream

    config = job_config(args, job, args.check_in_timeout).host_config(job.token, local_node=None)
    received: list[int] = []
    previous = {
        sig: signal.signal(sig, lambda signum, frame: received.append(signum))
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    events = EventStream(None if args.events is None else Path(args.events)).open()

    def log(message: str) -> None:
        print(f"{LOG_PREFIX} {message}", file=sys.stdout, flush=True)

    code = None
    try:
        code = serve(config, log, events.emit, args.timeout, lambda: received[0] if received else None)
        return code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        events.close(code)
