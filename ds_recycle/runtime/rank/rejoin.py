"""State transfer to joiners: a live replica of the joiner's stage sends it everything that makes
the two identical, in the new epoch's world, never from a checkpoint.

What travels: the module's state dict (parameters and buffers), the optimizer state, the LR
scheduler state and the engine's counters (``global_steps``, ``global_samples``, ``micro_steps``,
``skipped_steps``). The data position is ``global_steps``: micro-batch data is keyed by iteration.
A training loop above the engine (the HF Trainer) sends its own state along: the replica's
``engine.rejoin_client_state()`` (picklable) arrives as the joiner's ``engine.received_client_state``.

Each (source, joiner) pair gets a two-rank group; every member creates the pairs' groups in the
same order, whether or not it takes part in a transfer. The copy runs under the engine's
:class:`~ds_recycle.runtime.rank.waiting.Waiter`: a source whose joiner dies stops at the announced
failure instead of blocking in a broadcast until the group timeout.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ds_recycle.runtime.rank.groups import RecycleGrid, new_group

COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")


def transfer_state(engine, grid: RecycleGrid, holders: tuple[int, ...]) -> None:
    """Copy state from a live replica among ``holders`` to every slot of ``grid`` that is not one."""
    joiners = [s for s in grid.membership.members if s not in holders]
    for joiner in joiners:
        stage = grid.worker_of(joiner)[1]
        sources = [w for w in grid.live_workers(stage) if grid.slot_of(w) in holders]
        if not sources:
            raise RuntimeError(f"slot {joiner} joins stage {stage}, which has no live worker to copy its state from")
        source = grid.slot_of(sources[0])
        ranks = [grid.membership.members.index(source), grid.membership.members.index(joiner)]
        group = new_group(sorted(ranks), grid.timeout)
        if grid.slot in (source, joiner):
            engine.waiter.blocking(
                functools.partial(_copy, engine, group, src_rank=ranks[0], sending=grid.slot == source),
                f"the state transfer from slot {source} to slot {joiner}",
            )


def _copy(engine, group, src_rank: int, sending: bool) -> None:
    optimizer = engine.optimizer
    header = [None]
    if sending:
        header[0] = {
            "counters": {name: getattr(engine, name) for name in COUNTERS},
            "lr_scheduler": None if engine.lr_scheduler is None else engine.lr_scheduler.state_dict(),
            "optimizer": _skeleton(optimizer.state_dict()),
            "client": None if engine.rejoin_client_state is None else engine.rejoin_client_state(),
        }
    dist.broadcast_object_list(header, src=src_rank, group=group)
    header = header[0]

    # NCCL carries CUDA tensors only: a CPU tensor (Adam's step count) travels through a CUDA copy
    device = engine.device if dist.get_backend(group) == dist.Backend.NCCL else torch.device("cpu")
    with torch.no_grad():
        for tensor in engine.module.state_dict(keep_vars=True).values():
            _broadcast(tensor.data, src_rank, group, device)

    optimizer_state = optimizer.state_dict() if sending else _allocate(header["optimizer"])
    for tensor in _tensors(optimizer_state):
        _broadcast(tensor, src_rank, group, device)
    if not sending:
        optimizer.load_state_dict(optimizer_state)
        engine.received_client_state = header["client"]
        if header["lr_scheduler"] is not None:
            engine.lr_scheduler.load_state_dict(header["lr_scheduler"])
        for name, value in header["counters"].items():
            setattr(engine, name, value)


def _broadcast(tensor: torch.Tensor, src_rank: int, group, device: torch.device) -> None:
    if tensor.device == device:
        dist.broadcast(tensor, src=src_rank, group=group)
        return
    carried = tensor.to(device)
    dist.broadcast(carried, src=src_rank, group=group)
    tensor.copy_(carried)


def _skeleton(value):
    """The structure of a state dict with every tensor replaced by its (shape, dtype)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, dict):
        return {k: _skeleton(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_skeleton(v) for v in value)
    return value


def _allocate(skeleton):
    if isinstance(skeleton, tuple) and len(skeleton) == 3 and skeleton[0] == "tensor":
        return torch.empty(skeleton[1], dtype=skeleton[2])
    if isinstance(skeleton, dict):
        return {k: _allocate(v) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(_allocate(v) for v in skeleton)
    return skeleton


def _tensors(value):
    """The tensors of a state dict in a deterministic order (dicts by sorted key)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for key in sorted(value, key=repr):
            yield from _tensors(value[key])
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
