"""Where the job's store listens (``protocol.serve``): an IPv4 host gets an IPv4 socket, on that
address alone where it is a loopback one; a busy port is an error that names it."""

from __future__ import annotations

import psutil
import pytest

from ds_recycle.runtime import protocol as proto


def _listening(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port}


def _serves(host: str, port: int) -> bool:
    client = proto.connect(f"{host}:{port}", None, timeout=10.0)
    client.set("probe", "1")
    return client.get("probe") == b"1"


def test_a_loopback_host_is_served_on_that_address_only():
    server = proto.serve("127.0.0.1", 0, timeout=10.0)
    assert _listening(server.port) == {"127.0.0.1"}
    assert _serves("127.0.0.1", server.port)


def test_another_ipv4_host_is_served_on_every_ipv4_interface_and_not_over_ipv6():
    server = proto.serve("0.0.0.0", 0, timeout=10.0)
    assert _listening(server.port) == {"0.0.0.0"}
    assert _serves("127.0.0.1", server.port)


def test_a_name_keeps_the_stores_own_socket_on_every_interface():
    server = proto.serve("localhost", 0, timeout=10.0)
    assert _listening(server.port) == {"::"}
    assert _serves("localhost", server.port)


def test_a_busy_port_is_an_error_that_names_it_and_the_first_server_keeps_serving():
    server = proto.serve("127.0.0.1", 0, timeout=10.0)
    with pytest.raises(
        OSError, match=f"cannot listen on 127.0.0.1:{server.port} for the store: Address already in use"
    ):
        proto.serve("127.0.0.1", server.port, timeout=10.0)
    assert _serves("127.0.0.1", server.port)
