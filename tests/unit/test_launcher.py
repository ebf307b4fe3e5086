"""The single-host launcher: survivors keep running, hung ranks are killed at the timeout."""

from __future__ import annotations

import time

from ds_recycle.runtime.launcher import launch

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
