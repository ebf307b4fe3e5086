"""Leaving an NCCL world takes its groups out of torch's registry without destroying them (their
communicators are aborted in a thread of their own, runtime/rank/groups.py). The registry part
is backend-independent: checked here on a one-rank gloo world."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from ds_recycle.runtime.rank.groups import bury, forget_world


def _world(store: dist.Store, prefix: str) -> None:
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(prefix, store), rank=0, world_size=1, timeout=datetime.timedelta(seconds=30)
    )


def test_a_forgotten_world_is_left_and_a_new_one_joins():
    store = dist.HashStore()
    _world(store, "world/0/")
    old = dist.group.WORLD
    sub = dist.new_group([0])
    bury([old, sub])
    forget_world()
    assert not dist.is_initialized()
    _world(store, "world/1/")
    try:
        assert dist.group.WORLD is not old
        assert sub not in dist.distributed_c10d._world.pg_map
        tensor = torch.ones(1)
        dist.all_reduce(tensor)
        assert tensor.item() == 1.0
        new_sub = dist.new_group([0])
        dist.all_reduce(tensor, group=new_sub)
    finally:
        dist.destroy_process_group()
