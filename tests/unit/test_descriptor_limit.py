"""The store's host raises its descriptor limit and names a hard limit too low for the job's store."""

from __future__ import annotations

import resource

import pytest

from ds_recycle.runtime.host import HostConfig, descriptor_shortfall, raise_descriptor_limit


@pytest.fixture
def lowered_soft_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = 256 if hard == resource.RLIM_INFINITY else min(256, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    yield hard
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_soft_limit_is_raised_to_the_hard_one(lowered_soft_limit):
    assert raise_descriptor_limit() == (lowered_soft_limit, lowered_soft_limit)
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == lowered_soft_limit


def test_a_hard_limit_below_the_stores_connections_is_named():
    config = HostConfig(nnodes=2048, nproc=8, host="127.0.0.1", port=0, token="t")
    message = descriptor_shortfall(config, 20000)
    assert message == (
        "the store may serve about 71744 connections (16384 ranks x 4, 2048 node agents x 3, and its own) but "
        "this process may open only 20000 descriptors (ulimit -Hn): raise the hard limit, or ranks fail to "
        "connect once it is reached"
    )
    assert descriptor_shortfall(config, 1 << 20) is None
    assert descriptor_shortfall(config, resource.RLIM_INFINITY) is None
    assert descriptor_shortfall(HostConfig(nnodes=1, nproc=8, host="127.0.0.1", port=0, token="t"), 1024) is None
