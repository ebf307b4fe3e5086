"""ReCycle's NCCL failure path measured on real processes: how fast a survivor's wait ends once the
failure flag is raised, what aborting its communicators costs, whether its CUDA stream is clear
afterwards, and what the survivors then pay for new communicators.

``python -m ds_recycle.testing.nccl_abort [--ranks 3] [--json OUT]``. This process hosts a TCP store
on 127.0.0.1 and, for each scenario, starts ``--ranks`` fresh rank processes (all on the GPUs
present: several ranks on one GPU each get a host of their own,
:func:`~ds_recycle.runtime.rank.communication.prepare_nccl`). It drives and times them through store
keys; each rank reports its own measures back through the store. The last rank is the victim.

- **all-reduce** / **recv** / **sigstop**: after a warm-up all-reduce (and, for recv, a send from the
  victim to each survivor), the survivors post an all-reduce that the victim never joins (recv: a
  receive from the victim) through :class:`~ds_recycle.runtime.rank.waiting.Waiter` and say so; this
  process SIGKILLs the victim (sigstop: SIGSTOPs it), waits :data:`FLAG_DELAY_SECONDS` and sets the
  ``failed`` key. A thread of each survivor waits for that key and raises its waiter's flag. Each
  survivor measures the time from its flag to its wait's ``PeerFailure``, the cost of
  :func:`~ds_recycle.runtime.rank.communication.abort_groups` on its world, and whether
  ``torch.cuda.synchronize()`` returns afterwards. A wait that ended before the flag (the backend
  reported the dead peer first) is reported as such: a negative time.
- after all-reduce, the survivors (NCCL only) take the aborted world out of torch's registry and
  time a fresh world of their own (``init_process_group``, lazy, + first all-reduce), then a
  non-blocking one (``ProcessGroupNCCL.Options().config.blocking = 0``, eager: ``device_id``), whose
  ``init_process_group`` may return before its communicator is ready.
- **split** (NCCL only; nobody fails): in a lazily connected world of all ranks, the survivors time
  ``new_group(use_local_synchronization=True)`` + first all-reduce (a fresh communicator); then in an
  eagerly initialized world (``device_id``), ``split_group`` + first all-reduce (``ncclCommSplit``),
  and last ``new_group(use_local_synchronization=True)`` from that world, which splits the parent's
  communicator without its other ranks and may hang (bounded, reported).

Every wait is bounded; a scenario that fails prints ``nccl abort: SCENARIO FAILED: ...`` (with the
tail of its ranks' logs) and the next one runs; the children are SIGKILLed by PID at its end.
``--backend gloo`` runs all-reduce, recv and sigstop with gloo on CPU tensors: gloo has no abort
(``abort_groups`` leaves its groups alone) and no stream to check, which tests the harness itself on
a machine without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ds_recycle.errors import PeerFailure
from ds_recycle.runtime.rank import communication
from ds_recycle.runtime.rank.communication import GLOO, NCCL
from ds_recycle.runtime.rank.waiting import Waiter
from ds_recycle.runtime.shared.transport import QUIET_STORE_ENV

HOST = "127.0.0.1"
HARNESS_SECONDS = 110.0
"""The whole harness's budget: a scenario is not started with less than :data:`MIN_START_SECONDS`
of it left."""
MIN_START_SECONDS = 15.0
SCENARIO_SECONDS = 60.0
"""The longest a scenario may take, from its ranks' start to their last report."""
GROUP_TIMEOUT = timedelta(seconds=120)
FLAG_DELAY_SECONDS = 0.2
"""From the victim's signal to the ``failed`` key."""
SETTLE_SECONDS = 0.05
"""From the survivors' "posted" to the victim's signal: their op is in flight by then."""
FLAG_AFTER_END_SECONDS = 5.0
"""How long a survivor whose wait ended before the flag waits for the flag (to time the two)."""
ABORT_SECONDS = 20.0
STREAM_SECONDS = 10.0
COMM_SECONDS = 30.0
LOCAL_FROM_EAGER_SECONDS = 8.0
BARRIER_SECONDS = 40.0
POLL_SECONDS = 0.01
ELEMENTS = 1024
LOG_TAIL_LINES = 15
ABANDON = "abandon"

ALL_REDUCE = "all-reduce"
RECV = "recv"
SPLIT = "split"


@dataclass(frozen=True)
class Scenario:
    name: str
    op: str | None
    """What the survivors wait on when the victim fails (None: nobody fails)."""
    signal: int | None = None
    comms: bool = False
    """After the abort, the survivors time fresh worlds of their own (NCCL)."""

    def describe(self) -> str:
        if self.signal is None:
            return self.name
        what = "recv from the peer" if self.op == RECV else self.op
        done = "SIGKILLed" if self.signal == signal.SIGKILL else "SIGSTOPped"
        return f"{what}, peer {done}"


SCENARIOS = {
    ALL_REDUCE: Scenario(ALL_REDUCE, ALL_REDUCE, signal.SIGKILL, comms=True),
    RECV: Scenario(RECV, RECV, signal.SIGKILL),
    "sigstop": Scenario("sigstop", ALL_REDUCE, signal.SIGSTOP),
    SPLIT: Scenario(SPLIT, None),
}
FAILURE_SCENARIOS = (ALL_REDUCE, RECV, "sigstop")


@dataclass
class Bounded:
    """The outcome of a call run in a thread of its own with a join timeout."""

    value: object = None
    seconds: float = 0.0
    error: str | None = None
    """``"hung: ..."`` when the call did not return in time, else the error it raised."""


@dataclass
class SurvivorReport:
    """What a survivor measured, sent through the store."""

    rank: int
    ended_by: str
    """``"flag"``, or the error that ended the wait before the flag was seen."""
    flag_to_end_ms: float | None
    """From the flag being raised to the wait's PeerFailure (negative: the wait ended first);
    None when the flag never came."""
    ended_wall: float
    flag_wall: float | None
    abort_ms: float | None
    abort_error: str | None
    stream: str
    """``"clear"``, ``"hung: ..."``, ``"error: ..."`` or why it was not checked."""


@dataclass
class SurvivorOutcome:
    rank: int
    ended_by: str
    flag_to_end_ms: float | None
    kill_to_end_ms: float
    flag_seen_ms: float | None
    """From this process setting ``failed`` to the survivor's flag."""
    abort_ms: float | None
    abort_error: str | None
    stream: str


@dataclass
class ScenarioResult:
    name: str
    description: str
    victim: int
    survivors: list[SurvivorOutcome] = field(default_factory=list)
    comms: list[dict] = field(default_factory=list)
    """all-reduce on NCCL: each survivor's fresh and non-blocking worlds; split: each rank's costs."""
    comms_error: str | None = None
    error: str | None = None
    seconds: float = 0.0


@dataclass
class HarnessReport:
    backend: str
    ranks: int
    versions: dict
    scenarios: list[ScenarioResult] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    skipped: str | None = None
    seconds: float = 0.0


class ScenarioError(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------------
# This process: the store, the ranks, the timing of the failure.


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.rank_of:
        return _rank_main(args)
    began = time.monotonic()
    report = HarnessReport(args.backend, args.ranks, _versions(args.backend))
    label = f"{args.backend} abort:"
    try:
        if args.backend == NCCL and not torch.cuda.is_available():
            report.skipped = "no CUDA device (torch.cuda.is_available() is False)"
        elif args.backend == NCCL and not dist.is_nccl_available():
            report.skipped = "this torch has no NCCL (dist.is_nccl_available() is False)"
        if report.skipped:
            print(f"{label} skipped: {report.skipped}", flush=True)
            return 0
        print(f"{label} {_describe_versions(report.versions)}; {args.ranks} ranks", flush=True)
        names = args.scenarios.split(",") if args.scenarios else _default_scenarios(args.backend)
        report.scenarios = _run_all(args, names, began, label)
        report.summary = _summary(report.scenarios)
        if args.backend == NCCL:
            print(
                f"nccl comms (slowest rank, each with its first all-reduce): {_describe_summary(report.summary)}",
                flush=True,
            )
    finally:
        report.seconds = time.monotonic() - began
        if args.json:
            Path(args.json).write_text(json.dumps(asdict(report), indent=2))
    return 1 if any(s.error for s in report.scenarios) else 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m ds_recycle.testing.nccl_abort", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--ranks", type=int, default=3, help="rank processes per scenario (>= 2; the last is the victim)"
    )
    parser.add_argument("--json", metavar="OUT", help="write every measure to OUT as JSON")
    parser.add_argument(
        "--backend", choices=(NCCL, GLOO), default=NCCL, help="gloo: CPU tensors, no abort (a self-test)"
    )
    parser.add_argument(
        "--scenarios", help=f"comma-separated, of {', '.join(SCENARIOS)} (default: all the backend runs)"
    )
    parser.add_argument("--budget", type=float, default=HARNESS_SECONDS, help="seconds for the whole harness")
    parser.add_argument("--rank-of", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.ranks < 2:
        parser.error("--ranks must be at least 2")
    for name in (args.scenarios or "").split(","):
        if name and name not in SCENARIOS:
            parser.error(f"unknown scenario {name!r}")
    if args.backend == GLOO and SPLIT in (args.scenarios or "").split(","):
        parser.error("the split scenario needs NCCL")
    return args


def _default_scenarios(backend: str) -> list[str]:
    return [*FAILURE_SCENARIOS, SPLIT] if backend == NCCL else list(FAILURE_SCENARIOS)


def _versions(backend: str) -> dict:
    versions = {"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": None, "gpu": None, "gpus": 0}
    if backend != NCCL or not torch.cuda.is_available():
        return versions
    try:
        nccl = torch.cuda.nccl.version()
        versions["nccl"] = ".".join(str(n) for n in nccl) if isinstance(nccl, tuple) else str(nccl)
    except Exception as error:  # reported, not fatal
        versions["nccl"] = f"unknown ({error})"
    try:
        versions["gpus"] = torch.cuda.device_count()
        versions["gpu"] = torch.cuda.get_device_name(0)
    except Exception as error:
        versions["gpu"] = f"unknown ({error})"
    return versions


def _describe_versions(versions: dict) -> str:
    if versions["gpu"] is None:
        return f"torch {versions['torch']}, CPU tensors (gloo: no abort, no stream check)"
    return (
        f"GPU {versions['gpu']} (x{versions['gpus']}); torch {versions['torch']}, CUDA {versions['cuda']}, "
        f"NCCL {versions['nccl']}"
    )


def _run_all(args: argparse.Namespace, names: list[str], began: float, label: str) -> list[ScenarioResult]:
    master = dist.TCPStore(HOST, 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    logs = Path(tempfile.mkdtemp(prefix="nccl_abort."))
    results, keep_logs = [], False
    for name in names:
        scenario = SCENARIOS[name]
        left = args.budget - (time.monotonic() - began)
        result = ScenarioResult(name, scenario.describe(), victim=args.ranks - 1)
        if left < MIN_START_SECONDS:
            result.error = f"not started: {max(left, 0):.0f} s of the harness's {args.budget:.0f} s left"
        else:
            _run_scenario(scenario, args, master, logs, min(SCENARIO_SECONDS, left), result)
        results.append(result)
        keep_logs |= _print_scenario(result, label, args.backend, logs)
    if keep_logs:
        print(f"{label} rank logs kept in {logs}", flush=True)
    else:
        shutil.rmtree(logs, ignore_errors=True)
    return results


def _run_scenario(
    scenario: Scenario, args: argparse.Namespace, master: dist.Store, logs: Path, seconds: float, result: ScenarioResult
) -> None:
    began = time.monotonic()
    deadline = began + seconds
    store = dist.PrefixStore(f"{scenario.name}/", master)
    everyone = list(range(args.ranks))
    victim = args.ranks - 1
    survivors = everyone[:-1]
    procs: dict[int, subprocess.Popen] = {}
    try:
        procs = _start_ranks(scenario, args, master.port, logs)
        if scenario.signal is None:
            values = _wait_for(store, {r: f"split/{r}" for r in everyone}, procs, deadline, "its costs")
            result.comms = [values[r] for r in everyone]
            return
        _wait_for(store, {r: f"ready/{r}" for r in everyone}, procs, deadline, "the warm-up")
        store.set("go", "1")
        _wait_for(store, {r: f"posted/{r}" for r in survivors}, procs, deadline, "posting its op")
        time.sleep(SETTLE_SECONDS)
        killed_at = time.time()
        os.kill(procs[victim].pid, scenario.signal)
        time.sleep(FLAG_DELAY_SECONDS)
        flagged_at = time.time()
        store.set("failed", "1")
        values = _wait_for(store, {r: f"result/{r}" for r in survivors}, procs, deadline, "its result")
        for rank in survivors:
            report = SurvivorReport(**values[rank])
            result.survivors.append(
                SurvivorOutcome(
                    rank=rank,
                    ended_by=report.ended_by,
                    flag_to_end_ms=report.flag_to_end_ms,
                    kill_to_end_ms=(report.ended_wall - killed_at) * 1000,
                    flag_seen_ms=None if report.flag_wall is None else (report.flag_wall - flagged_at) * 1000,
                    abort_ms=report.abort_ms,
                    abort_error=report.abort_error,
                    stream=report.stream,
                )
            )
        if scenario.comms and args.backend == NCCL:
            try:
                values = _wait_for(store, {r: f"comms/{r}" for r in survivors}, procs, deadline, "its new worlds")
                result.comms = [values[r] for r in survivors]
            except ScenarioError as error:
                reported = [store.get(f"comms/{r}").decode() for r in survivors if store.check([f"comms/{r}"])]
                result.comms_error = f"{error}; reported: {'; '.join(reported) or 'nothing'}"
    except Exception as error:
        result.error = f"{type(error).__name__}: {error}" if not isinstance(error, ScenarioError) else str(error)
    finally:
        try:
            store.set("end", "1")
        except Exception:  # the store is this process's own: only a broken harness gets here
            pass
        _stop_ranks(procs)
        result.seconds = time.monotonic() - began


def _start_ranks(scenario: Scenario, args: argparse.Namespace, port: int, logs: Path) -> dict[int, subprocess.Popen]:
    root = str(Path(__file__).resolve().parents[2])
    procs = {}
    for rank in range(args.ranks):
        env = dict(os.environ)
        for name, value in QUIET_STORE_ENV.items():
            env.setdefault(name, value)
        if args.backend == NCCL:
            env.setdefault("NCCL_DEBUG", "WARN")  # in the rank's log, whose tail a failure prints
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(args.ranks),
            LOCAL_WORLD_SIZE=str(args.ranks),
            PYTHONPATH=os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p),
        )
        command = [sys.executable, "-m", "ds_recycle.testing.nccl_abort", "--rank-of", scenario.name]
        command += ["--port", str(port), "--backend", args.backend, "--ranks", str(args.ranks)]
        with open(logs / f"{scenario.name}.rank{rank}.log", "wb") as log:
            procs[rank] = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root)
    return procs


def _wait_for(
    store: dist.Store, keys: dict[int, str], procs: dict[int, subprocess.Popen], deadline: float, what: str
) -> dict[int, object]:
    """The values of ``keys`` (rank -> key), JSON-decoded; a rank's error, a rank that exits without
    its key, or the deadline ends the wait with :class:`ScenarioError`."""
    values: dict[int, object] = {}
    while True:
        for rank, key in keys.items():
            if rank not in values and store.check([key]):
                values[rank] = json.loads(store.get(key))
        if len(values) == len(keys):
            return values
        for rank in procs:
            if store.check([f"error/{rank}"]):
                raise ScenarioError(f"rank {rank}: {store.get(f'error/{rank}').decode(errors='replace')}")
        for rank in keys:
            code = procs[rank].poll()
            if rank not in values and code is not None and not store.check([keys[rank]]):
                raise ScenarioError(f"rank {rank} exited with code {code} before {what}")
        if time.monotonic() > deadline:
            missing = sorted(set(keys) - set(values))
            raise ScenarioError(f"timed out waiting for {what} of rank(s) {missing}")
        time.sleep(POLL_SECONDS)


def _stop_ranks(procs: dict[int, subprocess.Popen]) -> None:
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()  # SIGKILL ends a stopped process too
    for proc in procs.values():
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _print_scenario(result: ScenarioResult, label: str, backend: str, logs: Path) -> bool:
    """Print the scenario's line(s); whether its logs are worth keeping."""
    if result.error:
        print(f"{label} {result.name} FAILED: {result.error}", flush=True)
        for log in sorted(logs.glob(f"{result.name}.rank*.log")):
            lines = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
            for line in lines:
                print(f"    {log.stem.split('.')[-1]}| {line}", flush=True)
        return True
    if result.name == SPLIT:
        print(f"nccl comms: split scenario: {_describe_split(result.comms)}", flush=True)
        return any("error" in c for c in result.comms)
    print(f"{label} {result.description}: {_describe_failure(result, backend)}", flush=True)
    if result.comms or result.comms_error:
        print(f"nccl comms: survivors after the abort: {_describe_fresh(result)}", flush=True)
    return result.comms_error is not None or any(s.stream != "clear" for s in result.survivors if backend == NCCL)


def _describe_failure(result: ScenarioResult, backend: str) -> str:
    survivors = result.survivors
    flagged = [s.flag_to_end_ms for s in survivors if s.flag_to_end_ms is not None]
    if flagged:
        worst = max(flagged)
        when = f"{worst:.1f} ms after" if worst >= 0 else f"{-worst:.1f} ms before"
        text = f"wait ended {when} the flag"
    else:
        text = "the flag never came"
    text += f" (kill->end {max(s.kill_to_end_ms for s in survivors):.0f} ms"
    text += f"; worst of {len(survivors)} survivors)" if len(survivors) > 1 else ")"
    aborts = [s.abort_ms for s in survivors if s.abort_ms is not None]
    errors = [f"rank {s.rank}: {s.abort_error}" for s in survivors if s.abort_error]
    text += f"; abort {max(aborts):.1f} ms" if aborts else ""
    text += f"; abort failed ({'; '.join(errors)})" if errors else ""
    if backend != NCCL:
        text += " (gloo: nothing to abort); stream check skipped (gloo)"
    elif all(s.stream == "clear" for s in survivors):
        text += "; stream clear"
    else:
        text += "; stream NOT clear: " + ", ".join(f"rank {s.rank} {s.stream}" for s in survivors)
    errors = sorted({_short(s.ended_by) for s in survivors if s.ended_by != "flag"})
    if errors:
        early = [s.rank for s in survivors if s.ended_by != "flag"]
        text += f" [the wait of rank(s) {early} ended by an error: {' | '.join(errors)}]"
    return text


def _short(message: str) -> str:
    """An error without its source locations and ports, its first sentence."""
    message = re.sub(r"\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\] ", "", message)
    return re.sub(r"\]:\d+", "]", message).split(". ")[0][:160]


def _ms(cost: dict | None, key: str = "total_ms") -> str:
    if not cost:
        return "n/a"
    if "error" in cost:
        return f"n/a: {cost['error']}"
    return f"{cost[key]:.0f} ms"


def _worst(costs: list[dict], step: str) -> dict | None:
    """The slowest rank's cost of ``step``, or the first error among them."""
    found = [c[step] for c in costs if isinstance(c.get(step), dict)]
    failed = [f for f in found if "error" in f]
    if failed:
        return failed[0]
    return max(found, key=lambda f: f.get("total_ms", 0.0), default=None)


def _describe_fresh(result: ScenarioResult) -> str:
    if result.comms_error:
        return f"n/a: {result.comms_error}"
    errors = [c["error"] for c in result.comms if "error" in c]
    if errors:
        return f"n/a: {errors[0]}"
    fresh, nonblocking = _worst(result.comms, "fresh"), _worst(result.comms, "nonblocking")
    text = f"fresh init + first all-reduce {_ms(fresh)}"
    if fresh and "error" not in fresh:
        text += f" (init {_ms(fresh, 'init_ms')})"
    text += f"; non-blocking init + first all-reduce {_ms(nonblocking)}"
    if nonblocking and "error" not in nonblocking:
        text += f" (init {_ms(nonblocking, 'init_ms')}; {nonblocking.get('how', '')})"
    return text


def _describe_split(costs: list[dict]) -> str:
    parts = [
        f"eager world of all + first all-reduce {_ms(_worst(costs, 'eager_world'))}",
        f"split_group + first all-reduce {_ms(_worst(costs, 'split_group'))}",
        f"new_group(local sync) in a lazy world + first all-reduce {_ms(_worst(costs, 'local_new_group'))}",
        f"new_group(local sync) from the eager world {_ms(_worst(costs, 'local_new_group_from_eager'))}",
    ]
    errors = [f"rank {c['rank']}: {c['error']}" for c in costs if "error" in c]
    return "; ".join(parts + errors)


def _summary(results: list[ScenarioResult]) -> dict:
    """The costs the issue compares, each the slowest rank's (ms; None where not measured)."""

    def total(cost: dict | None) -> float | None:
        return None if not cost or "error" in cost else cost["total_ms"]

    by_name = {r.name: r for r in results}
    aborts = [s.abort_ms for r in results for s in r.survivors if s.abort_ms is not None]
    after = by_name.get(ALL_REDUCE)
    split = by_name.get(SPLIT)
    return {
        "fresh_init_ms": total(_worst(after.comms, "fresh")) if after else None,
        "nonblocking_init_ms": total(_worst(after.comms, "nonblocking")) if after else None,
        "split_ms": total(_worst(split.comms, "split_group")) if split else None,
        "local_new_group_ms": total(_worst(split.comms, "local_new_group")) if split else None,
        "abort_ms": max(aborts, default=None),
    }


def _describe_summary(summary: dict) -> str:
    names = {
        "fresh_init_ms": "fresh init",
        "nonblocking_init_ms": "non-blocking init",
        "split_ms": "split",
        "local_new_group_ms": "new_group(local sync)",
        "abort_ms": "abort",
    }
    return ", ".join(
        f"{names[k]} {'n/a' if v is None else f'{v:.1f} ms' if k == 'abort_ms' else f'{v:.0f} ms'}"
        for k, v in summary.items()
    )


# ---------------------------------------------------------------------------------------------
# A rank process.


@dataclass
class RankContext:
    rank: int
    world: int
    backend: str
    port: int
    prefix: str
    report: dist.Store
    """This rank's client of the harness's store (its main thread's), under the scenario's prefix."""
    device: torch.device

    @property
    def victim(self) -> int:
        return self.world - 1

    @property
    def everyone(self) -> list[int]:
        return list(range(self.world))

    @property
    def survivors(self) -> list[int]:
        return list(range(self.world - 1))

    def client(self, prefix: str = "") -> dist.Store:
        """A client of its own (a blocking store call holds its client for others)."""
        store = dist.TCPStore(HOST, self.port, None, False, timedelta(seconds=BARRIER_SECONDS), wait_for_workers=False)
        return dist.PrefixStore(f"{self.prefix}{prefix}", store)

    def ones(self) -> torch.Tensor:
        return torch.ones(ELEMENTS, device=self.device)


def _rank_main(args: argparse.Namespace) -> int:
    rank = int(os.environ["RANK"])
    prefix = f"{args.rank_of}/"
    report = None
    code = 0
    try:
        store = dist.TCPStore(HOST, args.port, None, False, timedelta(seconds=BARRIER_SECONDS), wait_for_workers=False)
        report = dist.PrefixStore(prefix, store)
        if args.backend == NCCL:
            print(f"rank {rank}: NCCL environment {communication.prepare_nccl(os.environ)}", flush=True)
            index = int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count()
            torch.cuda.set_device(index)
            device = torch.device("cuda", index)
        else:
            device = torch.device("cpu")
        ctx = RankContext(rank, int(os.environ["WORLD_SIZE"]), args.backend, args.port, prefix, report, device)
        scenario = SCENARIOS[args.rank_of]
        if scenario.signal is None:
            _split_rank(ctx)
        else:
            _failure_rank(ctx, scenario)
    except BaseException as error:
        code = 1
        message = f"{type(error).__name__}: {error}"
        traceback.print_exc()
        if report is not None:
            try:
                report.set(ABANDON, f"rank {rank}: {message}"[:300])
                report.set(f"error/{rank}", message[:2000])
            except Exception:  # the harness is gone
                pass
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # No teardown: aborted communicators and abandoned waits stay behind.
        os._exit(code)
    return code


def _bounded(call: Callable[[], object], seconds: float, device: torch.device) -> Bounded:
    outcome = Bounded()

    def target() -> None:
        if device.type == "cuda":
            torch.cuda.set_device(device)  # the current device is the thread's own
        began = time.perf_counter()
        try:
            outcome.value = call()
        except BaseException as error:  # reported to the caller
            outcome.error = f"{type(error).__name__}: {error}"[:500]
        outcome.seconds = time.perf_counter() - began

    thread = threading.Thread(target=target, name="nccl-abort-bounded", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        return Bounded(seconds=seconds, error=f"hung: not done after {seconds:.0f} s")
    return outcome


def _barrier(ctx: RankContext, name: str, members: list[int]) -> None:
    """Wait until every member got here; a rank that gave up (``abandon``) ends it at once."""
    ctx.report.set(f"barrier/{name}/{ctx.rank}", "1")
    keys = [f"barrier/{name}/{r}" for r in members]
    deadline = time.monotonic() + BARRIER_SECONDS
    while not ctx.report.check(keys):
        if ctx.report.check([ABANDON]):
            raise RuntimeError(f"barrier {name}: another rank gave up ({ctx.report.get(ABANDON).decode()})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"barrier {name}: not every one of ranks {members} got there in {BARRIER_SECONDS:.0f} s")
        time.sleep(POLL_SECONDS)


def _abandon(ctx: RankContext, why: str) -> None:
    """Tell the other ranks' barriers that this rank will not come."""
    try:
        ctx.report.set(ABANDON, f"rank {ctx.rank}: {why}"[:300])
    except Exception:  # the harness is gone
        pass


def _init_world(ctx: RankContext, name: str, members: list[int], **options) -> None:
    dist.init_process_group(
        ctx.backend,
        store=ctx.client(f"{name}/"),
        rank=members.index(ctx.rank),
        world_size=len(members),
        timeout=GROUP_TIMEOUT,
        **options,
    )


class FlagWatch:
    """Raises a waiter's flag when the harness sets ``failed``; the time it did so."""

    def __init__(self, ctx: RankContext, flag: threading.Event):
        self.flag = flag
        self.raised_at: float | None = None
        self.raised_wall: float | None = None
        self.raised = threading.Event()
        self._store = ctx.client()
        self._thread = threading.Thread(target=self._run, name="nccl-abort-flag", daemon=True)

    def start(self) -> FlagWatch:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self._store.wait(["failed"], timedelta(seconds=SCENARIO_SECONDS))
        except Exception:  # no failure announced: the harness timed out or is gone
            return
        self.raised_at, self.raised_wall = time.perf_counter(), time.time()
        self.flag.set()
        self.raised.set()


def _warm_up(ctx: RankContext, op: str) -> None:
    waiter = Waiter()
    tensor = ctx.ones()
    waiter.collective(lambda: dist.all_reduce(tensor, async_op=True), "the warm-up all-reduce")
    if tensor[0].item() != ctx.world:
        raise RuntimeError(f"the warm-up all-reduce gave {tensor[0].item()}, not {ctx.world}")
    if op != RECV:
        return
    for survivor in ctx.survivors:  # the pairs the survivors will wait on exist before the failure
        buffer = ctx.ones()
        if ctx.rank == ctx.victim:
            waiter.p2p(lambda b=buffer, s=survivor: dist.isend(b, dst=s), f"the warm-up send to {survivor}")
        elif ctx.rank == survivor:
            waiter.p2p(lambda b=buffer: dist.irecv(b, src=ctx.victim), "the warm-up receive")


def _failure_rank(ctx: RankContext, scenario: Scenario) -> None:
    _init_world(ctx, "world", ctx.everyone)
    _warm_up(ctx, scenario.op)
    ctx.report.set(f"ready/{ctx.rank}", "1")
    if ctx.rank == ctx.victim:
        ctx.report.wait(["end"], timedelta(seconds=SCENARIO_SECONDS))  # killed or stopped before
        return
    waiter = Waiter()
    watch = FlagWatch(ctx, waiter.failed).start()
    ctx.report.wait(["go"], timedelta(seconds=BARRIER_SECONDS))
    tensor = ctx.ones()

    def start():
        if scenario.op == RECV:
            work = dist.irecv(tensor, src=ctx.victim)
        else:
            work = dist.all_reduce(tensor, async_op=True)
        ctx.report.set(f"posted/{ctx.rank}", "1")
        return work

    wait = waiter.p2p if scenario.op == RECV else waiter.collective
    try:
        wait(start, f"the {scenario.op} that rank {ctx.victim} never joins")
    except PeerFailure as failure:
        ended, ended_wall, message = time.perf_counter(), time.time(), str(failure)
    else:
        raise RuntimeError(f"the {scenario.op} completed without rank {ctx.victim}")
    by_flag = "was announced" in message  # the waiter saw the flag (rather than an error)
    watch.raised.wait(FLAG_AFTER_END_SECONDS)
    abort = _bounded(lambda: communication.abort_groups([dist.group.WORLD]), ABORT_SECONDS, ctx.device)
    if ctx.backend != NCCL:
        stream = "not checked (gloo)"
    elif abort.error:
        stream = "not checked: the abort failed"
    else:
        synced = _bounded(torch.cuda.synchronize, STREAM_SECONDS, ctx.device)
        stream = "clear" if synced.error is None else synced.error
    result = SurvivorReport(
        rank=ctx.rank,
        ended_by="flag" if by_flag else message[:500],
        flag_to_end_ms=None if watch.raised_at is None else (ended - watch.raised_at) * 1000,
        ended_wall=ended_wall,
        flag_wall=watch.raised_wall,
        abort_ms=None if abort.error else float(abort.value) * 1000,
        abort_error=abort.error,
        stream=stream,
    )
    ctx.report.set(f"result/{ctx.rank}", json.dumps(asdict(result)))
    if scenario.comms and ctx.backend == NCCL:
        if abort.error is not None:
            costs = {"error": f"not tried: the abort failed ({abort.error})"}
        elif stream != "clear":
            costs = {"error": f"not tried: the stream is not clear ({stream})"}
        else:
            costs = _survivor_comms(ctx)
        ctx.report.set(f"comms/{ctx.rank}", json.dumps({"rank": ctx.rank, **costs}))
        if "error" in costs or any("error" in c for c in costs.values() if isinstance(c, dict)):
            _abandon(ctx, "its new worlds failed")


def _all_reduce_on(ctx: RankContext, group, size: int) -> None:
    tensor = ctx.ones()
    dist.all_reduce(tensor, group=group)
    torch.cuda.synchronize()
    if tensor[0].item() != size:
        raise RuntimeError(f"the first all-reduce gave {tensor[0].item()}, not {size}")


def _timed_world(ctx: RankContext, name: str, members: list[int], environ: dict | None = None, **options) -> dict:
    """Make a world of ``members`` and run its first all-reduce: the cost of each (ms)."""

    def make() -> dict:
        before = {key: os.environ.get(key) for key in environ or {}}
        os.environ.update(environ or {})
        try:
            began = time.perf_counter()
            _init_world(ctx, name, members, **options)
            made = time.perf_counter()
        finally:
            for key, value in before.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        _all_reduce_on(ctx, None, len(members))
        done = time.perf_counter()
        return {
            "init_ms": (made - began) * 1000,
            "first_op_ms": (done - made) * 1000,
            "total_ms": (done - began) * 1000,
        }

    return _cost(_bounded(make, COMM_SECONDS, ctx.device))


def _timed_group(ctx: RankContext, make: Callable[[], object], members: list[int], seconds: float) -> dict:
    """Make a group (every caller) and run its first all-reduce (its members): the cost (ms)."""

    def run() -> dict:
        began = time.perf_counter()
        group = make()
        made = time.perf_counter()
        if ctx.rank not in members:
            return {"group_ms": (made - began) * 1000, "total_ms": (made - began) * 1000, "member": False}
        _all_reduce_on(ctx, group, len(members))
        done = time.perf_counter()
        return {
            "group_ms": (made - began) * 1000,
            "first_op_ms": (done - made) * 1000,
            "total_ms": (done - began) * 1000,
        }

    return _cost(_bounded(run, seconds, ctx.device))


def _cost(outcome: Bounded) -> dict:
    return {"error": outcome.error} if outcome.error else dict(outcome.value)


def _leave_world(ctx: RankContext) -> str | None:
    """Abort and unregister every group of this process (the only way out of an aborted world:
    destroying one waits for its ops); the error, if any."""
    if not dist.is_initialized():
        return None
    from torch.distributed import distributed_c10d

    return _bounded(distributed_c10d._abort_process_group, ABORT_SECONDS, ctx.device).error


def _nonblocking_options() -> tuple[object | None, dict, str]:
    """``(pg_options, environment, how)`` for a non-blocking NCCL world: the options where this
    torch has them, and torch's environment variable too (it decides where the options leave
    ``blocking`` unset)."""
    environ = {"TORCH_NCCL_USE_COMM_NONBLOCKING": "1"}
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if nccl is None:
        return None, environ, "TORCH_NCCL_USE_COMM_NONBLOCKING=1 (no ProcessGroupNCCL.Options here)"
    try:
        options = nccl.Options()
        options.config.blocking = 0
        if options.config.blocking != 0:
            raise ValueError(f"config.blocking reads {options.config.blocking} after being set to 0")
    except Exception as error:
        return None, environ, f"TORCH_NCCL_USE_COMM_NONBLOCKING=1 (Options().config: {error})"
    return options, environ, "Options().config.blocking = 0 and TORCH_NCCL_USE_COMM_NONBLOCKING=1"


def _survivor_comms(ctx: RankContext) -> dict:
    """After the abort: a fresh world of the survivors, then a non-blocking one."""
    error = _leave_world(ctx)
    if error:
        return {"error": f"taking the aborted world out of torch's registry: {error}"}
    costs: dict = {}
    _barrier(ctx, "fresh", ctx.survivors)
    costs["fresh"] = _timed_world(ctx, "fresh", ctx.survivors)
    error = costs["fresh"].get("error") or _leave_world(ctx)
    if error:
        costs["nonblocking"] = {"error": f"not tried: the fresh world failed ({error})"}
        return costs
    options, environ, how = _nonblocking_options()
    _barrier(ctx, "nonblocking", ctx.survivors)
    extra = {"pg_options": options} if options is not None else {}
    costs["nonblocking"] = _timed_world(ctx, "nonblocking", ctx.survivors, environ, device_id=ctx.device, **extra)
    costs["nonblocking"]["how"] = how
    return costs


def _split_rank(ctx: RankContext) -> None:
    """The split scenario's measures (module doc); every step after the first failed one is skipped."""
    members = ctx.survivors
    costs: dict = {"rank": ctx.rank}
    try:
        costs["lazy_world"] = _timed_world(ctx, "lazy", ctx.everyone)
        if _stopped(costs, "lazy_world"):
            return
        _barrier(ctx, "lazy-ready", ctx.everyone)
        if ctx.rank in members:
            local = lambda: dist.new_group(members, use_local_synchronization=True)
            costs["local_new_group"] = _timed_group(ctx, local, members, COMM_SECONDS)
        _barrier(ctx, "lazy-done", ctx.everyone)
        if _stopped(costs, "local_new_group", _leave_world(ctx)):
            return
        _barrier(ctx, "eager", ctx.everyone)
        costs["eager_world"] = _timed_world(ctx, "eager", ctx.everyone, device_id=ctx.device)
        if _stopped(costs, "eager_world"):
            return
        _barrier(ctx, "split", ctx.everyone)
        split = lambda: dist.split_group(split_ranks=[members], timeout=GROUP_TIMEOUT)
        costs["split_group"] = _timed_group(ctx, split, members, COMM_SECONDS)
        if _stopped(costs, "split_group"):
            return
        _barrier(ctx, "split-done", ctx.everyone)
        if ctx.rank in members:  # last: it may hang (module doc)
            local = lambda: dist.new_group(members, use_local_synchronization=True)
            costs["local_new_group_from_eager"] = _timed_group(ctx, local, members, LOCAL_FROM_EAGER_SECONDS)
    except Exception as error:
        costs["error"] = f"{type(error).__name__}: {error}"[:500]
    finally:
        if "error" in costs:
            _abandon(ctx, costs["error"])
        ctx.report.set(f"split/{ctx.rank}", json.dumps(costs))


def _stopped(costs: dict, step: str, error: str | None = None) -> bool:
    """Whether ``step`` failed (its error is in ``costs``, or given): the later steps are skipped."""
    error = error or (costs.get(step) or {}).get("error")
    if error:
        costs["error"] = f"stopped after {step}: {error}"
    return bool(error)


if __name__ == "__main__":
    sys.exit(main())
