"""The store as a transport: the server a job's store runs on, a client's connection to it, and the
bounds on both (torch's ``TCPStore``, behind a ``PrefixStore`` for a generation's keys). A job whose
store is etcd (``--rdzv-backend etcd``) has an address of its own, ``etcd://HOST:PORT[,...]/JOB``,
and its clients are :class:`~ds_recycle.runtime.shared.etcd_transport.EtcdStore` (the same operations).

:class:`Store` names the raw operations of a c10d store that
:class:`~ds_recycle.runtime.shared.c10d_store.C10dJobStore` speaks the protocol with; no other module
calls them (torch builds its process groups on a client as well: :mod:`ds_recycle.runtime.rank.groups`).
"""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import Protocol

from ds_recycle.runtime.shared.keys import ENV_STORE, RENDEZVOUS, STORE_TIMEOUT_SECONDS, prefix

ETCD_SCHEME = "etcd://"

CONNECT_TIMEOUT_SECONDS = 30.0
"""Bound on a client's connect, apart from the bound on its operations: c10d looks up the name of
the server's address at every connect (to describe its socket), and where the resolver drops a
burst of queries each lookup takes 5 s. A node's link, whose operations are bounded by the lease,
could not connect then (seen in bench/multinode.py, once each node's agent also opened its node
store's clients at the same time)."""

QUIET_STORE_ENV = {"TORCH_CPP_LOG_LEVEL": "ERROR"}
"""The environment of every process that makes bounded store waits, from its start (c10d reads it
when torch loads). With c10d's warnings on, each ``wait`` that times out formats its socket for a
warning, and the formatting looks up both addresses' names: where the resolver does not answer, or
drops a burst of queries, 5 s per lookup. Measured in bench/control_plane.py at 256 ranks: the
survivors whose 0.25 s slice of the wait for the decision timed out as it was made held it 5-10 s
late (py-spy: getnameinfo under SocketImpl::waitForInput)."""


class Store(Protocol):
    """The store operations the protocol uses (torch.distributed.Store's names)."""

    def get(self, key: str) -> bytes: ...

    def set(self, key: str, value: str | bytes) -> None: ...

    def add(self, key: str, amount: int) -> int: ...

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...

    def wait(self, keys: list[str], timeout: timedelta) -> None: ...

    def multi_get(self, keys: list[str]) -> list[bytes]: ...

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None: ...

    def delete_key(self, key: str) -> bool: ...


def serve(host: str, port: int, timeout: float = STORE_TIMEOUT_SECONDS, use_libuv: bool = True) -> Store:
    """A TCPStore server for clients that connect to ``host:port`` (port 0: any free one; its
    ``port`` says which).

    Where ``host`` is an IPv4 address the server gets a listening socket of that family: on
    ``host`` alone if it is a loopback address (only this machine's processes reach it), else on
    every IPv4 interface. Anything else (a name, an IPv6 address) keeps c10d's own socket, which
    binds every interface. The server's one loop thread looks up the name of each peer it accepts
    (``getnameinfo``) and serves no one meanwhile. On c10d's own dual-stack socket a local peer is
    the v4-mapped ``::ffff:127.0.0.1``, which no hosts file names: every accept asks DNS, and a
    resolver that dropped a burst of queries silenced a whole job's store for 5 s per query (seen
    in bench/multinode.py under load). The hosts file answers for an IPv4 loopback peer.
    """
    import ipaddress
    import socket

    import torch.distributed as dist

    bound = timedelta(seconds=timeout)
    try:
        address = ipaddress.IPv4Address(host)
    except ValueError:
        return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=bound, use_libuv=use_libuv)
    interface = host if address.is_loopback else "0.0.0.0"
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((interface, port))
        listener.listen(socket.SOMAXCONN)
    except OSError as exc:
        listener.close()
        raise OSError(exc.errno, f"cannot listen on {interface}:{port} for the store: {exc.strerror}") from None
    port = listener.getsockname()[1]
    fd = listener.detach()
    return dist.TCPStore(
        host, port, is_master=True, wait_for_workers=False, timeout=bound, use_libuv=use_libuv, master_listen_fd=fd
    )


def connect(
    address: str, generation: int | None, timeout: float = STORE_TIMEOUT_SECONDS, connect_timeout: float | None = None
) -> Store:
    """A new client of the job store at ``host:port``, under the generation's key prefix (None: the
    store's root), whose operations are bounded by ``timeout`` and its connect by ``connect_timeout``
    (default: ``timeout``, at least CONNECT_TIMEOUT_SECONDS). Each thread that may block in a store
    call needs a client of its own (a blocking call on a TCPStore client blocks every other thread
    using that client)."""
    if address.startswith(ETCD_SCHEME):
        from ds_recycle.runtime.shared import etcd_transport

        return etcd_transport.connect(etcd_config(address), generation, timeout)
    import torch.distributed as dist

    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{ENV_STORE}={address!r} must be host:port")
    if connect_timeout is None:
        connect_timeout = max(timeout, CONNECT_TIMEOUT_SECONDS)
    base = dist.TCPStore(
        host, int(port), is_master=False, timeout=timedelta(seconds=connect_timeout), wait_for_workers=False
    )
    if timeout != connect_timeout:
        base.set_timeout(timedelta(seconds=timeout))
    return base if generation is None else dist.PrefixStore(prefix(generation), base)


def etcd_address(endpoints: tuple[str, ...], job: str) -> str:
    """The address of job ``job``'s store on the etcd members at ``endpoints``."""
    return f"{ETCD_SCHEME}{','.join(endpoints)}/{job}"


def etcd_config(address: str):
    """The etcd client settings of an ``etcd://`` address (TLS and user from ``DS_RECYCLE_ETCD_*``)."""
    from ds_recycle.runtime.shared import etcd_transport

    endpoints, _, job = address[len(ETCD_SCHEME) :].rpartition("/")
    return etcd_transport.config_from_env(endpoints, job)


def rendezvous_client(client: Store, generation: int) -> Store:
    """A client of its own, under ``generation``'s prefix, for torch to build process groups on:
    ``client``'s clone, or for a client of etcd a client of the TCPStore that the coordinator's
    holder hosts and announces (etcd serves the protocol; torch's own keys go to a TCPStore, one
    round trip each instead of a round of consensus)."""
    etcd = sys.modules.get("ds_recycle.runtime.shared.etcd_transport")
    if etcd is None or not isinstance(client, etcd.EtcdStore):
        return client.clone()
    root = etcd.EtcdStore(client.config, "", client.timeout.total_seconds())
    try:
        address = root.get(RENDEZVOUS).decode()
    finally:
        root.close()
    return connect(address, generation, client.timeout.total_seconds())
