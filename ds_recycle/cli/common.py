"""What every ``ds-recycle`` subcommand shares: the usage error, the one-line argparse parser,
argument types that name their allowed values, and output files written atomically.

Only argparse and the standard library are imported here (and the planner's limits, which are
pure Python), so that ``ds-recycle --help`` stays instant.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ds_recycle.planner.limits import LIMITS

USAGE_ERROR = 2
"""The exit code of a bad argument (argparse's convention)."""


class UsageError(Exception):
    """A bad argument: the message names the problem and the allowed values. ``ds-recycle``
    prints it as one line, ``ds-recycle COMMAND: error: MESSAGE``, and exits 2."""


@dataclass(frozen=True)
class Command:
    """A subcommand: its help line, how it adds its arguments, and what it runs."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    exits_without_teardown: bool = False
    """The ``ds-recycle`` script ends this command's process as soon as ``run`` returns, without the
    interpreter's teardown (see :func:`ds_recycle.cli.console`)."""


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


def store_once(parser: argparse.ArgumentParser) -> None:
    """Every single-valued option of ``parser`` may be given once: ``--x 1 --x 2`` is a
    contradiction, not "the last one wins"."""
    for action in parser._actions:
        if type(action) is argparse._StoreAction and action.option_strings:
            action.__class__ = StoreOnce


def given_options(args: argparse.Namespace) -> dict[str, str]:
    """The single-valued options given on the command line (dest -> ``--flag value``)."""
    return args.__dict__.get("_given_options", {})


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


def shorten(text: str, limit: int) -> str:
    """``text`` if it has at most ``limit`` characters, else its start and ``...`` in ``limit``."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ----- output files: checked before the work, written to temporary names, renamed at the end ---


@dataclass
class Outputs:
    """The output files of a run (``--json``, ``--png``): checked and opened as temporary files
    next to their targets before the work starts, renamed into place only when every one is
    written, so that a refused or failed run leaves none behind."""

    targets: dict[str, Path] = field(default_factory=dict)
    """flag -> the path the user gave."""
    temporary: dict[str, Path] = field(default_factory=dict)

    @classmethod
    def prepare(
        cls,
        requested: Mapping[str, str | None],
        inputs: Mapping[str, str | None] | None = None,
        check_png: Callable[[], None] | None = None,
    ) -> Outputs:
        """Check the requested outputs (flag -> path or None), refusing one that is an input
        (``inputs``: what to call it in the message -> its path), two that name one file, and a
        ``--png`` not named ``.png``; ``check_png`` adds the command's own checks of ``--png``
        (raising :class:`UsageError`). Then create the temporary files."""
        out = cls()
        for flag, value in requested.items():
            if value is not None:
                out.targets[flag] = check_output_path(flag, value, inputs or {})
        json_path, png_path = out.targets.get("--json"), out.targets.get("--png")
        if json_path is not None and png_path is not None and same_path(json_path, png_path):
            raise UsageError(f"--json and --png name the same file {requested['--json']}: give two different paths")
        if png_path is not None:
            if png_path.suffix.lower() != ".png":
                raise UsageError(f"--png {requested['--png']}: the file name must end in .png")
            if check_png is not None:
                check_png()
        try:
            for flag, path in out.targets.items():
                out.temporary[flag] = _temporary_next_to(flag, path)
        except BaseException:
            out.discard()
            raise
        return out

    def write(self, writers: Mapping[str, Callable[[Path], None]], names: Mapping[str, str]) -> list[str]:
        """Write every output to its temporary file (``writers``: flag -> writer of a path), then
        rename them all into place; returns one ``NAME written to PATH`` line per output."""
        for flag, temporary in self.temporary.items():
            try:
                writers[flag](temporary)
            except OSError as exc:
                raise UsageError(f"{flag} {self.targets[flag]}: writing failed ({exc.strerror or exc})") from None
        mode = 0o666 & ~_umask()
        lines = []
        for flag in list(self.temporary):
            temporary = self.temporary.pop(flag)
            os.chmod(temporary, mode)
            os.replace(temporary, self.targets[flag])
            lines.append(f"{names[flag]} written to {self.targets[flag]}")
        return lines

    def discard(self) -> None:
        """Remove the temporary files that were not renamed into place."""
        for path in self.temporary.values():
            try:
                path.unlink()
            except OSError:
                pass
        self.temporary.clear()


def check_output_path(flag: str, value: str, inputs: Mapping[str, str | None]) -> Path:
    """The path of output ``flag``, refused with a :class:`UsageError` when it cannot be written
    as a new regular file or when it is one of ``inputs`` (what to call it -> its path)."""
    shown = shorten(value, 80)
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
        for what, input_path in inputs.items():
            if input_path and path.exists() and same_path(path, Path(input_path)):
                raise UsageError(f"{flag} {shown}: is the {what}; give another path")
    except (OSError, ValueError) as exc:  # an embedded NUL, a name too long for the system...
        raise UsageError(f"{flag} {shown!r}: not a usable path ({exc})") from None
    return path


def same_path(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` name one file (False when either cannot be resolved)."""
    try:
        return a.resolve() == b.resolve()
    except (OSError, ValueError, RuntimeError):
        return False


def _temporary_next_to(flag: str, path: Path) -> Path:
    try:
        fd, name = tempfile.mkstemp(prefix=f".{path.name[:100]}.", suffix=f".tmp{path.suffix[:10]}", dir=path.parent)
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot write in {path.parent} ({exc.strerror or exc})") from None
    os.close(fd)
    return Path(name)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
