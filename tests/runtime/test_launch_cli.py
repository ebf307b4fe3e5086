"""``ds-recycle launch`` as a user runs it: a subprocess, real rank processes, real signals.

Every launch is bounded (``--timeout`` and a bounded wait here); on any error the launcher's own
process group is killed, by PID. The rank scripts are tiny and written by the tests; the ones that
talk to the coordinator use a plain TCPStore client, as runtime/shared/keys.py describes.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ds_recycle.runtime.control.coordinator import UNSEALED
from ds_recycle.runtime.shared import records
from ds_recycle.testing.launch_events import LaunchEvents

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[2]

STORE_CLIENT = """
import json, os, sys, time
from pathlib import Path
from ds_recycle.runtime.shared import keys, records
from ds_recycle.runtime.shared.c10d_store import C10dJobStore

RANK = int(os.environ["RANK"])
INCARNATION = int(os.environ[keys.ENV_INCARNATION])
OUT = Path(sys.argv[1])
GENERATION = int(os.environ[keys.ENV_GENERATION])
store = C10dJobStore.connect(os.environ[keys.ENV_STORE], GENERATION, os.environ[keys.ENV_TOKEN], timeout=30)


def post(kind, slot, token):
    as_holder = C10dJobStore.connect(os.environ[keys.ENV_STORE], GENERATION, token, timeout=30)
    as_holder.post_request(records.Request(kind, slot, os.getpid(), time.time()))


def pending():
    return store.changes()


def wait_for(condition, what, timeout=60):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            sys.exit(f"timed out waiting for {what}")
        time.sleep(0.01)
"""


class Job:
    """The launcher as a subprocess whose stdout lines are collected by a thread, its events in ``events``."""

    def __init__(self, args: list[str], events: Path, timeout: float = 60.0) -> None:
        self.timeout = timeout
        self.lines: list[str] = []
        self.events = LaunchEvents(events)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ds_recycle.cli", "launch", "--events", str(events), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env={**os.environ, "DS_ACCELERATOR": "cpu"},
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @property
    def pids(self) -> dict[int, int]:
        return self.events.pids()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    def wait_for(self, pattern: str, count: int = 1, timeout: float = 60.0) -> str:
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hits = [x for x in list(self.lines) if regex.search(x)]
            if len(hits) >= count:
                return hits[count - 1]
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.01)
        self.kill()
        raise AssertionError(f"no line matching {pattern!r}:\n" + "\n".join(self.lines))

    def finish(self) -> int:
        try:
            code = self.proc.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError("the launcher did not end:\n" + "\n".join(self.lines)) from None
        self._reader.join(timeout=5)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


@pytest.fixture
def jobs(tmp_path):
    started: list[Job] = []

    def start(args: list[str], timeout: float = 60.0) -> Job:
        job = Job(args, tmp_path / f"events{len(started)}.jsonl", timeout)
        started.append(job)
        return job

    yield start
    for job in started:
        job.kill()


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


RESPAWN_SCRIPT = (
    """
import os, sys, time
if os.environ["RANK"] == "1":  # no torch here: incarnation 0 is killed, incarnation 1 just ends
    if os.environ["DS_RECYCLE_INCARNATION"] == "0":
        time.sleep(60)
        sys.exit(5)
    open(os.path.join(sys.argv[1], "respawned"), "w").close()
    sys.exit(0)
"""
    + STORE_CLIENT
    + """
post(records.JOIN, 1, "0" * 32)  # another token: refused, changes nothing
wait_for(lambda: (OUT / "respawned").exists(), "the respawned rank")
print("PENDING " + records.changes_to_json(pending()), "ALERT", store.alert_count(), flush=True)
"""
)


def test_sigkill_from_outside_is_published_and_the_rank_respawns_and_joins(tmp_path, jobs):
    script = write(tmp_path, "ranks.py", RESPAWN_SCRIPT)
    logs = tmp_path / "logs"
    job = jobs(
        ["--nproc", "2", "--respawn", "--respawn-delay", "0.1", "--timeout", "60", "--log-dir", str(logs)]
        + [script, str(tmp_path)]
    )
    job.wait_for(r"rank 1 pid \d+ started")
    job.wait_for(r"refused request 1: not sealed with the job token")
    victim = job.pids[1]
    killed = time.time()
    os.kill(victim, signal.SIGKILL)
    job.wait_for(r"rank 1 exited \(signal SIGKILL\)")
    line = job.wait_for(r"published failure of slot 1 \(signal SIGKILL\) in epoch 0, [\d.]+ ms after waitpid")
    job.wait_for(r"rank 1 respawned \(incarnation 1, generation 0\)")
    assert job.finish() == 0, "\n".join(job.lines)
    assert job.pids[1] != victim
    events = [x for x in job.lines if re.search(r"rank \d (pid \d+ started|exited|respawned)", x)]
    assert events[-1].endswith("exited (code 0)"), events

    log = (logs / "rank0.log").read_text()
    pending_json, alert = re.search(r"PENDING (\[.*\]) ALERT (\d+)", log).groups()
    changes = records.changes_from_json(pending_json)
    assert [(c.seq, c.kind, c.slot) for c in changes] == [(0, records.FAILED, 1)], "the refused request added nothing"
    assert changes[0].detail == "signal SIGKILL" and alert == "1"
    print(f"SIGKILL -> waitpid observed: {1000 * (changes[0].time - killed):.1f} ms; {line}")
    assert (logs / "rank1.log").exists()


def test_the_event_stream_holds_what_the_log_says(tmp_path, jobs):
    """``--events``: the same job as above, watched through its JSON lines."""
    script = write(tmp_path, "ranks.py", RESPAWN_SCRIPT)
    job = jobs(["--nproc", "2", "--respawn", "--respawn-delay", "0.1", "--timeout", "60", script, str(tmp_path)])
    refused = job.events.wait_for("refused", index=1, alive=lambda: job.proc.poll() is None)
    assert refused["reason"] == UNSEALED and refused["kind"] is None
    victim = job.pids[1]
    os.kill(victim, signal.SIGKILL)
    assert job.finish() == 0, "\n".join(job.lines)
    events = job.events.poll()
    assert events[0]["event"] == "store" and (events[-1]["event"], events[-1]["code"]) == ("ended", 0)
    assert all(a["time"] <= b["time"] for a, b in zip(events, events[1:], strict=False))
    kinds = ("started", "respawned", "exited", "refused", "published_failure")
    keys = ("event", "slot", "incarnation", "code", "signal", "cause", "why")
    mine = [{k: e[k] for k in keys if k in e} for e in events if e.get("slot") == 1 and e["event"] in kinds]
    assert mine == [
        {"event": "started", "slot": 1, "incarnation": 0},
        {"event": "exited", "slot": 1, "incarnation": 0, "code": None, "signal": "SIGKILL"},
        {"event": "published_failure", "slot": 1, "cause": "exit", "why": "signal SIGKILL"},
        {"event": "started", "slot": 1, "incarnation": 1},
        {"event": "respawned", "slot": 1, "incarnation": 1},
        {"event": "exited", "slot": 1, "incarnation": 1, "code": 0, "signal": None},
    ], mine
    assert job.events.select("exited", slot=1)[0]["pid"] == victim
    assert [(e["code"], e["signal"]) for e in job.events.select("exited", slot=0)] == [(0, None)]
    lines = [x for x in job.lines if re.search(r"rank \d (pid \d+ started|exited|respawned)", x)]
    assert len(lines) == sum(e["event"] in ("started", "exited", "respawned") for e in events)


HEARTBEAT_SCRIPT = (
    STORE_CLIENT
    + """
import threading

from ds_recycle.runtime.shared.beats import write_beat

stop = threading.Event()
BEATS = os.environ[keys.ENV_BEATS]


def beat():
    while not stop.wait(0.1):
        write_beat(BEATS, RANK, records.Beat(time.time(), 0.05))


beater = threading.Thread(target=beat, daemon=True)
beater.start()
write_beat(BEATS, RANK, records.Beat(time.time(), 0.05))  # the first beat, before the test may stop us
(OUT / f"ready{RANK}").touch()
if RANK == 1:
    time.sleep(60)  # SIGSTOPped by the test, then killed by the launcher
    sys.exit(5)
wait_for(lambda: any(c.kind == records.FAILED for c in pending()), "slot 1's failure")
# What the survivors do at the boundary: the epoch without slot 1.
store.publish_epoch(records.Membership(1, (0,), 0))
print("PENDING " + records.changes_to_json(pending()), flush=True)
stop.set()
beater.join()
write_beat(BEATS, RANK, records.Beat(time.time(), 0.05, stopped=True))  # teardown may outlast the timeout
"""
)


def test_a_sigstopped_rank_is_declared_failed_by_heartbeat_and_killed(tmp_path, jobs):
    script = write(tmp_path, "ranks.py", HEARTBEAT_SCRIPT)
    logs = tmp_path / "logs"
    job = jobs(
        [
            "--nproc",
            "2",
            "--timeout",
            "60",
            "--heartbeat-min-timeout",
            "1",
            "--log-dir",
            str(logs),
            script,
            str(tmp_path),
        ]
    )
    job.wait_for(r"rank 1 pid \d+ started")
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
        time.sleep(0.01)
    stopped = time.time()
    os.kill(job.pids[1], signal.SIGSTOP)
    line = job.wait_for(r"published failure of slot 1: heartbeat stale [\d.]+ s \(timeout 1.00 s\); killing")
    job.wait_for(r"rank 1 exited \(signal SIGKILL\)")
    assert job.finish() == 0, "\n".join(job.lines)  # slot 1 is no member at the end: it does not count
    (change,) = records.changes_from_json(re.search(r"PENDING (\[.*\])", (logs / "rank0.log").read_text()).group(1))
    assert (change.kind, change.slot) == (records.FAILED, 1) and change.detail.startswith("heartbeat stale")
    print(f"SIGSTOP -> failure published: {change.time - stopped:.3f} s; {line}")


GRANDCHILD_SCRIPT = """
import os, subprocess, sys, time
child = subprocess.Popen(["sleep", "60"])
with open(os.path.join(sys.argv[1], f"pids{os.environ['RANK']}"), "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
time.sleep(60)
"""


def alive(pid: int) -> bool:
    """Running (a zombie that nobody reaped yet counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_timeout_kills_every_rank_and_its_children_but_nothing_else(tmp_path, jobs):
    script = write(tmp_path, "ranks.py", GRANDCHILD_SCRIPT)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        job = jobs(["--nproc", "2", "--timeout", "4", script, str(tmp_path)])
        assert job.finish() == 124, "\n".join(job.lines)
        job.wait_for(r"timeout after 4 s: killing every rank")
        pids = [int(p) for r in (0, 1) for p in (tmp_path / f"pids{r}").read_text().split()]
        assert len(pids) == 4
        deadline = time.monotonic() + 5
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(p) for p in pids), "a rank or its child survived the timeout"
        assert sleeper.poll() is None, "the launcher killed a process it did not start"
    finally:
        sleeper.kill()
        sleeper.wait()


ABORT_SCRIPT = """
import os, threading, time
threading.Thread(target=time.sleep, args=(60,), name="a-helper", daemon=True).start()
os.abort()
"""


@pytest.mark.parametrize("preload", [False, True], ids=["spawned", "preloaded"])
def test_a_rank_killed_by_sigabrt_leaves_every_threads_python_stack_in_its_log(tmp_path, jobs, preload):
    script = write(tmp_path, "ranks.py", ABORT_SCRIPT)
    logs = tmp_path / "logs"
    args = ["--nproc", "1", *(["--preload"] if preload else []), "--timeout", "60", "--log-dir", str(logs), script]
    job = jobs(args, timeout=120.0)
    assert job.finish() == 1, "\n".join(job.lines)
    job.wait_for(r"rank 0 exited \(signal SIGABRT\)")
    log = (logs / "rank0.log").read_text()
    assert "Fatal Python error: Aborted" in log, log
    assert f'File "{script}", line 4 in <module>' in log, log
    assert len(re.findall(r"^Thread 0x|^Current thread 0x", log, re.M)) == 2, log


TERM_SCRIPT = """
import os, signal, sys, time
rank = int(os.environ["RANK"])
if rank == 0:
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
else:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(os.path.join(sys.argv[1], f"ready{rank}"), "w").close()
time.sleep(60)
"""


def test_sigterm_to_the_launcher_is_forwarded_then_stragglers_are_killed(tmp_path, jobs):
    script = write(tmp_path, "ranks.py", TERM_SCRIPT)
    job = jobs(["--nproc", "2", "--respawn", "--grace", "0.5", "--timeout", "60", script, str(tmp_path)])
    deadline = time.monotonic() + 30
    while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(job.proc.pid, signal.SIGTERM)
    assert job.finish() == 128 + signal.SIGTERM
    job.wait_for(r"got SIGTERM: sending SIGTERM to every rank, SIGKILL after 0.5 s")
    job.wait_for(r"rank 0 exited \(code 0\)")
    job.wait_for(r"rank 1 exited \(signal SIGKILL\)")
    assert not any("respawned" in x for x in job.lines)


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--nproc", "0", "{script}"], "--nproc 0"),
        (["--nproc", "100000", "{script}"], "1..1024"),
        (["--nproc", "two", "{script}"], "--nproc"),
        (["--nproc", "2", "{tmp}/missing.py"], "no such file"),
        (["--nproc", "2", "--respawn-delay", "-1", "{script}"], "--respawn-delay -1"),
        (["--nproc", "2", "--timeout", "0", "{script}"], "--timeout 0"),
        (["--nproc", "2", "--timeout", "nan", "{script}"], "--timeout nan"),
        (["--nproc", "2", "--log-dir", "{script}/logs", "{script}"], "--log-dir"),
        (["--nproc", "2", "--events", "{tmp}", "{script}"], "--events"),
        (["--nproc", "2", "--events", "{tmp}/missing/events.jsonl", "{script}"], "--events"),
    ],
)
def test_bad_arguments_exit_2_with_one_line_before_starting_anything(tmp_path, args, names):
    script = write(tmp_path, "ranks.py", "open(__file__ + '.ran', 'w').close()\n")
    argv = [a.format(script=script, tmp=tmp_path) for a in args]
    result = subprocess.run(
        [sys.executable, "-m", "ds_recycle.cli", "launch", *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and names in lines[0] and "Traceback" not in result.stderr, result.stderr
    assert result.stdout == "" and not Path(script + ".ran").exists()


def test_the_cli_module_does_not_import_torch():
    code = "import sys, ds_recycle.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=60).returncode == 0
