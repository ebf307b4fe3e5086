"""The rank's communication backend: gloo on CPU tensors, or NCCL on CUDA tensors.

Everything that differs between the two lives here; the world, the groups and the pairs
(:mod:`~ds_recycle.runtime.rank.groups`) and the waits (:mod:`~ds_recycle.runtime.rank.waiting`)
ask it rather than test the backend themselves.

- **Device.** A gloo rank computes on the CPU; an NCCL rank on ``cuda:(LOCAL_RANK mod GPUs)``
  (``CUDA_VISIBLE_DEVICES`` respected). More ranks than GPUs on a host share them: NCCL refuses two
  ranks on one GPU of one host ("Duplicate GPU detected"), so such ranks are given hosts of their own
  (``NCCL_HOSTID``) and talk over sockets on loopback (:func:`prepare_nccl`). That is for tests on
  one GPU, not for speed.
- **Failures.** gloo cannot abort an op: a survivor's op on a dead peer ends when the peer's sockets
  close, and a wait that never ends is abandoned in a thread. An NCCL op on a dead or stopped peer
  spins on the GPU until its communicator is aborted (``ncclCommAbort``); destroying it instead
  waits for that op. So on a failure every communicator of the world is aborted
  (:func:`abort_groups`), never destroyed or waited on, and torch's watchdog is told to leave errors
  to ReCycle: ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0`` (the default, 3, ends the process at the first
  timed-out op; 2 aborts on its own, after the group timeout, which ReCycle's waits reach first
  anyway) and ``TORCH_NCCL_ENABLE_MONITORING=0`` (its heartbeat monitor ends a process whose
  watchdog looks stuck, which an aborted communicator can make it look).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterable

import torch

from ds_recycle.runtime.shared import keys

GLOO = "gloo"
NCCL = "nccl"
BACKENDS = (GLOO, NCCL)

ENV_BACKEND = keys.ENV_BACKEND

NCCL_FAILURE_ENV = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
}
"""torch's NCCL error handling off: ReCycle's waits see failures first and abort (module doc)."""

SHARED_GPU_ENV = {
    "NCCL_P2P_DISABLE": "1",
    "NCCL_SHM_DISABLE": "1",
    "NCCL_IB_DISABLE": "1",
    "NCCL_SOCKET_IFNAME": "lo",
}
"""Ranks that share a GPU, each with a host of its own (``NCCL_HOSTID``), talk over loopback sockets."""


def check_backend(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"backend {name!r}: must be one of {', '.join(BACKENDS)}")
    return name


def default_backend() -> str:
    """NCCL where a CUDA device is present, else gloo."""
    return NCCL if torch.cuda.is_available() else GLOO


def job_backend(requested: str | None = None) -> str:
    """The backend a rank's worlds use: ``requested`` (a script's ``dist_backend``), else the
    launcher's (:data:`ENV_BACKEND`), else gloo."""
    name = requested or os.environ.get(ENV_BACKEND) or GLOO
    check_backend(name)
    if name == NCCL and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs a CUDA device, and torch sees none here; use gloo (CPU)")
    return name


def local_device(backend: str, environ=os.environ) -> torch.device:
    """The device a rank computes on (module doc)."""
    if backend != NCCL:
        return torch.device("cpu")
    return torch.device("cuda", int(environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())


def shares_gpu(environ=os.environ) -> bool:
    """Whether this host runs more ranks than it has GPUs."""
    return int(environ.get("LOCAL_WORLD_SIZE", "1")) > torch.cuda.device_count()


def prepare_nccl(environ=os.environ) -> dict[str, str]:
    """Set the environment NCCL reads at its first communicator (before any is made in this
    process) and return what was set: the failure settings, and on a host with more ranks than
    GPUs a host of its own per rank (:data:`SHARED_GPU_ENV`). A variable the user set is kept."""
    wanted = dict(NCCL_FAILURE_ENV)
    if shares_gpu(environ):
        wanted.update(SHARED_GPU_ENV)
        wanted["NCCL_HOSTID"] = f"{socket.gethostname()}-rank{environ.get('RANK', '0')}"
    chosen = {}
    for name, value in wanted.items():
        environ.setdefault(name, value)
        chosen[name] = environ[name]
    return chosen


def abort_groups(groups: Iterable[object]) -> float:
    """Abort every NCCL communicator of ``groups`` (process groups or NCCL backends) in one NCCL
    group call, without waiting for their ops; return the seconds it took. Groups of other backends
    are left alone: gloo has no abort (their stuck waits are abandoned instead)."""
    began = time.perf_counter()
    backends = [b for b in (_nccl_backend(g) for g in groups) if b is not None]
    if backends:
        backends[0]._group_start()  # aborts one by one can deadlock each other (pytorch #119797)
        try:
            for backend in backends:
                backend.abort()
        finally:
            backends[0]._group_end()
    return time.perf_counter() - began


def _nccl_backend(group: object):
    nccl = getattr(torch.distributed, "ProcessGroupNCCL", None)
    if nccl is None:
        return None
    if isinstance(group, nccl):
        return group
    get = getattr(group, "_get_backend", None)
    if get is None:
        return None
    try:
        backend = get(torch.device("cuda"))
    except RuntimeError:  # no CUDA backend in this group
        return None
    return backend if isinstance(backend, nccl) else None
