"""A single-host launcher that starts one process per rank and keeps survivors alive.

DeepSpeed's launcher kills every local rank as soon as one exits non-zero. This one lets each
rank end on its own, bounds the whole run by a timeout, and on timeout kills only the processes
it started (each rank runs in its own session, so its children go with it).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class RankResult:
    rank: int
    returncode: int | None
    """None if the rank was still running at the timeout and was killed."""
    log: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class LaunchTimeout(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(
    argv: list[str],
    world_size: int,
    timeout: float,
    log_dir: str | Path,
    env: dict[str, str] | None = None,
    python: str = sys.executable,
) -> list[RankResult]:
    """Run ``python argv...`` as ranks 0..world_size-1 (env:// rendezvous on localhost).

    Returns one result per rank. Ranks still running after ``timeout`` seconds are killed and
    reported with ``returncode=None``.
    """
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs: list[tuple[subprocess.Popen, Path]] = []
    for rank in range(world_size):
        rank_env = {
            **os.environ,
            **(env or {}),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "DS_ACCELERATOR": "cpu",
            "OMP_NUM_THREADS": (env or {}).get("OMP_NUM_THREADS", "1"),
        }
        log_path = log_dir / f"rank{rank}.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [python, *argv], env=rank_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        procs.append((proc, log_path))

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.poll() is None for p, _ in procs):
        time.sleep(0.05)
    killed = set()
    for rank, (proc, _) in enumerate(procs):
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            killed.add(rank)
    return [
        RankResult(rank, None if rank in killed else proc.returncode, path.read_text())
        for rank, (proc, path) in enumerate(procs)
    ]
