"""A table-driven fuzz harness for ``ds-recycle`` subcommands.

Each subcommand is one :class:`Entry`: a strategy for a valid argument list, a table of its
options (each with a strategy of bad values), and optional extra strategies for bad combinations.
From that the harness derives bad inputs (one bad value, an option given twice, a required option
left out, an unknown option, contradictory options) and checks what every bad input must give:

- exit code 2;
- exactly one line on stderr, ``ds-recycle ...: error: ...``, that names the argument and says
  what is allowed, and nothing on stdout;
- no traceback;
- an answer within :data:`TIME_BOUND` seconds;
- no file left behind (the temporary directory holds the same files before and after).

Adding a subcommand is one more :class:`Entry` in ``ENTRIES`` (test_cli_fuzz.py).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import strategies as st

from ds_recycle.cli import main

TIME_BOUND = 20.0
"""Seconds a bad input may take in process (they are refused before any work: milliseconds)."""

GUIDANCE = re.compile(
    r"allowed|expected|choose from|required|must|give|at most|no such file|not a|does not exist|use the|needs|"
    r"not allowed with|unrecognized|is a directory|cannot|invalid",
    re.IGNORECASE,
)
"""A clear error says what is allowed or what to do; one of these words shows it does."""


# ----- argument values that need the file system ------------------------------------------------


@dataclass(frozen=True)
class File:
    """An input file with this content, created in the example's directory."""

    content: bytes
    name: str = "input.txt"


@dataclass(frozen=True)
class BadPath:
    """An output path that cannot be written: ``kind`` picks how."""

    kind: str
    name: str = "out.json"


BAD_PATH_KINDS = ("missing_dir", "is_dir", "parent_is_file", "long_name", "empty", "inside_missing_deep")


@dataclass(frozen=True)
class OutPath:
    """A good output path in the example's directory."""

    name: str


Value = str | File | BadPath | OutPath


def materialize(value: Value, root: Path) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, File):
        path = root / value.name
        path.write_bytes(value.content)
        return str(path)
    if isinstance(value, OutPath):
        return str(root / value.name)
    kind = value.kind
    if kind == "missing_dir":
        return str(root / "no-such-dir" / value.name)
    if kind == "inside_missing_deep":
        return str(root / "a" / "b" / "c" / value.name)
    if kind == "is_dir":
        (root / "a-directory").mkdir(exist_ok=True)
        return str(root / "a-directory")
    if kind == "parent_is_file":
        (root / "a-file").write_text("x")
        return str(root / "a-file" / value.name)
    if kind == "long_name":
        return str(root / ("x" * 300 + value.name))
    if kind == "empty":
        return ""
    raise ValueError(kind)


# ----- the table --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Option:
    flag: str
    bad: st.SearchStrategy[Value]
    good: st.SearchStrategy[Value] | None = None
    """A good value, used when the option is given twice; None: the option takes no value."""
    required: bool = False
    repeatable: bool = False
    excludes: tuple[str, ...] = ()
    """Options that cannot be given with this one (a mutually exclusive group), itself included."""


Args = list[tuple[str, Value | None]]
"""``(flag, value)`` pairs; ``value`` None for a flag without a value, ``flag`` "" for a positional
argument (positionals stay at the end: options are inserted before the first one)."""


@dataclass(frozen=True)
class Bad:
    """A bad argument list and the argument its error must name."""

    args: Args
    mentions: str
    why: str


@dataclass(frozen=True)
class Entry:
    command: str
    valid: st.SearchStrategy[Args]
    options: Sequence[Option]
    extra_bad: Sequence[st.SearchStrategy[Bad]] = ()
    outputs: Sequence[str] = ()
    """Flags whose value is a file the command writes."""
    fast_valid: bool = True
    """Whether valid inputs finish in well under a second (so they can be fuzzed in process too)."""

    def bad(self) -> st.SearchStrategy[Bad]:
        kinds = [_bad_value(self), _given_twice(self), _unknown_option(self), *self.extra_bad]
        if any(o.required for o in self.options):
            kinds.append(_missing_required(self))
        return st.one_of(kinds)


def render(args: Args, root: Path) -> list[str]:
    out: list[str] = []
    for flag, value in args:
        if flag:
            out.append(flag)
        if value is not None:
            out.append(materialize(value, root))
    return out


def insert(args: Args, where: int, item: tuple[str, Value | None]) -> None:
    """Insert an option at ``where``, but before the first positional argument."""
    first_positional = next((i for i, (flag, _) in enumerate(args) if flag == ""), len(args))
    args.insert(min(where, first_positional), item)


def _without(args: Args, flag: str, excludes: Sequence[str] = ()) -> Args:
    return [(f, v) for f, v in args if f != flag and f not in excludes]


def _bad_value(entry: Entry) -> st.SearchStrategy[Bad]:
    @st.composite
    def build(draw) -> Bad:
        args = draw(entry.valid)
        option = draw(st.sampled_from(list(entry.options)))
        value = draw(option.bad)
        where = draw(st.integers(0, len(args)))
        args = _without(args, option.flag, option.excludes) if not option.repeatable else args
        insert(args, where, (option.flag, value))
        return Bad(args, option.flag, f"bad value for {option.flag}")

    return build()


def _given_twice(entry: Entry) -> st.SearchStrategy[Bad]:
    once = [o for o in entry.options if not o.repeatable and o.good is not None]

    @st.composite
    def build(draw) -> Bad:
        args = draw(entry.valid)
        option = draw(st.sampled_from(once))
        first, second = draw(option.good), draw(option.good)
        args = _without(args, option.flag, option.excludes)
        insert(args, draw(st.integers(0, len(args))), (option.flag, first))
        insert(args, draw(st.integers(0, len(args))), (option.flag, second))
        return Bad(args, option.flag, f"{option.flag} given twice")

    return build()


def _missing_required(entry: Entry) -> st.SearchStrategy[Bad]:
    required = [o for o in entry.options if o.required]

    @st.composite
    def build(draw) -> Bad:
        option = draw(st.sampled_from(required))
        return Bad(_without(draw(entry.valid), option.flag), option.flag, f"{option.flag} missing")

    return build()


def _unknown_option(entry: Entry) -> st.SearchStrategy[Bad]:
    @st.composite
    def build(draw) -> Bad:
        args = draw(entry.valid)
        known = {o.flag for o in entry.options}
        name = draw(st.from_regex(r"--[a-z][a-z-]{2,12}", fullmatch=True).filter(lambda f: f not in known))
        known_prefixes = [f for f in known if f.startswith(name)]  # argparse accepts unique prefixes
        if known_prefixes:
            name = "--no-such-option"
        insert(args, draw(st.integers(0, len(args))), (name, None))
        return Bad(args, name, f"unknown option {name}")

    return build()


# ----- running ----------------------------------------------------------------------------------


@dataclass
class Outcome:
    code: int
    out: str
    err: str
    seconds: float
    before: set[str] = field(default_factory=set)
    after: set[str] = field(default_factory=set)


@contextlib.contextmanager
def time_bound(seconds: float) -> Iterator[None]:
    """Raise TimeoutError in the main thread if the block runs longer than ``seconds``."""

    def expire(signum, frame):
        raise TimeoutError(f"no answer within {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def run_in_process(argv: list[str], root: Path, bound: float = TIME_BOUND) -> Outcome:
    before = files_under(root)
    out, err = io.StringIO(), io.StringIO()
    began = time.perf_counter()
    with time_bound(bound), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return Outcome(code, out.getvalue(), err.getvalue(), time.perf_counter() - began, before, files_under(root))


def check_clear_error(outcome: Outcome, command: str, mentions: str, argv: Sequence[str]) -> None:
    """The contract for a bad input (see the module docstring)."""
    context = f"argv={list(argv)!r}\nstdout={outcome.out!r}\nstderr={outcome.err!r}"
    assert outcome.code == 2, f"exit code {outcome.code}, expected 2\n{context}"
    assert "Traceback" not in outcome.err, context
    lines = outcome.err.splitlines()
    assert len(lines) == 1, f"{len(lines)} lines on stderr, expected 1\n{context}"
    line = lines[0]
    assert line.startswith("ds-recycle") and ": error: " in line, context
    assert mentions in line, f"the error does not name {mentions}\n{context}"
    assert GUIDANCE.search(line), f"the error does not say what is allowed\n{context}"
    assert outcome.out == "", f"output on stdout for a bad input\n{context}"
    assert outcome.after == outcome.before, f"files left behind: {sorted(outcome.after - outcome.before)}\n{context}"


@dataclass
class Tally:
    """Counts of fuzzed inputs, for the report (``DS_RECYCLE_FUZZ_TALLY=1`` prints them)."""

    tried: dict[str, int] = field(default_factory=dict)
    clear: dict[str, int] = field(default_factory=dict)

    def add(self, key: str, clear: bool) -> None:
        self.tried[key] = self.tried.get(key, 0) + 1
        self.clear[key] = self.clear.get(key, 0) + int(clear)


TALLY = Tally()


def examples(default: int) -> int:
    """``max_examples``: the default keeps CI bounded; DS_RECYCLE_FUZZ_EXAMPLES raises it for a long run."""
    value = os.environ.get("DS_RECYCLE_FUZZ_EXAMPLES")
    return int(value) if value else default


Runner = Callable[[list[str], Path], Outcome]
