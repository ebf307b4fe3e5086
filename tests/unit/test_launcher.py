"""The single-host launcher: survivors keep running, hung ranks are killed at the timeout."""

from __future__ import annotations

import json
import re
import threading
import time

from ds_recycle.runtime.node.launcher import LaunchConfig, Launcher, launch
from ds_recycle.runtime.shared.keys import RESTART_EXIT_CODE

SCRIPT = """
import os, sys, time
rank = int(os.environ["RANK"])
print(f"rank {rank} of {os.environ['WORLD_SIZE']} at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
if rank == 1:
    sys.exit(3)
if rank == 2:
    time.sleep(600)
time.sleep(0.5)
print(f"rank {rank} done")
"""


def test_failed_rank_leaves_others_running_and_hung_rank_is_killed(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    started = time.monotonic()
    results = launch([str(script)], world_size=3, timeout=5, log_dir=tmp_path / "logs")
    assert time.monotonic() - started < 30
    assert [r.returncode for r in results] == [0, 3, None]
    assert "rank 0 done" in results[0].log, "rank 0 must survive rank 1's exit"
    assert "rank 2 of 3 at 127.0.0.1:" in results[2].log
    assert results[0].ok and not results[1].ok and not results[2].ok


def test_each_rank_runs_in_its_own_session(tmp_path):
    script = tmp_path / "session.py"
    script.write_text("import os; print(os.getsid(0) == os.getpid())")
    results = launch([str(script)], world_size=2, timeout=30, log_dir=tmp_path / "logs")
    assert all(r.ok and r.log.strip() == "True" for r in results)


# ---- the Launcher: environment and exit rules (rank scripts without torch, files for sync) ----------------

ENV_SCRIPT = """
import json, os, sys
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DS_ACCELERATOR",
        "OMP_NUM_THREADS", "TORCH_CPP_LOG_LEVEL", "TORCHELASTIC_USE_AGENT_STORE", "LOCAL_SIZE",
        "DS_RECYCLE_STORE", "DS_RECYCLE_TOKEN", "DS_RECYCLE_INCARNATION", "DS_RECYCLE_GENERATION"]
print(json.dumps({k: os.environ.get(k) for k in keys}))
"""


def run_launcher(tmp_path, script: str, nproc: int, **options) -> tuple[Launcher, int, list[str]]:
    path = tmp_path / "ranks.py"
    path.write_text(script)
    lines: list[str] = []
    config = LaunchConfig(argv=[str(path), str(tmp_path)], nproc=nproc, log_dir=tmp_path, **options)
    launcher = Launcher(config, echo=lines.append)
    code = launcher.run()
    return launcher, code, lines


def test_environment_of_a_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_SIZE", "2")
    launcher, code, lines = run_launcher(tmp_path, ENV_SCRIPT, 2, timeout=60)
    assert code == 0, lines
    envs = [json.loads(r.log) for r in launcher.results()]
    host, port = launcher.address
    for rank, env in enumerate(envs):
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == (host, str(port)) == ("127.0.0.1", str(port))
        assert env["DS_RECYCLE_STORE"] == f"{host}:{port}"
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True" and env["TORCH_CPP_LOG_LEVEL"] == "ERROR"
        assert (env["DS_ACCELERATOR"], env["OMP_NUM_THREADS"], env["LOCAL_SIZE"]) == ("cpu", "1", None)
        assert (env["DS_RECYCLE_INCARNATION"], env["DS_RECYCLE_GENERATION"]) == ("0", "0")
        assert len(env["DS_RECYCLE_TOKEN"]) == 32 and env["DS_RECYCLE_TOKEN"] == launcher.token
    assert any(re.fullmatch(r"\[ds-recycle launch\] rank 1 pid \d+ started", x) for x in lines)


def test_a_member_that_fails_makes_the_exit_code_non_zero(tmp_path):
    script = "import os, sys, time\nif os.environ['RANK'] == '1': sys.exit(3)\ntime.sleep(0.3)\n"
    _, code, lines = run_launcher(tmp_path, script, 2, timeout=60)
    assert code == 1
    assert "[ds-recycle launch] rank 1 exited (code 3)" in lines
    assert any("published failure of slot 1 (code 3)" in x for x in lines)
    assert "[ds-recycle launch] job finished, but members [1] did not exit 0" in lines


def test_a_restart_request_without_respawn_ends_the_job_with_75(tmp_path):
    script = "import sys\nsys.exit(75)\n"
    _, code, lines = run_launcher(tmp_path, script, 2, timeout=60)
    assert code == RESTART_EXIT_CODE
    assert not any("published failure" in x for x in lines), "a restart request is no failure"


def test_a_restart_request_with_respawn_restarts_every_rank_in_a_new_generation(tmp_path):
    script = ENV_SCRIPT + "import sys\nif os.environ['DS_RECYCLE_GENERATION'] == '0':\n    sys.exit(75)\n"
    launcher, code, lines = run_launcher(tmp_path, script, 2, timeout=60, respawn=True, respawn_delay=0.05)
    assert code == 0, lines
    assert "[ds-recycle launch] restarting every rank from the checkpoint (generation 1)" in lines
    for result in launcher.results():
        first, second = (json.loads(x) for x in result.log.splitlines())
        assert (first["DS_RECYCLE_GENERATION"], second["DS_RECYCLE_GENERATION"]) == ("0", "1")
        assert second["DS_RECYCLE_INCARNATION"] == "0"
    assert not any("respawned" in x for x in lines)


LEAVE_SCRIPT = """
import os, sys, time
from pathlib import Path
out = Path(sys.argv[1])
def wait_for(name):
    deadline = time.monotonic() + 30
    while not (out / name).exists():
        if time.monotonic() > deadline:
            sys.exit(f"no {name}")
        time.sleep(0.01)
if os.environ["RANK"] == "1":
    if os.environ["DS_RECYCLE_INCARNATION"] == "0":
        wait_for("left")   # the test has published an epoch without slot 1
        sys.exit(0)
    (out / "joiner").touch()
    time.sleep(60)         # a joiner that nobody admits: stopped once the job is finished
wait_for("joiner")
"""


def test_exit_0_after_leaving_does_not_finish_the_job_and_an_unadmitted_joiner_is_stopped(tmp_path):
    from ds_recycle.runtime.shared.c10d_store import C10dJobStore
    from ds_recycle.runtime.shared.records import Membership

    path = tmp_path / "ranks.py"
    path.write_text(LEAVE_SCRIPT)
    lines: list[str] = []
    config = LaunchConfig([str(path), str(tmp_path)], 2, respawn=True, respawn_delay=0.05, timeout=60, grace=1)
    launcher = Launcher(config, echo=lines.append)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(launcher.run()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while sum("started" in x for x in lines) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    host, port = launcher.address
    C10dJobStore.connect(f"{host}:{port}", 0, launcher.token).publish_epoch(Membership(1, (0,), 0))
    (tmp_path / "left").touch()
    thread.join(timeout=60)
    assert result == [0], lines
    assert "[ds-recycle launch] rank 1 exited (code 0)" in lines
    assert any("rank 1 respawned (incarnation 1" in x for x in lines), "a left rank is respawned"
    assert "[ds-recycle launch] rank 0 completed training: the job is finished, no more respawns" in lines
    assert any("no member is running: stopping" in x for x in lines)
    assert lines[-2] == "[ds-recycle launch] rank 1 exited (signal SIGTERM)", lines


CRASH_LOOP = """
import os, sys, time
if os.environ["RANK"] == "1":
    sys.exit(1)  # every incarnation fails at once
time.sleep(4.0)
"""


def test_a_slot_that_keeps_failing_backs_off_and_is_given_up_past_max_restarts(tmp_path):
    launcher, code, lines = run_launcher(
        tmp_path, CRASH_LOOP, 2, respawn=True, respawn_delay=0.1, max_restarts=3, max_backoff=0.3, timeout=60
    )
    starts = [line for line in lines if re.search(r"rank 1 pid \d+ started", line)]
    assert len(starts) == 4, "the first start and 3 respawns"
    again = [line for line in lines if "rank 1 failed again" in line]
    assert [re.search(r"respawning it in ([\d.]+) s", line).group(1) for line in again] == ["0.2", "0.3"]
    assert "(3 failures in a row: code 1, code 1, code 1)" in again[-1]
    [given_up] = [line for line in lines if "not respawning it again" in line]
    assert "rank 1 failed 4 times in a row" in given_up and "(--max-restarts 3)" in given_up
    assert code == 1, "the job finished but member 1 did not exit 0"


STATUS_SCRIPT = """
import os, sys, time
if os.environ["RANK"] == "1":
    time.sleep(1.0)
    sys.exit(3)
time.sleep(6.0)
"""


def test_the_status_page_shows_every_slot_and_a_failure(tmp_path):
    import urllib.request

    lines: list[str] = []
    path = tmp_path / "ranks.py"
    path.write_text(STATUS_SCRIPT)
    config = LaunchConfig(argv=[str(path)], nproc=3, log_dir=tmp_path, timeout=60, status_port=0)
    launcher = Launcher(config, echo=lines.append)
    runner = threading.Thread(target=launcher.run, daemon=True)
    runner.start()

    def fetch(path: str) -> str:
        url = re.search(r"status page at (http://\S+/)", "\n".join(lines)).group(1)
        with urllib.request.urlopen(url + path.lstrip("/"), timeout=5) as response:
            return response.read().decode()

    deadline = time.monotonic() + 30
    while not any("status page at" in line for line in lines) and time.monotonic() < deadline:
        time.sleep(0.02)
    status = json.loads(fetch("/status.json"))
    assert status["epoch"] == 0 and status["members"] == [0, 1, 2]
    assert [s["slot"] for s in status["slots"]] == [0, 1, 2]
    while not any("published failure of slot 1" in line for line in lines) and time.monotonic() < deadline:
        time.sleep(0.02)
    status = json.loads(fetch("/status.json"))
    assert [s["state"] for s in status["slots"]] == ["live", "failed", "live"]
    assert status["pending"][-1]["kind"] == "failed" and status["pending"][-1]["slot"] == 1
    page = fetch("/")
    assert "id=grid" in page and "id=slot-1 data-state=failed" in page
    runner.join(timeout=30)
