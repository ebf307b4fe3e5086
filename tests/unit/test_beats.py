"""A node agent's beat directory outlives an agent killed outright only until the next agent starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ds_recycle.runtime.shared.beats import (
    ORPHAN_AFTER_SECONDS,
    make_beat_directory,
    read_beats,
    remove_orphaned_beat_directories,
    write_beat,
)
from ds_recycle.runtime.shared.records import Beat

AGENT = """
import sys, time
from ds_recycle.runtime.shared.beats import make_beat_directory
print(make_beat_directory(3, sys.argv[1]), flush=True)
time.sleep(600)
"""


def _age(path: Path | str, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_a_killed_agents_beat_directory_is_removed_by_the_next_agent_and_nothing_else_is(tmp_path):
    agent = subprocess.Popen([sys.executable, "-c", AGENT, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        left = Path(agent.stdout.readline().strip())
        assert left.parent == tmp_path and f"_pid{agent.pid}_" in left.name
        write_beat(left, 5, Beat(time.time(), 0.25))
        assert read_beats(left, [5])[5].iteration_seconds == 0.25
        _age(left, ORPHAN_AFTER_SECONDS + 1)
        assert remove_orphaned_beat_directories(str(tmp_path)) == [], "its agent still runs"
    finally:
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait(timeout=30)
        agent.stdout.close()

    write_beat(left, 5, Beat(time.time(), 0.25))
    assert remove_orphaned_beat_directories(str(tmp_path)) == [], "a beat was written there a moment ago"

    alive = Path(make_beat_directory(1, str(tmp_path)))  # this process's: its agent runs
    older_format = tmp_path / "ds_recycle_beats_node0_abc123"  # no PID in its name: not known to be orphaned
    older_format.mkdir()
    unrelated = tmp_path / "something_else_pid1_x"
    unrelated.mkdir()
    for path in (left, alive, older_format, unrelated):
        _age(path, ORPHAN_AFTER_SECONDS + 1)

    fresh = Path(make_beat_directory(2, str(tmp_path)))
    assert not left.exists()
    assert alive.is_dir() and older_format.is_dir() and unrelated.is_dir() and fresh.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (alive, older_format, unrelated, fresh))
