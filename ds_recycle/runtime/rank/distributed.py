"""``init_distributed``: the process group a training script starts with.

Under ``ds-recycle launch`` a first-start process joins epoch 0's world (gloo, or NCCL with
``--backend nccl``: :mod:`~ds_recycle.runtime.rank.communication`) on the coordinator store. A
respawned process cannot join a running world at once: it builds its model and engine on a
``fake`` world of the job's size (no peers needed), and ``ds_recycle.initialize`` then moves it into
the real world at an iteration boundary. Under any other launcher this is
``deepspeed.init_distributed``.
"""

from __future__ import annotations

import datetime
import os

import deepspeed
import torch
import torch.distributed as dist

from ds_recycle.log import logger
from ds_recycle.runtime.rank import communication
from ds_recycle.runtime.rank.groups import GROUP_TIMEOUT_SECONDS, rebuild_world
from ds_recycle.runtime.rank.membership import MembershipAgent
from ds_recycle.runtime.shared import keys

_agent: MembershipAgent | None = None


def init_distributed(dist_backend: str | None = None, timeout: float = GROUP_TIMEOUT_SECONDS) -> None:
    """Initialize torch.distributed for this process (see the module doc). ``dist_backend``:
    ``gloo`` (CPU) or ``nccl`` (CUDA); default: the launcher's (``ds-recycle launch --backend``),
    else NCCL where a CUDA device is present and gloo where not."""
    global _agent
    if dist.is_initialized():
        return
    _agent = MembershipAgent.from_env()
    if _agent is None:
        backend = dist_backend or os.environ.get(communication.ENV_BACKEND) or communication.default_backend()
        if backend == communication.NCCL:
            communication.prepare_nccl()
        deepspeed.init_distributed(dist_backend=backend, timeout=datetime.timedelta(seconds=timeout))
        return
    launched = os.environ.get(communication.ENV_BACKEND)
    if dist_backend is not None and launched is not None and dist_backend != launched:
        raise ValueError(
            f"init_distributed(dist_backend={dist_backend!r}), but the job was launched with --backend {launched}: "
            f"one backend per job (allowed: {', '.join(communication.BACKENDS)})"
        )
    backend = communication.job_backend(dist_backend)
    os.environ[communication.ENV_BACKEND] = backend  # every later world of this process
    if backend == communication.NCCL:
        communication.prepare_nccl()
        torch.cuda.set_device(communication.local_device(backend))
    world_size = int(os.environ["WORLD_SIZE"])
    if _agent.is_joiner:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=_agent.slot, world_size=world_size)
        logger.info(f"ReCycle: slot {_agent.slot} (incarnation {_agent.incarnation}) builds its engine to re-join")
    else:
        membership = _agent.current
        if membership.epoch != 0 or len(membership.members) != world_size:
            raise RuntimeError(
                f"slot {_agent.slot} started as incarnation 0 but the job is at epoch {membership.epoch}; "
                f"a process entering a running job must be started with {keys.ENV_INCARNATION} > 0 "
                "(ds-recycle launch --respawn does this)"
            )
        rebuild_world(_agent.store, membership, _agent.slot, timeout, backend=backend)
    deepspeed.init_distributed(dist_backend=backend, dist_init_required=False)


def membership_agent() -> MembershipAgent | None:
    """The agent made by :func:`init_distributed` under ``ds-recycle launch``, else None."""
    return _agent
