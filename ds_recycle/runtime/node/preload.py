"""Start ranks by forking a process that has already imported torch and DeepSpeed (``--preload``).

A rank started with exec spends seconds importing torch and DeepSpeed before it can join; on a
node that respawns a failed rank, that is most of the re-join's latency. With ``preload``, the
agent starts one :class:`Preloader` per node: a process that imports the modules once (while it
has no thread, so forking it is safe) and then forks one process per rank on request.

Each rank is forked twice (the preloader forks a child that forks the rank and exits), so the rank
is re-parented to the agent, which made itself a child subreaper: the agent reaps its ranks with
waitpid as it does the ones it starts with exec (:class:`PreloadedProcess` is the part of
``subprocess.Popen`` it uses), and a rank gets SIGKILL when the agent dies. A rank runs in a
session of its own, with the environment, working directory, arguments and log file it would have
had with exec, and runs its script as ``__main__`` (``python SCRIPT ARGS`` or ``python -m MODULE
ARGS``; other interpreter options are refused at start).

What differs from exec: the process's command line (``/proc/PID/cmdline``) is the preloader's, and
the preloaded modules were imported with the agent's environment (the per-rank variables, such as
``RANK``, are set before the script runs, after the import).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

PRELOAD_MODULES = ("torch", "torch._dynamo", "deepspeed", "ds_recycle.api")
"""What ``--preload`` imports before any rank is forked (``--preload-module`` adds to it);
``torch._dynamo`` is what a rank's first ``torch.optim`` optimizer imports (a second of CPU)."""
READY_TIMEOUT_SECONDS = 300.0
"""Bound on the preloader's imports (DeepSpeed may build an op at import)."""
REPLY_TIMEOUT_SECONDS = 30.0
ADOPTION_TIMEOUT_SECONDS = 10.0
"""How long a forked rank waits to be re-parented to the agent before it gives up."""
MODULE = "ds_recycle.runtime.node.preload"
"""The preloader runs as ``python -m MODULE REQUESTS_FD REPLIES_FD AGENT_PID MODULES...``."""
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PR_GET_CHILD_SUBREAPER = 37


class PreloadError(RuntimeError):
    """The preloader could not start or fork a rank; the message says why."""


def check_argv(argv: list[str]) -> None:
    """Refuse a command line a preloaded rank cannot run: ``SCRIPT ARGS`` or ``-m MODULE ARGS``."""
    if not argv:
        raise PreloadError("--preload needs a script to run")
    if argv[0] == "-m":
        if len(argv) < 2:
            raise PreloadError("--preload: '-m' needs a module name")
    elif argv[0].startswith("-"):
        raise PreloadError(
            f"--preload runs 'SCRIPT ARGS' or '-m MODULE ARGS', not interpreter option {argv[0]!r}; "
            "set it in the environment (e.g. PYTHONUNBUFFERED=1) or launch without --preload"
        )


def preloaded_by(command: list[str]) -> int | None:
    """The agent's pid, if ``command`` (a /proc/PID/cmdline) is a preloader's or a rank forked
    from one; None otherwise."""
    if command[1:3] == ["-m", MODULE] and len(command) > 5:
        return int(command[5]) if command[5].isdigit() else None
    return None


class PreloadedProcess:
    """A rank forked by the preloader and re-parented to this process: the part of
    ``subprocess.Popen`` the launcher uses (``pid``, ``returncode``, ``poll``, ``wait``)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return None  # not re-parented yet: the preloader replies only once it is
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.005)
        return self.returncode


class Preloader:
    """The agent's side: start the preloader, fork ranks from it, stop it."""

    def __init__(self, python: str, modules: tuple[str, ...], env: dict[str, str]) -> None:
        self._was_subreaper = _is_subreaper()
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        requests_read, self._requests = os.pipe()
        self._replies, replies_write = os.pipe()
        command = [python, "-m", MODULE, str(requests_read), str(replies_write), str(os.getpid())]
        self.proc = subprocess.Popen(
            [*command, *modules],
            env={"PYTORCH_NVML_BASED_CUDA_CHECK": "1", **env},  # torch.cuda.is_available() without CUDA init
            pass_fds=(requests_read, replies_write),
            stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
        )
        os.close(requests_read)
        os.close(replies_write)
        self._buffer = b""
        ready = self._reply(READY_TIMEOUT_SECONDS)
        if ready != "ready":
            self.close()
            raise PreloadError(f"the preloader did not start: {ready}")

    def spawn(self, argv: list[str], env: dict[str, str], log: Path | None, cwd: str) -> PreloadedProcess:
        request = {"argv": argv, "env": env, "log": None if log is None else str(log), "cwd": cwd}
        try:
            os.write(self._requests, (json.dumps(request) + "\n").encode())
        except OSError as error:
            raise PreloadError(f"the preloader is gone ({error})") from None
        reply = self._reply(REPLY_TIMEOUT_SECONDS)
        if not reply.isdigit():
            raise PreloadError(f"the preloader could not fork a rank: {reply}")
        return PreloadedProcess(int(reply))

    def close(self) -> None:
        """Stop the preloader (the ranks it forked are the agent's to end); this process stops
        adopting orphans unless it did before."""
        _prctl(PR_SET_CHILD_SUBREAPER, int(self._was_subreaper))
        for fd in (self._requests, self._replies):
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _reply(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                return f"no answer within {timeout:g} s"
            if not select.select([self._replies], [], [], min(left, 0.5))[0]:
                if self.proc.poll() is not None:
                    return f"it exited ({self.proc.returncode}); its stderr is above"
                continue
            chunk = os.read(self._replies, 4096)
            if not chunk:
                return f"it exited ({self.proc.wait()}); its stderr is above"
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()


# ---- the preloader process ---------------------------------------------------------------------


def _serve(requests: int, replies: int) -> dict | None:
    """Fork one rank per request; returns the request in the rank, None in the preloader when
    the agent closes its end."""
    reader = os.fdopen(requests, "r")
    for line in reader:
        request = json.loads(line)
        pid_read, pid_write = os.pipe()
        child = os.fork()
        if child == 0:
            os.close(pid_read)
            rank = os.fork()
            if rank == 0:
                os.close(pid_write)
                reader.close()
                os.close(replies)
                return request
            os.write(pid_write, f"{rank}\n".encode())
            os._exit(0)
        os.close(pid_write)
        with os.fdopen(pid_read, "rb") as answer:
            reply = answer.read().decode().strip() or "the intermediate process died"
        os.waitpid(child, 0)  # the rank is the agent's child from here on
        os.write(replies, f"{reply}\n".encode())
    return None


def _become_rank(request: dict, agent: int) -> None:
    """In the forked rank: a session of its own, adopted by the agent, then the exec'd state."""
    os.setsid()
    deadline = time.monotonic() + ADOPTION_TIMEOUT_SECONDS
    while os.getppid() != agent:
        if time.monotonic() >= deadline:
            os._exit(70)
        time.sleep(0.0005)
    die_with_parent()
    if os.getppid() != agent:
        os._exit(70)
    sys.stdout.flush()
    sys.stderr.flush()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if request["log"] is not None:
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _run(argv: list[str]) -> None:
    import runpy

    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def _warm_deepspeed() -> None:
    """Do once what DeepSpeed's CPU backend does in every rank's ``init_distributed``: probe every
    op builder (compiler subprocesses, about half a second of CPU) and load the shared-memory comm
    op. The forked ranks find both in DeepSpeed's caches."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        return
    builder = accelerator.create_op_builder("ShareMemCommBuilder")
    if builder is not None and deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        check_build_lock(builder.name)
        builder.load()


STALE_LOCK_SECONDS = 120.0
"""An op build lock older than this is left from a killed build (this op builds in well under it)."""


class StaleBuildLock(RuntimeError):
    """A killed build left torch's extension lock behind; every later build would wait for it forever."""


def check_build_lock(name: str, stale_after: float = STALE_LOCK_SECONDS) -> None:
    """Wait while another process builds extension ``name``; raise StaleBuildLock if its lock is
    older than ``stale_after`` seconds. torch's build lock is a file that a build removes when it
    ends: one killed mid-build leaves it, and torch then waits for it with no bound (seen here:
    every later launch sat in the preloader's start)."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(name, verbose=False)) / "lock"
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > stale_after:
            raise StaleBuildLock(
                f"the build lock {lock} of DeepSpeed's op {name!r} is {age:.0f} s old: a build that was killed "
                "left it, and every build of the op waits for it without end. Remove it if no build of the op is "
                "running"
            )
        time.sleep(1.0)


def die_with_parent() -> None:
    """SIGKILL this process when its parent (the node's agent) dies: no rank outlives its agent."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _is_subreaper() -> bool:
    flag = ctypes.c_int(0)
    if ctypes.CDLL(None, use_errno=True).prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_GET_CHILD_SUBREAPER) failed")
    return bool(flag.value)


def _prctl(option: int, value: int) -> None:
    if ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")


def main() -> None:
    requests, replies, agent = (int(a) for a in sys.argv[1:4])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the agent stops it by closing the pipe
    try:
        for module in sys.argv[4:]:
            __import__(module)
    except BaseException as error:  # noqa: BLE001 - reported to the agent, which names it
        os.write(replies, f"importing {module!r} failed: {error!r}\n".encode())
        raise SystemExit(1) from None
    if "deepspeed" in sys.modules:
        try:
            _warm_deepspeed()
        except StaleBuildLock as error:
            os.write(replies, f"{error}\n".encode())
            raise SystemExit(1) from None
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        os.write(replies, b"the preloaded modules initialized CUDA, which a forked rank cannot use\n")
        raise SystemExit(1)
    threads = len(os.listdir("/proc/self/task"))
    if threads > 1:  # e.g. an OpenMP pool (OMP_NUM_THREADS > 1): a forked child would not have it
        os.write(replies, f"the preloaded modules started {threads - 1} thread(s); forking is unsafe\n".encode())
        raise SystemExit(1)
    # The imported objects move to the collector's permanent generation: a rank's collections,
    # and the final ones at its exit (a second of CPU per rank otherwise), skip them, and leave
    # their copy-on-write pages shared with this process (CPython's advice for fork servers).
    gc.freeze()
    os.write(replies, b"ready\n")
    request = _serve(requests, replies)
    if request is None:
        os._exit(0)  # nothing is buffered; tearing down torch's modules would take the agent a second
    _become_rank(request, agent)
    _run(request["argv"])


if __name__ == "__main__":
    main()
