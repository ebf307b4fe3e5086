"""The store's host raises its descriptor limit and names a hard limit too low for the job's store."""

from __future__ import annotations

import resource

import pytest

from ds_recycle.runtime.control.host import HostConfig, descriptor_shortfall, raise_descriptor_limit


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


def test_a_hard_limit_that_allows_few_epochs_is_named_with_the_limit_it_needs():
    config = HostConfig(nnodes=2048, nproc=8, host="127.0.0.1", port=0, token="t")
    message = descriptor_shortfall(config, 100_000)
    assert message == (
        "this process may open 100000 descriptors (ulimit -Hn), and the store takes 2 connections per rank plus 1 "
        "per rank and epoch (16384 ranks, 2048 node agents x 3): 3 epochs (failures, leaves, joins) before ranks "
        "fail to connect; raise the hard limit to at least 1087552"
    )
    assert descriptor_shortfall(config, 1_087_552) is None
    assert "0 epochs" in descriptor_shortfall(config, 20_000)
    assert descriptor_shortfall(config, resource.RLIM_INFINITY) is None
    assert descriptor_shortfall(HostConfig(nnodes=1, nproc=8, host="127.0.0.1", port=0, token="t"), 1024) is None
