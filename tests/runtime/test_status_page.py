"""The live status page (``--status-port``), its JSON endpoint and ``ds-recycle status`` (issue 19, item 5).

- The page's logic against a store written by hand: every state of a slot, the plan, the changes,
  the Gantt chart; the server accepts no action and shows no token; ``ds-recycle status`` prints
  the same and fails with one line when the store does not answer.
- The JSON endpoint and ``ds-recycle status`` during a real job on gloo: a rank SIGKILLed in an
  iteration shows as failed, the next epoch's record has the plan without it, the change with its
  detection and recovery latencies and the Gantt chart without its row; after its re-join it is
  live again and the plan is fault-free.
- The page in a real headless browser (Chromium) during such a job: the failed worker's cell turns
  red and back to green after the re-join (counted in the screenshots' pixels). Skipped where no
  browser is installed, except under CI=true, where it fails (scripts/bootstrap.sh installs chromium).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from ds_recycle.cli import main
from ds_recycle.planner.cache import PlanCache
from ds_recycle.planner.fault_free import fault_free_plan
from ds_recycle.planner.request import PlanRequest
from ds_recycle.runtime.control.status import COLOURS, FAILED, LIVE, StatusServer
from ds_recycle.runtime.rank import reporting
from ds_recycle.runtime.shared import keys, records
from ds_recycle.runtime.shared.c10d_store import C10dJobStore, C10dStoreRoot
from ds_recycle.runtime.shared.events import MembershipChange, PlanSummary
from ds_recycle.runtime.shared.records import Change, Membership, Request
from ds_recycle.runtime.shared.status_schema import ChangeReport, GanttOp, PlanReport, StatusReport
from ds_recycle.testing.jobs import Job, hold_degraded, job_config, slot

TOKEN = "0123456789abcdef0123456789abcdef"
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
PP, DP = 2, 2
STEPS = 12
VICTIM_WORKER = (1, 1)
VICTIM = slot(DP, *VICTIM_WORKER)
KILLED_AT = 3
SAMPLES_PER_ITERATION = 2 * 4 * DP  # micro-batch size x micro-batches x pipelines (job_config)


# ---- the page's logic, on a store written by hand ------------------------------------------------


@contextlib.contextmanager
def hand_written_job():
    """A store holding one job of 2 stages x 4 pipelines in which every state of a slot occurs,
    and a status server on it: (store address, the server)."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    address = f"127.0.0.1:{server.port}"
    C10dStoreRoot.connect(address, TOKEN, timeout=10).start_generation(0)
    store = C10dJobStore.connect(address, 0, TOKEN, timeout=10)
    now = time.time()
    store.open_job(8, 2)
    for epoch in (1, 2):
        store.publish_epoch(Membership(epoch, (0, 1, 2, 3, 7), 9))
    history = [
        Change(0, records.FAILED, 4, now - 9, "exited (signal SIGKILL)"),
        Change(1, records.LEAVE, 6, now - 8),
        Change(2, records.FAILED, 5, now - 7, "heartbeat stale 3.10 s (timeout 3.00 s)"),
        Change(3, records.JOIN, 4, now - 2),
        Change(4, records.LEAVE, 2, now - 1),
        Change(5, records.FAILED, 3, now - 0.5, "exited (code 1)"),
    ]
    store.append_changes(0, history, 8)
    store.post_request(Request(records.JOIN, 4, 4242, now - 2))
    plan = PlanCache().get_or_plan(PlanRequest(4, 2, 4, ((0, 1), (1, 1), (2, 1))))
    gantt = tuple(
        GanttOp(p, s, op.kind, op.home, op.mb, op.start, op.end) for (p, s), ops in plan.workers.items() for op in ops
    )
    change = ChangeReport(2, 9, ((2, 1),), ((1, 1),), (), 0.004, 0.21, 0.25, True, now - 6)
    report = StatusReport(
        epoch=2,
        iteration=9,
        pipelines=4,
        stages=2,
        microbatches=4,
        samples_per_iteration=32,
        workers=tuple((s % 4, s // 4) for s in range(8)),
        plan=PlanReport("abcdef0123", "ms", plan.failed, ((1, 0, 2.5),), plan.iteration_time, 12.0, 11.0, 4, gantt),
        changes=(change,),
        writer=0,
        time=now,
    )
    assert StatusReport.from_json(report.to_json()) == report
    store.publish_status(report)
    beats = {s: records.Beat(now - 0.1 * s, 0.5 if s != 7 else 0.8) for s in range(8)}
    # Node 0's ranks' beats come with the lease its coordinator writes; its age is never judged.
    store.renew_lease(0, records.Lease(0, now, {s: beats[s] for s in range(4)}))
    store.renew_lease(1, records.Lease(0, now - 0.05, {s: beats[s] for s in range(4, 8)}))
    page = StatusServer(address, 0, TOKEN, "127.0.0.1", 0).start()
    try:
        yield address, page
    finally:
        page.stop()


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["status", *argv])
    return code, out.getvalue(), err.getvalue()


def fetch(url: str, method: str = "GET") -> tuple[int, dict[str, str], str]:
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read().decode()


def test_every_state_the_plan_and_the_changes_are_shown_and_nothing_else():
    with hand_written_job() as (address, server):
        assert server.host == "127.0.0.1"
        code, headers, body = fetch(server.url + "status.json")
        assert code == 200 and headers["Content-Type"] == "application/json"
        status = json.loads(body)
        states = [s["state"] for s in status["slots"]]
        assert states == ["live", "slow", "leaving", "failed", "joining", "failed", "out", "live"]
        assert [s["worker"] for s in status["slots"]][:3] == [[0, 0], [1, 0], [2, 0]]
        assert [s["node"] for s in status["slots"]] == [0, 0, 0, 0, 1, 1, 1, 1]
        assert status["epoch"] == 2 and status["since_iteration"] == 9 and status["live"] == 4
        assert status["grid"] == {"pipelines": 4, "stages": 2}
        plan = status["plan"]
        assert plan["failed"] == [[0, 1], [1, 1], [2, 1]] and plan["slow"] == [[1, 0, 2.5]]
        assert plan["ratio_to_fault_free"] == pytest.approx(plan["predicted_iteration_time"] / 12.0)
        assert plan["ratio_to_lower_bound"] == pytest.approx(plan["predicted_iteration_time"] / 11.0)
        workers = {(op[0], op[1]) for op in plan["gantt"]["ops"]}
        assert workers == {(p, s) for p in range(4) for s in range(2)} - {(0, 1), (1, 1), (2, 1)}
        assert status["measured"] == {"iteration_s": 0.8, "samples_per_iteration": 32, "samples_per_s": 40.0}
        change = status["changes"][-1]
        assert change["failed"] == [[1, 1]] and change["left"] == [[2, 1]] and change["recovery_seconds"] == 0.25
        assert status["nodes"][1]["lease_age_s"] < 5 and status["nodes"][0]["lease_age_s"] < 5

        code, headers, page = fetch(server.url)
        assert code == 200 and headers["Content-Type"].startswith("text/html")
        assert "default-src 'none'" in headers["Content-Security-Policy"]
        for slot_status in status["slots"]:
            assert f"id=slot-{slot_status['slot']} data-state={slot_status['state']}" in page
        assert f".s-failed{{background:{COLOURS[FAILED]}}}" in page and "<svg id=gantt" in page
        assert "running again" in page and "250 ms" in page and "heartbeat stale" in page
        assert not re.search(r"<script|<form|<input|<button", page, re.IGNORECASE)
        assert TOKEN not in page and TOKEN not in body

        assert fetch(server.url, "HEAD")[0] == 200
        for method in ("POST", "PUT", "DELETE", "PATCH"):
            code, headers, _ = fetch(server.url + "status.json", method)
            assert code == 405 and headers["Allow"] == "GET, HEAD"
        assert fetch(server.url + "request/0")[0] == 404

        code, out, err = cli("--rdzv-endpoint", address)
        assert code == 0 and err == "", err
        assert "epoch 2 from iteration 9, 4 of 8 workers live" in out
        assert "slot 1 SLOW" in out and "slot 5 FAILED" in out and "slot 4 JOINING" in out
        assert "failed (1, 1); left (2, 1); detected and decided in 4 ms" in out
        assert "measured: 800 ms per iteration, 40.0 samples/s" in out
        assert re.search(r"p1 s1 x+  failed", out), out
        code, out, _ = cli("--rdzv-endpoint", address, "--json")
        printed = json.loads(out)
        assert code == 0 and [s["state"] for s in printed["slots"]] == states and TOKEN not in out


def test_status_says_in_one_line_when_the_store_does_not_answer():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    began = time.monotonic()
    code, out, err = cli("--rdzv-endpoint", f"127.0.0.1:{port}", "--timeout", "0.5")
    assert code == 1 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith(f"ds-recycle status: error: cannot read the job's store at 127.0.0.1:{port}")
    assert time.monotonic() - began < 15
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    code, out, err = cli("--rdzv-endpoint", f"127.0.0.1:{server.port}")
    assert code == 1 and "holds no ds-recycle job" in err and len(err.splitlines()) == 1
    code, _, err = cli("--rdzv-endpoint", "127.0.0.1")
    assert code == 2 and err.strip() == "ds-recycle status: error: --rdzv-endpoint 127.0.0.1: expected HOST:PORT"


@dataclass
class FakeGrid:
    membership: Membership
    data_parallel_size: int
    pipe_parallel_size: int

    @property
    def topo(self) -> FakeGrid:
        return self

    def world_size(self) -> int:
        return self.data_parallel_size * self.pipe_parallel_size

    def worker_of(self, slot_index: int) -> tuple[int, int]:
        return slot_index % self.data_parallel_size, slot_index // self.data_parallel_size


@dataclass
class FakeEngine:
    """What :func:`reporting.publish_status` reads of the engine."""

    grid: FakeGrid
    plan: object
    slot: int = 0
    global_steps: int = 5
    cost_unit: str = "ms"

    def plan_summary(self) -> PlanSummary:
        plan = self.plan
        return PlanSummary("id", plan.failed, plan.iteration_time, plan.iteration_time, plan.lower_bound, (), 0)

    def train_batch_size(self) -> int:
        return 64


def test_the_record_carries_the_last_changes_over_and_stays_small():
    store = C10dJobStore(dist.HashStore(), TOKEN, 0)
    D, P, m = 16, 8, 16
    engine = FakeEngine(FakeGrid(Membership(0, tuple(range(D * P)), 0), D, P), fault_free_plan(D, P, m))
    first = reporting.publish_status(store, engine)
    assert first.changes == () and first.workers[D + 1] == (1, 1)
    ops = sum(len(ops) for ops in engine.plan.workers.values())
    assert len(first.plan.gantt) <= reporting.GANTT_MAX_OPS < ops
    assert len(first.plan.gantt) + first.plan.gantt_omitted == ops
    assert len(store.client.get(keys.STATUS)) < 100_000
    for epoch in range(1, 12):
        engine.grid.membership = Membership(epoch, tuple(range(D * P)), epoch)
        change = MembershipChange(epoch, epoch, failed=((epoch % D, 0),), recovery_seconds=0.1, time=float(epoch))
        reporting.publish_status(store, engine, change)
    report = store.status_report()
    assert [c.epoch for c in report.changes] == list(range(12 - reporting.CHANGES_KEPT, 12))
    assert report.epoch == 11 and report.changes[-1].failed == ((11, 0),)


# ---- during a real job ---------------------------------------------------------------------------


def start_job(tmp_path: Path, respawn_delay: float = 0.2) -> tuple[Job, str, str]:
    """A pp=2 x dp=2 job with a status page whose worker (1, 1) parks in its iteration 3's first F:
    the job, the page's URL and the store's address."""
    job = Job(tmp_path, PP, DP, STEPS, job_config(), "adam", traps=[f"{VICTIM}:F:{KILLED_AT}"])
    job.respawn_delay = respawn_delay
    job.launcher_args = ["--status-port", "0"]
    job.start()
    try:
        job.wait_for_line(r"status page at http://127\.0\.0\.1:\d+/", timeout=60)
        url = next(m.group(1) for line in job.lines if (m := re.search(r"status page at (\S+) ", line)))
        store = job.wait_for_event("store", timeout=60)
    except BaseException:
        job.kill()
        raise
    return job, url, f"{store['host']}:{store['port']}"


def wait_status(job: Job, url: str, condition, what: str, timeout: float = 90.0) -> dict:
    seen: dict = {}

    def check() -> bool:
        code, _, body = fetch(url + "status.json")
        if code != 200:
            return False
        seen["status"] = json.loads(body)
        return bool(condition(seen["status"]))

    job.wait_until(check, f"the status page to show {what}", timeout)
    return seen["status"]


def state_of(status: dict, slot_index: int = VICTIM) -> str:
    return status["slots"][slot_index]["state"]


def all_live(status: dict) -> bool:
    return all(s["state"] == LIVE for s in status["slots"])


def published_in(epoch: int):
    return lambda s: s["plan"] is not None and s["plan"]["epoch"] >= epoch and s["epoch"] >= epoch


def requests_in_store(address: str) -> list[dict]:
    """The requests as written in the store (read without the token: the job's is random)."""
    store = C10dJobStore.connect(address, 0, None, timeout=10)
    requests, _ = store.inbox_counts()
    posted = (store.posted_request(index) for index in range(1, requests + 1))
    return [json.loads(value) for value in posted if value is not None]


@pytest.mark.multiprocess
def readmit_and_hold(job: Job, joins: int) -> None:
    """After :func:`hold_degraded`: once the victim's respawn is accepted (``joins`` accepted
    before), let the survivors run to the boundary that admits it and hold the job there, so that
    its launcher (which serves the page and the store) is still up while the test reads them.
    ``job.hold(None)`` lets it finish."""
    job.wait_for_event("accepted", joins + 1, timeout=180, kind="join", slot=VICTIM)
    job.hold(job.held_at + 1)


def test_the_json_endpoint_and_status_follow_a_failure_and_the_rejoin(tmp_path):
    job, url, address = start_job(tmp_path)
    try:
        first = wait_status(job, url, lambda s: published_in(0)(s) and all_live(s), "the first plan")
        assert first["grid"] == {"pipelines": DP, "stages": PP}
        assert [tuple(s["worker"]) for s in first["slots"]] == [(0, 0), (1, 0), (0, 1), (1, 1)]
        assert first["plan"]["failed"] == [] and first["plan"]["unit"] == "ms"
        assert first["plan"]["ratio_to_fault_free"] == pytest.approx(1.0)
        assert {(op[0], op[1]) for op in first["plan"]["gantt"]["ops"]} == {(0, 0), (1, 0), (0, 1), (1, 1)}
        assert first["changes"] == []

        joins = job.count_events("accepted", kind="join", slot=VICTIM)
        job.signal_when_trapped(VICTIM)
        iteration = max(job.progress(s) for s in range(PP * DP))
        hold_degraded(job, iteration)
        wait_status(job, url, lambda s: state_of(s) == FAILED, "the killed worker failed", timeout=30)
        degraded = wait_status(job, url, published_in(1), "the plan without the killed worker")
        assert degraded["plan"]["failed"] == [list(VICTIM_WORKER)]
        assert degraded["plan"]["ratio_to_fault_free"] > 1.0 and degraded["plan"]["rerouted_microbatches"] > 0
        assert VICTIM_WORKER not in {(op[0], op[1]) for op in degraded["plan"]["gantt"]["ops"]}
        change = degraded["changes"][-1]
        assert change["failed"] == [list(VICTIM_WORKER)] and change["iteration"] == KILLED_AT
        assert 0 <= change["detection_seconds"] < 10 and 0 < change["recovery_seconds"] < 10
        code, out, err = cli("--rdzv-endpoint", address)
        assert code == 0, err
        assert f"failed {VICTIM_WORKER}; detected and decided in" in out and "running again" in out
        assert re.search(r"p1 s1 x+  failed", out), out
        print(out)

        readmit_and_hold(job, joins)
        back = wait_status(job, url, lambda s: published_in(2)(s) and all_live(s), "the re-joined worker live")
        assert back["plan"]["failed"] == [] and back["plan"]["ratio_to_fault_free"] == pytest.approx(1.0)
        assert back["changes"][-1]["joined"] == [list(VICTIM_WORKER)]
        assert back["changes"][-2]["failed"] == [list(VICTIM_WORKER)]
        assert back["measured"]["samples_per_iteration"] == SAMPLES_PER_ITERATION
        assert back["measured"]["samples_per_s"] > 0
        _, _, page = fetch(url)
        code, _, _ = fetch(url, "POST")
        assert code == 405
        requests = requests_in_store(address)
        assert requests, "the re-join posted a request"
        assert all(set(r) == {"kind", "slot", "pid", "time", "target"} for r in requests), "no token in a request"
        job.hold(None)
    except BaseException:
        job.kill()
        raise
    assert job.finish() == 0, job.log_tail()


def browser() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


def screenshot(executable: str, url: str, path: Path) -> Path:
    profile = path.with_suffix(".profile")
    command = [
        executable,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        "--window-size=1100,1000",
        f"--screenshot={path}",
        url,
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and path.exists(), result.stderr[-2000:]
    shutil.rmtree(profile, ignore_errors=True)
    return path


def pixels_of(path: Path, colour: str, tolerance: int = 3) -> int:
    import numpy as np
    from PIL import Image

    image = np.asarray(Image.open(path).convert("RGB")).astype(int)
    rgb = np.array([int(colour[i : i + 2], 16) for i in (1, 3, 5)])
    return int((np.abs(image - rgb).max(axis=2) <= tolerance).sum())


CELL_PIXELS = 3000
"""Fewer pixels than one cell of the grid has (about 110 x 50), more than the legend's swatch."""


NO_BROWSER = f"no headless browser installed (looked for {', '.join(BROWSERS)})"
IN_CI = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")
"""Under CI (CI=true) the browser test fails rather than skips: scripts/bootstrap.sh installs Debian's
chromium there (as root), and a CI that skipped it would never check the page users look at."""


@pytest.mark.multiprocess
@pytest.mark.skipif(browser() is None and not IN_CI, reason=NO_BROWSER)
def test_the_page_in_a_headless_browser_turns_the_killed_worker_red_and_back(tmp_path):
    executable = browser()
    assert executable is not None, f"{NO_BROWSER} under CI=true: scripts/bootstrap.sh installs chromium as root"
    job, url, _ = start_job(tmp_path, respawn_delay=4.0)
    try:
        wait_status(job, url, lambda s: published_in(0)(s) and all_live(s), "the first plan")
        before = screenshot(executable, url, tmp_path / "status_before.png")

        joins = job.count_events("accepted", kind="join", slot=VICTIM)
        job.signal_when_trapped(VICTIM)
        iteration = max(job.progress(s) for s in range(PP * DP))
        hold_degraded(job, iteration)
        wait_status(job, url, lambda s: state_of(s) == FAILED, "the killed worker failed", timeout=30)
        during = screenshot(executable, url, tmp_path / "status_failure.png")
        assert state_of(wait_status(job, url, lambda s: True, "the status")) == FAILED, (
            "the respawn began before the screenshot was taken: raise respawn_delay"
        )

        readmit_and_hold(job, joins)
        wait_status(job, url, lambda s: published_in(2)(s) and all_live(s), "the re-joined worker live")
        after = screenshot(executable, url, tmp_path / "status_after.png")
        job.hold(None)
    except BaseException:
        job.kill()
        raise
    assert job.finish() == 0, job.log_tail()

    red = {name: pixels_of(path, COLOURS[FAILED]) for name, path in (("before", before), ("during", during))}
    red["after"] = pixels_of(after, COLOURS[FAILED])
    green = {name: pixels_of(path, COLOURS[LIVE]) for name, path in (("before", before), ("during", during))}
    green["after"] = pixels_of(after, COLOURS[LIVE])
    print(f"screenshots: {before} {during} {after}; red pixels {red}, green pixels {green}")
    assert red["during"] - red["before"] > CELL_PIXELS and green["before"] - green["during"] > CELL_PIXELS
    assert (
        abs(red["after"] - red["before"]) < CELL_PIXELS / 10
        and abs(green["after"] - green["before"]) < CELL_PIXELS / 10
    )
