"""``ds-recycle``: the command-line entry point (``ds-recycle COMMAND`` and ``python -m ds_recycle.cli
COMMAND`` are the same program).

Subcommands are registered in :data:`COMMANDS` (name -> :class:`~ds_recycle.cli.common.Command`):
``plan`` (:mod:`ds_recycle.cli.plan`), ``simulate`` (:mod:`ds_recycle.cli.simulate`), ``launch``
(:mod:`ds_recycle.cli.launch`), ``coordinator`` (:mod:`ds_recycle.cli.coordinator`) and ``status``
(:mod:`ds_recycle.cli.status`). Only
implemented ones are listed, so ``ds-recycle --help`` never advertises something that does not run.

Exit codes: 0 success, 2 bad arguments (argparse's convention, also used for a failure set that
leaves a stage without survivors: that needs a checkpoint fallback, not a plan); ``status`` exits 1
when the job's store does not answer.

A bad argument prints one line, ``ds-recycle COMMAND: error: ...``, naming the argument and the
allowed values (no usage block, no traceback), and nothing else: every argument, the size limits
(ds_recycle/planner/limits.py) and the output paths are checked before the long work starts, and
output files are written to a temporary name and renamed, so a failed run leaves none behind.

Nothing here imports torch or DeepSpeed: ``ds-recycle --help`` and ``ds-recycle plan`` stay fast.
A command imports what it needs inside its ``run``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from ds_recycle.cli import coordinator, launch, plan, simulate, status
from ds_recycle.cli.common import USAGE_ERROR, Command, Parser, UsageError, store_once
from ds_recycle.runtime.shared.transport import QUIET_STORE_ENV

COMMANDS: dict[str, Command] = {
    "plan": Command(help=plan.HELP, add_arguments=plan.add_arguments, run=plan.run),
    "launch": Command(
        help=launch.HELP, add_arguments=launch.add_arguments, run=launch.run, exits_without_teardown=True
    ),
    "simulate": Command(help=simulate.HELP, add_arguments=simulate.add_arguments, run=simulate.run),
    "coordinator": Command(help=coordinator.HELP, add_arguments=coordinator.add_arguments, run=coordinator.run),
    "status": Command(help=status.HELP, add_arguments=status.add_arguments, run=status.run),
}
"""Every subcommand, in the order ``ds-recycle --help`` lists them."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ds-recycle`` on ``argv`` (default: the command line); returns the exit code."""
    return _run(argv)[0]


def console() -> NoReturn:
    """The ``ds-recycle`` script and ``python -m ds_recycle.cli``: :func:`main` on the command line,
    then the exit. A ``launch`` agent has ended every rank and written its end to the coordinator's
    store when ``run`` returns; its process then ends at once, without the interpreter's teardown
    (torch's takes about 0.4 s). Node 0's agent waits for that end and may then end a Slurm job,
    whose remaining steps get SIGTERM: a re-admitted agent still tearing down would report 143 for a
    node that ended 0."""
    code, command = _run(None)
    if command is not None and command.exits_without_teardown:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _run(argv: Sequence[str] | None) -> tuple[int, Command | None]:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed its one line to stderr (or the help)
        return (int(exc.code) if isinstance(exc.code, int) else USAGE_ERROR), None
    for name, value in QUIET_STORE_ENV.items():  # before a command imports torch: the launcher and
        os.environ.setdefault(name, value)  # the coordinator wait on the store in bounded slices
    command = COMMANDS[args.command]
    try:
        return command.run(args), command
    except UsageError as exc:
        print(f"ds-recycle {args.command}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return USAGE_ERROR, None


def build_parser() -> argparse.ArgumentParser:
    """The ``ds-recycle`` parser with one subparser per entry of :data:`COMMANDS`."""
    parser = Parser(prog="ds-recycle", description="ReCycle for DeepSpeed pipelines: plans for failure sets.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=Parser)
    for name, command in COMMANDS.items():
        subparser = sub.add_parser(name, help=command.help, description=command.help)
        command.add_arguments(subparser)
        store_once(subparser)
    return parser


__all__ = ["COMMANDS", "UsageError", "build_parser", "main"]
