"""``ds-recycle status``: a running job's status page, printed in a terminal::

    ds-recycle status --rdzv-endpoint HOST:PORT [--json] [--timeout S]

HOST:PORT is the job's store: the ``--rdzv-endpoint`` of a job on several nodes (or of ``ds-recycle
coordinator``), or the ``store listening on HOST:PORT`` line of a one-node ``ds-recycle launch``.
It reads the store as the status page does (:func:`ds_recycle.runtime.control.status.read_status`) and
writes nothing to it, so it needs no job token. With ``DS_RECYCLE_TOKEN`` set (the job's token) it
checks every record's seal and refuses a store whose records are not the job's; without it, it
shows the records unchecked. It never prints the token. ``--json`` prints what the page's ``/status.json`` serves.

A bad endpoint exits 2 with one line (before any connection); a store that does not answer within
``--timeout``, or one that holds no ds-recycle job, exits 1 with one line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
from collections.abc import Iterator

from ds_recycle.cli import nodes
from ds_recycle.cli.common import UsageError, float_in, shorten

HELP = "print a running job's status (workers, plan, last changes, Gantt chart) from its store"
HOST_PATTERN = r"[0-9A-Za-z._\-]{1,253}|\[?[0-9A-Fa-f:.]{2,64}\]?"
FAILURE_EXIT_CODE = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        dest="rdzv_endpoint",
        required=True,
        metavar="HOST:PORT",
        help="the job's store: its --rdzv-endpoint, or the `store listening on` address of a one-node launch",
    )
    parser.add_argument(
        "--rdzv-backend",
        "--rdzv_backend",
        dest="rdzv_backend",
        default="c10d",
        metavar="{c10d,etcd}",
        help="etcd: --rdzv-endpoint names the job's etcd members (HOST:PORT[,...]); the job is found by "
        "DS_RECYCLE_TOKEN",
    )
    parser.add_argument("--json", action="store_true", help="print the status as JSON (the page's /status.json)")
    parser.add_argument(
        "--timeout",
        type=float_in(0, 3600, low_open=True),
        default=5.0,
        metavar="S",
        help="give up when the store does not answer within S seconds (default 5)",
    )


def run(args: argparse.Namespace) -> int:
    token = os.environ.get(nodes.TOKEN_ENV) or None
    members = nodes.etcd_endpoints(args)
    if members is not None:
        if token is None:
            raise UsageError(f"--rdzv-backend etcd: set {nodes.TOKEN_ENV} (the job's token names its keys in etcd)")
        from ds_recycle.runtime.shared import transport
        from ds_recycle.runtime.shared.etcd_transport import job_name

        where = address = transport.etcd_address(members, job_name(token))
    else:
        host, port = nodes.parse_endpoint(args.rdzv_endpoint)
        if not re.fullmatch(HOST_PATTERN, host):
            raise UsageError(
                f"--rdzv-endpoint {shorten(host, 60)!r}: expected a host name or an IP address before :PORT"
            )
        where, address = f"{host}:{port}", f"{host.strip('[]')}:{port}"
    from ds_recycle.runtime.control import status
    from ds_recycle.runtime.shared.c10d_store import C10dJobStore, C10dStoreRoot

    try:
        with _quiet_stderr():  # torch's store client logs every retry, with a C++ stack, to fd 2
            root = C10dStoreRoot.connect(address, token, timeout=args.timeout, connect_timeout=args.timeout)
            generation = root.running_generation()
            if generation is not None:
                store = C10dJobStore.connect(
                    address, generation, token, timeout=args.timeout, connect_timeout=args.timeout
                )
                job = status.read_status(store, generation)
    except (RuntimeError, OSError, ValueError) as exc:  # torch's DistNetworkError and DistStoreError included
        reason = shorten(" ".join(str(exc).split()), 160)
        return _fail(f"cannot read the job's store at {where} within {args.timeout:g} s ({reason})")
    if generation is None:
        return _fail(f"the store at {where} holds no ds-recycle job (no generation yet: is the job starting?)")
    print(json.dumps(job.to_dict(), indent=1) if args.json else status.text(job, where), flush=True)
    return 0


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _fail(message: str) -> int:
    print(f"ds-recycle status: error: {message}", file=sys.stderr)
    return FAILURE_EXIT_CODE
