"""Where the job's store listens (``transport.serve``): an IPv4 host gets an IPv4 socket, on that
address alone where it is a loopback one; a busy port is an error that names it."""

from __future__ import annotations

import psutil
import pytest

from ds_recycle.runtime.shared import transport
from ds_recycle.runtime.shared.c10d_store import C10dStoreRoot


def _listening(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port}


def _serves(host: str, port: int) -> bool:
    root = C10dStoreRoot.connect(f"{host}:{port}", "store-server-test-token", timeout=10.0)
    root.start_generation(7)
    return root.running_generation() == 7


@pytest.mark.parametrize(
    ("host", "listens_on", "client_host"),
    [
        ("127.0.0.1", "127.0.0.1", "127.0.0.1"),  # a loopback host: that address only
        ("0.0.0.0", "0.0.0.0", "127.0.0.1"),  # another IPv4 host: every IPv4 interface, not IPv6
        ("localhost", "::", "localhost"),  # a name: the store's own socket, every interface
    ],
    ids=["loopback", "other-ipv4", "name"],
)
def test_where_the_store_listens_follows_its_host(host: str, listens_on: str, client_host: str):
    server = transport.serve(host, 0, timeout=10.0)
    assert _listening(server.port) == {listens_on}
    assert _serves(client_host, server.port)


def test_a_busy_port_is_an_error_that_names_it_and_the_first_server_keeps_serving():
    server = transport.serve("127.0.0.1", 0, timeout=10.0)
    with pytest.raises(
        OSError, match=f"cannot listen on 127.0.0.1:{server.port} for the store: Address already in use"
    ):
        transport.serve("127.0.0.1", server.port, timeout=10.0)
    assert _serves("127.0.0.1", server.port)
