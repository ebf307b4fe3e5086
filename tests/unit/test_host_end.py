"""When the coordinator's host sees the job over on every node: a real host and store, and node 1's
agents as its link writes them (lease, then end). An end written by an agent the node had before it
was re-admitted does not end the node: node 0's agent waits for the re-admitted one (else a
scheduler that ends the job with node 0's agent cuts the re-admitted agent short, exit 143 under
Slurm), and a standalone coordinator does not end the job under it."""

from __future__ import annotations

import time

import pytest

from ds_recycle.runtime.control.host import CoordinatorHost, HostConfig
from ds_recycle.runtime.shared.c10d_store import C10dJobStore, C10dStoreRoot
from ds_recycle.runtime.shared.records import AgentEnd, CheckIn, Lease

TOKEN = "t0k3n-of-the-job-0123456789abcdef"
LEASE = 2.0


@pytest.fixture
def host():
    config = HostConfig(nnodes=2, nproc=1, host="127.0.0.1", port=0, token=TOKEN, node_lease=LEASE)
    host = CoordinatorHost(config, log=lambda line: None, emit=lambda *a, **k: None)
    host_address = f"127.0.0.1:{host.listen()[1]}"
    C10dStoreRoot.connect(host_address, TOKEN, timeout=10.0).check_in(CheckIn(1, -1))
    host.start(host.first_generation())
    yield host, C10dJobStore.connect(host_address, 0, TOKEN, timeout=10.0)
    host.stop()


def test_a_re_admitted_agent_runs_until_it_writes_its_own_end(host):
    host, node1 = host
    assert host.nodes_ended() is None and host.agents_running() == []  # node 1 not started yet
    node1.renew_lease(1, Lease(1, time.time()))
    assert host.agents_running() == [1] and host.nodes_ended() is None
    node1.end_node(1, AgentEnd(1, 143))  # its first agent left (SIGTERM)
    assert host.agents_running() == [] and host.nodes_ended() == {1: 143}

    node1.renew_lease(1, Lease(2, time.time()))  # re-admitted
    assert host.agents_running() == [1] and host.nodes_ended() is None
    node1.end_node(1, AgentEnd(2, 0))
    assert host.agents_running() == [] and host.nodes_ended() == {1: 0}


def test_an_agent_whose_lease_lapsed_without_an_end_is_gone(host):
    host, node1 = host
    node1.renew_lease(1, Lease(1, time.time() - LEASE - 0.5))
    assert host.agents_running() == [] and host.nodes_ended() == {1: None}
