"""The coordinator's role on etcd (``--rdzv-backend etcd``): held by one agent at a time, taken over
in place when its host dies.

Every node's agent runs a :class:`Succession` beside its ranks. Each campaigns for the role
(:class:`~ds_recycle.runtime.shared.etcd_election.Election`, a key with an etcd lease of the node
lease's length); the holder coordinates the job on the etcd store as a standalone ``ds-recycle
coordinator`` would (:func:`~ds_recycle.runtime.control.host.coordinate`, every node's agent,
its own included, linked through the store). When the holder's host dies its lease runs out, another
agent wins the role and takes the running generation over where its predecessor left it (the
requests and reports it had read, the changes it had published): no generation starts, no rank
restarts, and the dead node is failed when its lease lapses, as any node's.

torch's process groups are not built on etcd (a round of consensus per key): the holder also hosts a
TCPStore for them and announces its address under ``rendezvous`` with the role's lease
(:func:`~ds_recycle.runtime.shared.transport.rendezvous_client`); the next epoch's world after its
host's loss is built on its successor's.

A holder that could not keep its lease alive (etcd out of reach) stops coordinating at once: another
agent may hold the role already.
"""

from __future__ import annotations

import dataclasses
import math
import socket
import threading
from collections.abc import Callable

from ds_recycle.runtime.control.host import ROLE_LOST_EXIT_CODE, CoordinatorHost, HostConfig, coordinate
from ds_recycle.runtime.shared import keys, transport

ROLE = "coordinator"
CAMPAIGN_SLICE_SECONDS = 1.0
"""A candidate looks at its stop flag this often while it waits for the role."""


class Succession:
    """One agent's candidacy for the coordinator's role of the job at ``address`` (an ``etcd://``
    store address), and the coordinator it runs while it holds the role."""

    def __init__(
        self, address: str, config: HostConfig, node: int, log: Callable[[str], None], emit: Callable[..., None]
    ) -> None:
        from ds_recycle.runtime.shared.etcd_election import Election

        self.address = address
        self.config = dataclasses.replace(config, local_node=None)
        self.node = node
        self._log, self._emit = log, emit
        self.election = Election(
            transport.etcd_config(address), ROLE, str(node), ttl=max(1, math.ceil(config.node_lease))
        )
        self.code: int | None = None
        """How the job ended, by the coordinator this agent ran last (None: it did not see the end)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._rendezvous: object | None = None
        """The TCPStore this agent hosts for torch's process groups while it holds the role."""

    def start(self) -> Succession:
        self._thread = threading.Thread(target=self._run, name=f"recycle-succession-{self.node}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Give the role up (a waiting agent takes it at once) and end the thread."""
        self._stop.set()
        self.election.close()
        if self._thread is not None:
            self._thread.join(timeout)

    def holds_role(self) -> bool:
        return self.election.is_leader() and not self._stop.is_set()

    def _host_rendezvous(self) -> object:
        """Serve a TCPStore for torch's process groups and announce it (with the role's lease)."""
        address = reachable_address(transport.etcd_config(self.address).endpoints[0])
        server = transport.serve(address, 0)
        self.election.announce(keys.RENDEZVOUS, f"{address}:{server.port}")
        self._log(f"node {self.node}: process groups meet at {address}:{server.port} from now on")
        return server

    def _run(self) -> None:
        unreachable = False
        while not self._stop.is_set():
            try:
                if not self.election.campaign(timeout=CAMPAIGN_SLICE_SECONDS):
                    continue
            except Exception as error:  # etcd out of reach: campaign again once it answers
                if not unreachable:
                    self._log(f"node {self.node}: cannot campaign for the coordinator's role ({error}); retrying")
                unreachable = True
                self._stop.wait(CAMPAIGN_SLICE_SECONDS)
                continue
            unreachable = False
            if self._stop.is_set():
                return
            self._log(f"node {self.node} holds the coordinator's role (etcd lease {self.election.ttl} s)")
            self._emit("coordinator_role", node=self.node)
            host = CoordinatorHost(self.config, self._log, self._emit)
            try:
                self._rendezvous = self._host_rendezvous()
                host.attach(self.address)
                code = coordinate(host, self._log, self._emit, still_held=self.holds_role)
            except Exception as error:
                self._log(f"node {self.node}: the coordinator stopped ({type(error).__name__}: {error})")
                code = ROLE_LOST_EXIT_CODE
            finally:
                host.stop()
                self._rendezvous = None  # the TCPStore closes with its last reference
            if code != ROLE_LOST_EXIT_CODE:
                self.code = code
                return
            self.election.resign()
            self.election.lost.clear()


def reachable_address(endpoint: str) -> str:
    """The address of this host on the route to ``endpoint`` (``host:port``, an etcd member): the
    one the other nodes reach it at, as they reach etcd."""
    host, _, port = endpoint.split("://")[-1].rstrip("/").rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host.strip("[]"), int(port)))  # UDP: picks the route, sends nothing
        return probe.getsockname()[0]
