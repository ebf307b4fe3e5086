"""``ds-recycle launch --preload``: ranks forked from a process that imported torch and DeepSpeed
once behave as ranks started with exec, and end with their agent.

Each test runs the real CLI as a process of its own (the agent becomes a child subreaper) with
small rank scripts, and compares against an exec launch of the same script where it can."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ds_recycle.runtime.node.preload import preloaded_by

TIMEOUT = 120

SCRIPT = """
import json, os, sys, signal
out = sys.argv[1]
rank = int(os.environ["RANK"])
seen = {
    "argv": sys.argv[1:],
    "name": __name__,
    "path0": sys.path[0],
    "cwd": os.getcwd(),
    "rank": os.environ["RANK"],
    "token": bool(os.environ.get("DS_RECYCLE_TOKEN")),
    "session_leader": os.getsid(0) == os.getpid(),
    "stdin": sys.stdin.read(),
    "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
    "torch_imported_before": "torch" in sys.modules,
}
print("to the log")
print("to stderr", file=sys.stderr)
with open(os.path.join(out, f"seen{rank}.json"), "w") as f:
    json.dump(seen, f)
if rank == 1:
    sys.exit(3)
if rank == 2:
    raise ValueError("a rank that raises")
if rank == 3:
    os.kill(os.getpid(), signal.SIGKILL)
"""


def launch(tmp: Path, script: str, nproc: int, *options: str, env: dict | None = None) -> subprocess.Popen:
    path = tmp / "ranks.py"
    path.write_text(script)
    out = tmp / "out"
    out.mkdir(exist_ok=True)
    command = [sys.executable, "-m", "ds_recycle.cli", "launch", "--nproc", str(nproc), "--timeout", str(TIMEOUT)]
    command += ["--log-dir", str(tmp / "logs"), "--events", str(tmp / "events.jsonl"), *options, str(path), str(out)]
    return subprocess.Popen(
        command,
        cwd=tmp,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "DS_ACCELERATOR": "cpu", **(env or {})},
        start_new_session=True,
    )


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        output, _ = proc.communicate(timeout=TIMEOUT + 30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc.returncode, output


def exits(tmp: Path) -> dict[int, tuple]:
    events = [json.loads(line) for line in (tmp / "events.jsonl").read_text().splitlines()]
    return {e["slot"]: (e["code"], e["signal"]) for e in events if e["event"] == "exited"}


def test_a_preloaded_rank_sees_what_an_execd_rank_sees(tmp_path):
    seen, codes, logs = {}, {}, {}
    for mode, options in (("exec", []), ("preload", ["--preload"])):
        tmp = tmp_path / mode
        tmp.mkdir()
        code, output = finish(launch(tmp, SCRIPT, 4, *options))
        assert code == 1, output  # ranks 1-3 failed
        assert ("preloaded torch, torch._dynamo, deepspeed, ds_recycle.api in" in output) == (mode == "preload"), output
        seen[mode] = [
            json.loads((tmp / "out" / f"seen{r}.json").read_text().replace(str(tmp), "RUN")) for r in range(4)
        ]
        codes[mode] = exits(tmp)
        logs[mode] = [(tmp / "logs" / f"rank{r}.log").read_text() for r in range(4)]
    for rank in range(4):
        execd, forked = seen["exec"][rank], seen["preload"][rank]
        assert forked.pop("torch_imported_before") and not execd.pop("torch_imported_before")
        assert execd == forked
        assert forked["name"] == "__main__" and forked["session_leader"] and forked["sigint"]
        assert forked["stdin"] == "" and forked["rank"] == str(rank) and forked["token"]
    assert codes["exec"] == codes["preload"] == {0: (0, None), 1: (3, None), 2: (1, None), 3: (None, "SIGKILL")}
    for log in logs["preload"]:
        assert "to the log" in log and "to stderr" in log
    assert "ValueError: a rank that raises" in logs["preload"][2]


HOLD = """
import os, sys, time
with open(os.path.join(sys.argv[1], f"pid{os.environ['RANK']}"), "w") as f:
    f.write(str(os.getpid()))
time.sleep(600)
"""


def test_preloaded_ranks_and_the_preloader_end_with_their_agent(tmp_path):
    """SIGKILL to the agent alone (not its process group): nothing it started outlives it."""
    agent = launch(tmp_path, HOLD, 3, "--preload")
    pid_files = [tmp_path / "out" / f"pid{r}" for r in range(3)]
    try:
        deadline = time.monotonic() + 60
        while not all(p.exists() and p.read_text() for p in pid_files):
            assert agent.poll() is None and time.monotonic() < deadline, agent.stdout.read()
            time.sleep(0.05)
        ranks = [int(p.read_text()) for p in pid_files]
        ours = [pid for pid in ranks + _children(agent.pid) if preloaded_by(_command(pid)) == agent.pid]
        assert set(ranks) < set(ours), "the ranks and the preloader name the agent on their command line"
        for pid in ranks:
            assert _parent(pid) == agent.pid, "a forked rank is re-parented to its agent"
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in ours) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(pid) for pid in ours), [pid for pid in ours if _alive(pid)]
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
        for path in pid_files:  # ours by construction: each rank wrote its own pid
            if path.exists() and path.read_text() and _alive(int(path.read_text())):
                os.kill(int(path.read_text()), signal.SIGKILL)


@pytest.mark.parametrize(
    "cause,options,env,why",
    [
        (
            "import",
            ["--preload-module", "broken_preload"],
            {},
            "importing 'broken_preload' failed: RuntimeError('cannot be imported')",
        ),
        ("threads", ["--preload"], {"OMP_NUM_THREADS": "4"}, "the preloaded modules started 1 thread(s)"),
    ],
)
def test_a_preloader_that_cannot_fork_safely_falls_back_to_exec(tmp_path, cause, options, env, why):
    (tmp_path / "broken_preload.py").write_text("raise RuntimeError('cannot be imported')\n")
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **env}
    code, output = finish(launch(tmp_path, "print('ran')\n", 2, *options, env=env))
    assert code == 0, output
    assert f"the preloader did not start: {why}" in output, output
    assert "starting ranks with exec from now on" in output
    assert all("ran" in (tmp_path / "logs" / f"rank{r}.log").read_text() for r in range(2))


@pytest.mark.parametrize("argv", [["-u", "train.py"], ["-m"], []])
def test_a_command_a_preloaded_rank_cannot_run_is_refused(argv):
    from ds_recycle.runtime.node.preload import PreloadError, check_argv

    with pytest.raises(PreloadError, match="preload"):
        check_argv(argv)


def _command(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except FileNotFoundError:
        return []


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _children(pid: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if _parent(int(name)) == pid:
                    found.append(int(name))
            except (FileNotFoundError, ProcessLookupError, IndexError):
                pass
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_a_stale_op_build_lock_is_named_instead_of_waited_for(tmp_path):
    """A build of DeepSpeed's shared-memory op killed midway leaves torch's lock file, which every
    later build waits for without end: the preloader names it and the agent starts ranks with exec."""
    extensions = tmp_path / "extensions"
    lock = extensions / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    hour_ago = time.time() - 3600
    os.utime(lock, (hour_ago, hour_ago))
    code, output = finish(
        launch(tmp_path, "print('ran')\n", 2, "--preload", env={"TORCH_EXTENSIONS_DIR": str(extensions)})
    )
    assert code == 0, output
    assert f"the preloader did not start: the build lock {lock} of DeepSpeed's op 'deepspeed_shm_comm' is 36" in output
    assert "Remove it if no build of the op is running" in output, output
    assert lock.exists(), "the lock is named, not removed"
    assert all("ran" in (tmp_path / "logs" / f"rank{r}.log").read_text() for r in range(2))
