"""One rank of tests/unit/test_kept_groups.py: P = 2 stages x D = 3 pipelines (slot = stage x 3 +
pipeline) build epoch 1's grid and run one all-reduce on their stage groups; slot 0 then posts one
more that no other member ever posts (a failure abandoned it), and slot 5 ends. The survivors post
their progress, take the decision a recovery's decider takes from it, and build epoch 2 keeping the
groups it does not remake; then each runs one all-reduce on each of its groups.

Writes out/rank<N>.json: the decision's remade roles, which of its groups this worker kept (the same
object as in epoch 1), and each all-reduce's sum. ``--unchecked``: the decision without the
survivors' progress (only the lost worker's roles remade), as before the agreement.
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
from torch.distributed import distributed_c10d as c10d

from ds_recycle.runtime.rank.groups import RecycleGrid, group_roles, rebuild_world
from ds_recycle.runtime.shared.c10d_store import C10dJobStore
from ds_recycle.runtime.shared.policy import groups_to_remake
from ds_recycle.runtime.shared.records import Decision, Membership, Progress
from ds_recycle.testing.rebuild import store_barrier

PP, DP = 2, 3
VICTIM = 5
WAIT_SECONDS = 20.0


def all_reduce(group, value: float) -> float | str:
    tensor = torch.tensor([value])
    work = dist.all_reduce(tensor, group=group, async_op=True)
    try:
        work.wait(timedelta(seconds=WAIT_SECONDS))
    except RuntimeError as error:
        return f"not done: {str(error).splitlines()[0]}"
    return float(tensor.item())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--unchecked", action="store_true")
    args = parser.parse_args()
    slot = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=slot, world_size=PP * DP)
    store = c10d._get_default_store()
    store = store.underlying_store if isinstance(store, dist.PrefixStore) else store
    job = C10dJobStore(store, "kept-groups-test-token", 0)
    topo = PipeDataParallelTopology(num_pp=PP, num_dp=DP)
    everyone = tuple(range(PP * DP))

    first = Membership(1, everyone, 0)
    rebuild_world(job, first, slot)
    grid = RecycleGrid.build(topo, first, slot, 60.0)
    stage_group = grid.get_data_parallel_group()
    all_reduce(stage_group, 1.0)
    if slot == 0:
        dist.all_reduce(torch.tensor([100.0]), group=stage_group, async_op=True)  # abandoned
    store_barrier(store, "posted", PP * DP)
    if slot == VICTIM:
        os._exit(0)

    survivors = everyone[:VICTIM]
    job.post_progress(1, slot, Progress(1, False, 1, grid.group_states()))
    store_barrier(store, "progressed", len(survivors))
    posts = job.progress_of(1, list(survivors))
    second = Membership(2, survivors, 1)
    roles = group_roles(topo)
    remade = (
        groups_to_remake({VICTIM}, roles)
        if args.unchecked
        else groups_to_remake({VICTIM}, roles, 1, posts, second.members)
    )
    decision = Decision(1, 1, 1, (), second, remade)
    kept = grid.keep(decision, slot)
    rebuild_world(job, second, slot, kept=kept.values())
    new = RecycleGrid.build(topo, second, slot, 60.0, None, kept, remade)

    result = {
        "remade": list(remade),
        "states": {role: list(state) for role, state in grid.group_states().items()},
        "kept": sorted(
            role
            for role, group in kept.items()
            if group.group in (*new.stage_groups.values(), *new.pipe_groups.values())
        ),
        "stage": all_reduce(new.get_data_parallel_group(), slot + 1.0),
        "stage_rank": dist.get_rank(new.get_data_parallel_group()),
    }
    if grid.worker[0] in new.pipe_groups:
        result["pipe"] = all_reduce(new.get_pipe_parallel_group(), slot + 1.0)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{slot}.json").write_text(json.dumps(result))
    store_barrier(store, "written", len(survivors))
    os._exit(0)  # the groups are never torn down, as in a rank


if __name__ == "__main__":
    main()
