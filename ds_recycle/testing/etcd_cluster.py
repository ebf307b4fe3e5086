"""A 3-member etcd cluster on loopback for tests and benchmarks: each member a subprocess tracked
by its PID, its data in a temporary directory, on free ports of 127.0.0.1.

Tests kill a member (SIGKILL: the process ends as a lost host would), restart it on the same ports
and data directory (it rejoins the cluster with its log), or stop all. The binary is Debian's
``etcd-server`` (3.4); where it is missing and this process is root with ``apt-get``, it is
installed, else :func:`etcd_binary` says why not (a test skips with that reason).

etcd 3.4 has no ``--unsafe-no-fsync`` (3.5 does): the data directories go on ``/dev/shm`` where it
exists, where an fsync costs nothing. The members' raft timing is shortened (heartbeat 50 ms,
election 500 ms) so that losing the leader costs under a second of unavailability, not two.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from ds_recycle.runtime.node.preload import die_with_parent

ETCD_PACKAGE = "etcd-server"
"""The Debian package with /usr/bin/etcd."""

HEALTHY_TIMEOUT_SECONDS = 20.0
"""Bound on waiting for a started cluster (or a restarted member) to serve."""

HEARTBEAT_MS = 50
ELECTION_MS = 500


def etcd_binary(install: bool = True) -> tuple[str | None, str]:
    """The path of the ``etcd`` binary (None where there is none), and why there is none.

    Where it is missing and ``install`` is set, installs ``etcd-server`` with apt-get when this
    process is root and apt-get exists."""
    found = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
    if found:
        return found, ""
    if not install:
        return None, "etcd is not installed (apt-get install etcd-server)"
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return None, "etcd is not installed, and installing etcd-server needs root with apt-get"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    command = ["apt-get", "install", "-y", "--no-install-recommends", ETCD_PACKAGE]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:  # the package lists may be stale or missing: update them and try once more
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=600)
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    found = shutil.which("etcd")
    if found:
        return found, ""
    tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
    return None, f"apt-get install {ETCD_PACKAGE} failed: {tail[0]}"


def free_ports(count: int) -> list[int]:
    """``count`` distinct free TCP ports on 127.0.0.1 (free when asked: a race with another
    process that binds one meanwhile is possible and unlikely)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def make_certificates(directory: Path) -> None:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by the CA, in
    ``directory`` (``ca.pem``, ``server.pem``/``server.key``, ``client.pem``/``client.key``)."""
    directory.mkdir(parents=True, exist_ok=True)
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def openssl(*args: str) -> None:
        done = subprocess.run(["openssl", *args], cwd=directory, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"openssl {args[0]} failed: {done.stderr.strip()[-300:]}")

    openssl(
        "req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=ds_recycle test CA"
    )
    for name, usage in (("server", "serverAuth,clientAuth"), ("client", "clientAuth")):
        (directory / f"{name}.ext").write_text(f"subjectAltName=IP:127.0.0.1\nextendedKeyUsage={usage}\n")
        openssl("req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "2",
            "-extfile",
            f"{name}.ext",
        )


@dataclass
class Member:
    """One member of the cluster."""

    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


@dataclass
class EtcdCluster:
    """A loopback etcd cluster (:meth:`start` it; :meth:`stop` ends every member it started)."""

    size: int = 3
    binary: str = "etcd"
    extra_args: list[str] = field(default_factory=list)
    tls: bool = False
    """Serve clients over https only, to clients with a certificate of the cluster's own CA
    (``cacert``, ``client_cert``, ``client_key``; made with openssl at :meth:`start`)."""
    members: list[Member] = field(default_factory=list)
    root: Path | None = None

    @property
    def cacert(self) -> str | None:
        return str(self.root / "tls" / "ca.pem") if self.tls and self.root else None

    @property
    def client_cert(self) -> str | None:
        return str(self.root / "tls" / "client.pem") if self.tls and self.root else None

    @property
    def client_key(self) -> str | None:
        return str(self.root / "tls" / "client.key") if self.tls and self.root else None

    @property
    def endpoints(self) -> list[str]:
        """Every member's client endpoint, ``host:port``."""
        return [m.endpoint for m in self.members]

    def start(self, timeout: float = HEALTHY_TIMEOUT_SECONDS) -> EtcdCluster:
        """Start every member and wait until each serves (bounded by ``timeout``)."""
        if self.size < 1:
            raise ValueError(f"an etcd cluster has at least 1 member, not {self.size}")
        base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        self.root = Path(tempfile.mkdtemp(prefix="ds_recycle_etcd_", dir=base))
        if self.tls:
            make_certificates(self.root / "tls")
        ports = free_ports(2 * self.size)
        for i in range(self.size):
            name = f"m{i}"
            self.members.append(
                Member(name, ports[2 * i], ports[2 * i + 1], self.root / name, self.root / f"{name}.log")
            )
        try:
            for member in self.members:
                self._spawn(member, "new")
            self.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, member: Member, state: str) -> None:
        initial = ",".join(f"{m.name}=http://127.0.0.1:{m.peer_port}" for m in self.members)
        client = f"{'https' if self.tls else 'http'}://127.0.0.1:{member.client_port}"
        peer = f"http://127.0.0.1:{member.peer_port}"
        args = [
            self.binary,
            f"--name={member.name}",
            f"--data-dir={member.data_dir}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster={initial}",
            f"--initial-cluster-state={state}",
            "--initial-cluster-token=ds_recycle_test",
            f"--heartbeat-interval={HEARTBEAT_MS}",
            f"--election-timeout={ELECTION_MS}",
            "--logger=zap",
            "--log-level=warn",
            *self._tls_args(),
            *self.extra_args,
        ]
        log = open(member.log_path, "ab")  # noqa: SIM115 (the child owns it from here)
        try:
            member.process = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent
            )
        finally:
            log.close()

    def _tls_args(self) -> list[str]:
        if not self.tls:
            return []
        tls = self.root / "tls"
        return [
            f"--cert-file={tls / 'server.pem'}",
            f"--key-file={tls / 'server.key'}",
            f"--trusted-ca-file={tls / 'ca.pem'}",
            "--client-cert-auth",
        ]

    def member_healthy(self, member: Member) -> bool:
        """Whether ``member`` runs and answers ``/health`` with a leader in sight."""
        if not member.running():
            return False
        context = None
        if self.tls:
            context = ssl.create_default_context(cafile=self.cacert)
            context.load_cert_chain(self.client_cert, self.client_key)
        scheme = "https" if self.tls else "http"
        try:
            with urllib.request.urlopen(
                f"{scheme}://{member.endpoint}/health", timeout=1.0, context=context
            ) as response:
                return b'"health":"true"' in response.read()
        except (urllib.error.URLError, OSError, TimeoutError):
            return False

    def wait_healthy(self, timeout: float = HEALTHY_TIMEOUT_SECONDS, members: list[Member] | None = None) -> None:
        """Wait until each running member (or each of ``members``) is healthy; raise
        TimeoutError naming the ones that are not, with their logs' last lines."""
        deadline = time.monotonic() + timeout
        waiting = [m for m in (members or self.members) if m.running()]
        while waiting:
            for member in list(waiting):
                if member.process is not None and member.process.poll() is not None:
                    raise RuntimeError(
                        f"etcd member {member.name} exited {member.process.returncode}: {self._tail(member)}"
                    )
                if self.member_healthy(member):
                    waiting.remove(member)
            if not waiting:
                return
            if time.monotonic() > deadline:
                names = ", ".join(f"{m.name} ({self._tail(m)})" for m in waiting)
                raise TimeoutError(f"etcd members not healthy after {timeout:.0f} s: {names}")
            time.sleep(0.05)

    @staticmethod
    def _tail(member: Member) -> str:
        try:
            lines = member.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "no log"
        return lines[-1][:300] if lines else "empty log"

    def kill(self, index: int) -> int:
        """SIGKILL member ``index`` and reap it; returns its PID."""
        member = self.members[index]
        if member.process is None:
            raise RuntimeError(f"etcd member {member.name} was not started")
        pid = member.process.pid
        if member.process.poll() is None:
            os.kill(pid, signal.SIGKILL)
        member.process.wait(timeout=10)
        return pid

    def restart(self, index: int, wait: bool = True, timeout: float = HEALTHY_TIMEOUT_SECONDS) -> None:
        """Start member ``index`` again on its ports and data (it rejoins with its log); with
        ``wait``, until it serves (which needs a quorum of running members)."""
        member = self.members[index]
        if member.running():
            raise RuntimeError(f"etcd member {member.name} (pid {member.pid}) is still running")
        self._spawn(member, "existing")
        if wait:
            self.wait_healthy(timeout, [member])

    def stop(self) -> None:
        """SIGKILL every member still running (their data is scratch), reap them, remove the data."""
        for member in self.members:
            if member.process is not None and member.process.poll() is None:
                os.kill(member.process.pid, signal.SIGKILL)
        for member in self.members:
            if member.process is not None:
                try:
                    member.process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    def __enter__(self) -> EtcdCluster:
        return self.start() if not self.members else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_cluster(size: int = 3, extra_args: list[str] | None = None, tls: bool = False) -> EtcdCluster:
    """A started loopback cluster of ``size`` members; RuntimeError where etcd is unavailable
    (:func:`etcd_binary` says why)."""
    binary, why = etcd_binary()
    if binary is None:
        raise RuntimeError(why)
    return EtcdCluster(size=size, binary=binary, extra_args=list(extra_args or []), tls=tls).start()
