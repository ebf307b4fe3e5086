"""Which node this agent is, from ``ds-recycle launch``'s flags or the environment.

The same command runs on every node, torchrun's spelling::

    ds-recycle launch --nnodes N --node-rank K --nproc-per-node G --rdzv-endpoint HOST:PORT SCRIPT ...

Flags win; when one is absent it comes from Slurm (``SLURM_NNODES``, ``SLURM_NODEID``,
``SLURM_GPUS_ON_NODE``, the first host of ``SLURM_JOB_NODELIST``) or torchrun-style variables
(``NODE_RANK``/``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``). The job token is the same on every
node: ``DS_RECYCLE_TOKEN`` (set by the batch script) or ``--token-file`` (mode 600).

``--hostfile FILE`` takes DeepSpeed's format (``host slots=G`` per line, ``#`` comments): N is the
number of hosts, G their slots, node 0's host the endpoint, and this agent's node rank the line
that names this host (its name or one of its addresses) unless ``--node-rank`` says it.

DeepSpeed's ``deepspeed`` spellings are accepted too: ``--num_gpus G`` is ``--nproc-per-node G``,
``--num_nodes N`` is ``--nnodes N``, and ``--include``/``--exclude`` take its resource filter
(``host1:0,1@host2`` keeps GPUs 0 and 1 of host1 and every GPU of host2; ``--exclude host1:1`` drops
one GPU, ``--exclude host1`` a whole host). A filter picks the hostfile's hosts that take part and,
on this node, the GPUs its ranks use (``CUDA_VISIBLE_DEVICES``; the default number of ranks is the
number selected). Without a hostfile it names this node only (``localhost`` or its host name). A GPU
index is a device as this agent sees it: an index into ``CUDA_VISIBLE_DEVICES`` when that is set.
With no rank count from any flag, hostfile or Slurm, one node runs a rank per CUDA device torch sees.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import socket
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ds_recycle.cli.common import UsageError, float_in, shorten

MAX_NODES = 4096
_NODE_FLAGS = {
    "--node-rank": "node_rank",
    "--rdzv-endpoint": "rdzv_endpoint",
    "--master-addr": "master_addr",
    "--master-port": "master_port",
    "--token-file": "token_file",
    "--hostfile": "hostfile",
    "--domain": "domain",
}
DEFAULT_PORT = 29500
DOMAIN_PATTERN = r"[A-Za-z0-9_.:\-]{1,64}"
TOKEN_ENV = "DS_RECYCLE_TOKEN"
MAX_WAIT_SECONDS = 86_400.0
MAX_NPROC = 1024
VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
FILTER_FORM = "HOST[:GPU[,GPU...]][@HOST[:GPU[,GPU...]]...] (e.g. worker-0:0,1@worker-1)"
"""DeepSpeed's resource filter, as ``--include`` and ``--exclude`` take it."""


@dataclass(frozen=True)
class NodeSpec:
    nnodes: int
    node_rank: int
    nproc_per_node: int
    endpoint: tuple[str, int] | None
    """Where node 0 hosts the store; None for a one-node job (any free port on --host)."""
    token: str | None
    domain: str = ""
    """This node's failure domain (a rack, a switch); "" for none."""
    visible_devices: str | None = None
    """``CUDA_VISIBLE_DEVICES`` for this node's ranks (from ``--include``/``--exclude``); None: as it is."""
    etcd: tuple[str, ...] | None = None
    """The etcd members holding the job's store (``--rdzv-backend etcd``); None: the c10d store."""


@dataclass(frozen=True)
class JobSpec:
    """The job a standalone ``ds-recycle coordinator`` hosts."""

    nnodes: int
    nproc_per_node: int
    endpoint: tuple[str, int]
    """Where it listens."""
    token: str


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("several nodes (one agent per node; the same command on every node)")
    add_job_arguments(group)
    group.add_argument(
        "--node-rank", "--node_rank", dest="node_rank", default=None, metavar="K", help="this node (0..N-1)"
    )
    group.add_argument(
        "-H",
        "--hostfile",
        default=None,
        metavar="FILE",
        help="DeepSpeed's hostfile (`host slots=G` per line): the nodes, their ranks and the endpoint",
    )
    deepspeed = parser.add_argument_group("DeepSpeed's spellings (`deepspeed ARGS` is `ds-recycle launch ARGS`)")
    deepspeed.add_argument(
        "--num_gpus",
        "--num-gpus",
        "--num_accelerators",
        dest="num_gpus",
        default=None,
        metavar="G",
        help="ranks on this node: the same as --nproc-per-node G",
    )
    deepspeed.add_argument(
        "--num_nodes", "--num-nodes", dest="num_nodes", default=None, metavar="N", help="the same as --nnodes N"
    )
    deepspeed.add_argument(
        "-i",
        "--include",
        default=None,
        metavar="FILTER",
        help="only these hosts and GPUs, HOST[:GPU,...][@HOST...] (e.g. worker-0:0,1@worker-1); on one node "
        "without --hostfile HOST is localhost: sets the ranks' CUDA_VISIBLE_DEVICES and their number",
    )
    deepspeed.add_argument(
        "-e",
        "--exclude",
        default=None,
        metavar="FILTER",
        help="every host and GPU but these, in --include's form (e.g. worker-1:0 or worker-1)",
    )
    group.add_argument(
        "--domain",
        default=None,
        metavar="LABEL",
        help="this node's failure domain (rack, switch): no domain may hold every replica of a stage",
    )
    group.add_argument(
        "--allow-unsafe-placement",
        action="store_true",
        help="start even if one node holds every replica of a stage (its loss then stops the job)",
    )
    group.add_argument(
        "--external-coordinator",
        action="store_true",
        help="a `ds-recycle coordinator` hosts the store at --rdzv-endpoint: node 0's agent joins it too",
    )
    group.add_argument(
        "--coordinator-timeout",
        type=float_in(0, 3600, low_open=True),
        default=None,
        metavar="S",
        help="fence this node's ranks when the coordinator was unreachable for S seconds "
        "(default 3, at most --node-lease)",
    )
    group.add_argument(
        "--coordinator-wait",
        type=float_in(0, MAX_WAIT_SECONDS),
        default=600.0,
        metavar="S",
        help="wait up to S seconds for the coordinator: at start (at least 60), and after a fence for one back "
        "at the endpoint, which restarts the job from its latest checkpoint (0 there: exit 1 at once; default 600)",
    )


def add_job_arguments(group: argparse._ActionsContainer) -> None:
    """The flags that name the job, the same for its agents and a standalone coordinator."""
    group.add_argument("--nnodes", default=None, metavar="N", help="number of nodes (default: SLURM_NNODES, or 1)")
    group.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        dest="nproc_per_node",
        default=None,
        metavar="G",
        help="ranks on each node (default: SLURM_GPUS_ON_NODE)",
    )
    group.add_argument(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        dest="rdzv_endpoint",
        default=None,
        metavar="HOST:PORT",
        help="where the store and the coordinator listen (node 0's agent, or ds-recycle coordinator)",
    )
    group.add_argument(
        "--rdzv-backend",
        "--rdzv_backend",
        dest="rdzv_backend",
        default="c10d",
        metavar="{c10d,etcd}",
        help="c10d: node 0's agent (or ds-recycle coordinator) hosts the store; etcd: the store is the etcd "
        "cluster at --rdzv-endpoint HOST:PORT[,HOST:PORT...] and any agent may hold the coordinator's role",
    )
    for name, what in (("cacert", "CA bundle"), ("cert", "client certificate"), ("key", "client key")):
        group.add_argument(
            f"--etcd-{name}",
            dest=f"etcd_{name}",
            default=None,
            metavar="FILE",
            help=f"etcd's TLS {what} (or DS_RECYCLE_ETCD_{name.upper()}; a user: DS_RECYCLE_ETCD_USER/_PASSWORD)",
        )
    group.add_argument("--rdzv-id", "--rdzv_id", dest="rdzv_id", default=None, metavar="JOB", help="a job name")
    group.add_argument("--master-addr", "--master_addr", dest="master_addr", default=None, metavar="HOST")
    group.add_argument("--master-port", "--master_port", dest="master_port", default=None, metavar="PORT")
    group.add_argument(
        "--node-lease",
        type=float,
        default=5.0,
        metavar="S",
        help="a node whose agent has not renewed its lease for S seconds is failed as a whole (default 5)",
    )
    group.add_argument("--token-file", default=None, metavar="FILE", help="the job token (mode 600)")


def cuda_device_count() -> int:
    """The CUDA devices torch sees (``CUDA_VISIBLE_DEVICES`` respected); torch is imported only here."""
    import torch

    return torch.cuda.device_count()


def resolve(
    args: argparse.Namespace,
    environ: Mapping[str, str] = os.environ,
    gpu_count: Callable[[], int] | None = None,
) -> NodeSpec:
    """The node this agent is; raises UsageError naming the flag or variable and what is allowed.
    ``gpu_count`` (default :func:`cuda_device_count`) is asked only when nothing else gives the number
    of this node's GPUs."""
    etcd = etcd_endpoints(args)
    spec = _resolve(args, environ, gpu_count or cuda_device_count)
    if etcd is not None:
        spec = dataclasses.replace(spec, endpoint=None, etcd=etcd)
    domain = getattr(args, "domain", None)
    if domain is None:
        return spec
    if not re.fullmatch(DOMAIN_PATTERN, domain):
        raise UsageError(f"--domain {domain!r}: 1 to 64 characters of [A-Za-z0-9_.:-] (e.g. rack3)")
    return dataclasses.replace(spec, domain=domain)


def resolve_job(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> JobSpec:
    """The job a standalone coordinator hosts (several nodes, an endpoint, the token); raises
    UsageError naming the flag or variable and what is allowed."""
    if etcd_endpoints(args) is not None:
        raise UsageError(
            "--rdzv-backend etcd: every node's agent holds the coordinator's role in turn, so a standalone "
            "ds-recycle coordinator is not needed (start the agents with --rdzv-backend etcd)"
        )
    nnodes = _nnodes(args.nnodes, environ)
    if nnodes < 2:
        raise UsageError(
            f"--nnodes {nnodes}: must be an integer in 2..{MAX_NODES} (a standalone coordinator is for several nodes)"
        )
    per_node = _first(args.nproc_per_node, "--nproc-per-node", environ, "SLURM_GPUS_ON_NODE")
    if per_node is None:
        raise UsageError("--nproc-per-node G is required: the ranks on each node, 1..1024 (or SLURM_GPUS_ON_NODE)")
    nproc = _int_in(per_node[1], per_node[0], 1, 1024)
    return JobSpec(nnodes, nproc, _endpoint(args, environ), _token(args.token_file, environ))


def _resolve(args: argparse.Namespace, environ: Mapping[str, str], gpu_count: Callable[[], int]) -> NodeSpec:
    chosen = _resource_filter(args)
    nnodes_given = _given_nnodes(args)
    per_node_given = _given_per_node(args)
    if getattr(args, "hostfile", None) is not None and args.nproc is None:
        return _from_hostfile(args, environ, chosen, nnodes_given, per_node_given)
    nnodes = _nnodes(nnodes_given[0], environ, nnodes_given[1])
    if args.nproc is not None and per_node_given is not None:
        raise UsageError(f"--nproc and {per_node_given[1]}: give one of them (--nproc N is one node of N ranks)")
    if args.nproc is not None:
        if nnodes != 1:
            raise UsageError(f"--nproc with {nnodes_given[1]} {nnodes}: use --nproc-per-node G on several nodes")
        several = [flag for flag, value in _NODE_FLAGS.items() if getattr(args, value) is not None]
        if several:
            raise UsageError(f"{several[0]} is for several nodes; with --nproc N (one node) leave it out")
        nproc = _int_in("--nproc", args.nproc, 1, MAX_NPROC)
        gpus = None if chosen is None else _this_node_gpus(chosen, environ, gpu_count)
        if gpus is not None:
            chosen.check_count("--nproc", args.nproc, nproc, len(gpus))
        return NodeSpec(1, 0, nproc, None, None, visible_devices=_visible_devices(chosen, gpus, environ))
    gpus = None if chosen is None else _this_node_gpus(chosen, environ, gpu_count)
    if gpus is not None:
        nproc = len(gpus)
        if per_node_given is not None:
            flag, value = per_node_given[1], per_node_given[0]
            chosen.check_count(flag, value, _int_in(flag, value, 1, MAX_NPROC), nproc)
    else:
        nproc = _ranks_on_this_node(per_node_given, nnodes, environ, gpu_count)
    rank = _first(args.node_rank, "--node-rank", environ, "SLURM_NODEID", "NODE_RANK", "GROUP_RANK")
    node_rank = 0 if rank is None else _int_in(rank[1], rank[0], 0, nnodes - 1)
    visible = _visible_devices(chosen, gpus, environ)
    if nnodes == 1:
        return NodeSpec(1, 0, nproc, None, None, visible_devices=visible)
    endpoint = _endpoint(args, environ)
    return NodeSpec(nnodes, node_rank, nproc, endpoint, _token(args.token_file, environ), visible_devices=visible)


def _ranks_on_this_node(
    per_node_given: tuple[str, str] | None, nnodes: int, environ: Mapping[str, str], gpu_count: Callable[[], int]
) -> int:
    """G from --nproc-per-node/--num_gpus or SLURM_GPUS_ON_NODE, else (one node) a rank per GPU torch sees."""
    per_node = per_node_given or _first(None, "", environ, "SLURM_GPUS_ON_NODE")
    if per_node is not None:
        return _int_in(per_node[1], per_node[0], 1, MAX_NPROC)
    required = "--nproc N (one node) or --nproc-per-node G is required (or --num_gpus G, or SLURM_GPUS_ON_NODE)"
    if nnodes != 1:
        raise UsageError(required)
    found = gpu_count()
    if found < 1:
        raise UsageError(f"{required}: torch sees no CUDA device to give one rank each")
    return min(found, MAX_NPROC)


def _given_nnodes(args: argparse.Namespace) -> tuple[str | None, str]:
    """(--nnodes or --num_nodes, the flag given); both given must agree."""
    nnodes, num_nodes = args.nnodes, getattr(args, "num_nodes", None)
    if num_nodes is None:
        return nnodes, "--nnodes"
    if nnodes is not None and not _same_number(nnodes, num_nodes):
        raise UsageError(f"--nnodes {nnodes} and --num_nodes {num_nodes}: give one of them (they are the same flag)")
    return (num_nodes, "--num_nodes") if nnodes is None else (nnodes, "--nnodes")


def _given_per_node(args: argparse.Namespace) -> tuple[str, str] | None:
    """(--nproc-per-node or --num_gpus, the flag given), None if neither; both given is an error."""
    per_node, num_gpus = args.nproc_per_node, getattr(args, "num_gpus", None)
    if per_node is not None and num_gpus is not None:
        raise UsageError(
            f"--nproc-per-node {per_node} and --num_gpus {num_gpus}: give one of them (they are the same flag)"
        )
    if num_gpus is not None:
        return str(num_gpus), "--num_gpus"
    return None if per_node is None else (str(per_node), "--nproc-per-node")


def _same_number(a: object, b: object) -> bool:
    try:
        return int(str(a)) == int(str(b))
    except ValueError:
        return str(a) == str(b)


# ----- DeepSpeed's resource filter: --include / --exclude ----------------------------------------


@dataclass(frozen=True)
class ResourceFilter:
    """A parsed ``--include`` or ``--exclude``: host -> the GPU indices it names (None: all of them)."""

    flag: str
    text: str
    hosts: dict[str, frozenset[int] | None]

    @property
    def keeps(self) -> bool:
        """True for --include (keep only what it names), False for --exclude (drop it)."""
        return self.flag == "--include"

    def error(self, problem: str) -> UsageError:
        shown = self.text if self.text and not any(c.isspace() for c in self.text) else repr(self.text)
        return UsageError(f"{self.flag} {shown}: {problem}")

    def check_count(self, flag: str, value: object, count: int, selected: int) -> None:
        if count != selected:
            raise self.error(
                f"selects {selected} GPU{'s' * (selected != 1)} on this node but {flag} {value} asks for {count} "
                "ranks: give one of them (the filter's GPUs give the number of ranks)"
            )


def parse_filter(flag: str, text: str) -> ResourceFilter:
    """DeepSpeed's ``HOST[:GPU[,GPU...]]`` node specs joined by ``@``; a host named twice gets the
    union of its GPUs (all of them if one spec names the host alone)."""
    hosts: dict[str, frozenset[int] | None] = {}
    empty = ResourceFilter(flag, text, {})
    for spec in text.split("@"):
        match = re.fullmatch(r"([^:@,\s]+)(?::([0-9]+(?:,[0-9]+)*))?", spec)
        if match is None:
            raise empty.error(f"cannot read {spec!r}: expected {FILTER_FORM}")
        host, listed = match.groups()
        if listed is None:
            hosts[host] = None
            continue
        gpus = frozenset(int(gpu) for gpu in listed.split(","))
        if max(gpus) >= MAX_NPROC:
            raise empty.error(f"GPU {max(gpus)} of {host}: a GPU index must be in 0..{MAX_NPROC - 1}")
        if host not in hosts or hosts[host] is not None:
            hosts[host] = (hosts.get(host) or frozenset()) | gpus
    return ResourceFilter(flag, text, hosts)


def _resource_filter(args: argparse.Namespace) -> ResourceFilter | None:
    include, exclude = getattr(args, "include", None), getattr(args, "exclude", None)
    if include is not None and exclude is not None:
        raise UsageError(
            f"--include {include} and --exclude {exclude}: give one of them (--include keeps only what it names, "
            "--exclude keeps all but that)"
        )
    if include is not None:
        return parse_filter("--include", str(include))
    return None if exclude is None else parse_filter("--exclude", str(exclude))


def select(
    chosen: ResourceFilter, pool: Mapping[str, int | None], key: Callable[[str], str | None], counted_by: str
) -> dict[str, list[int]]:
    """The hosts of ``pool`` (host -> its GPU count, None if unknown) that ``chosen`` keeps, in the
    pool's order, with their GPU indices. ``key`` maps a host the filter names to its pool entry
    (None: unknown, which raises); ``counted_by`` says where the counts come from. A count is known
    wherever the filter needs all of a host's GPUs."""
    kept: dict[str, set[int]] = {} if chosen.keeps else {host: set(range(count or 0)) for host, count in pool.items()}
    for name, gpus in chosen.hosts.items():
        host = key(name)
        if host is None:
            known = list(pool)
            shown = ", ".join(known[:8]) + (f", ... ({len(known)} hosts)" if len(known) > 8 else "")
            raise chosen.error(f"no host {name} to select: expected one of {shown}")
        count = pool[host]
        if gpus is not None and count is not None and max(gpus) >= count:
            raise chosen.error(
                f"GPU {max(gpus)} of {name} is out of range: it has {count} GPU{'s' * (count != 1)} "
                f"({counted_by}; expected indices 0..{count - 1})"
            )
        named = set(range(count or 0)) if gpus is None else set(gpus)
        if chosen.keeps:
            kept[host] = kept.get(host, set()) | named
        else:
            kept[host] -= named
    return {host: sorted(kept[host]) for host in pool if kept.get(host)}


def _this_node_gpus(chosen: ResourceFilter, environ: Mapping[str, str], gpu_count: Callable[[], int]) -> list[int]:
    """This node's GPUs that ``chosen`` selects, without a hostfile: it may name this node only."""
    names: set[str] | None = None

    def key(name: str) -> str | None:
        nonlocal names
        if name == "localhost":
            return "localhost"
        names = _this_host_names() if names is None else names
        return "localhost" if name in names or name.split(".")[0] in names else None

    for name in chosen.hosts:
        if key(name) is None:
            raise chosen.error(
                f"without --hostfile the host must be localhost or this host ({socket.gethostname()}), not {name}; "
                "give --hostfile FILE to choose among several hosts"
            )
    count, source = _known_gpu_count(environ)
    if count is None and (not chosen.keeps or None in chosen.hosts.values()):
        count, source = gpu_count(), "torch"
        if count < 1:
            raise chosen.error("torch sees no CUDA device on this node to select from (expected a GPU node)")
    gpus = select(chosen, {"localhost": count}, key, source).get("localhost", [])
    if not gpus:
        raise chosen.error(f"leaves none of this node's {count} GPUs (from {source}): it must keep at least one")
    return gpus


def _known_gpu_count(environ: Mapping[str, str]) -> tuple[int | None, str]:
    """This node's GPUs as the environment gives them (torch is not asked): CUDA_VISIBLE_DEVICES, then Slurm."""
    if VISIBLE_DEVICES in environ:
        return len(_visible_entries(environ[VISIBLE_DEVICES])), f"{VISIBLE_DEVICES}={environ[VISIBLE_DEVICES]}"
    try:
        return int(environ.get("SLURM_GPUS_ON_NODE", "")), f"SLURM_GPUS_ON_NODE={environ['SLURM_GPUS_ON_NODE']}"
    except ValueError:
        return None, ""


def _visible_entries(text: str) -> list[str]:
    return [entry.strip() for entry in text.split(",") if entry.strip()]


def _visible_devices(chosen: ResourceFilter | None, gpus: list[int] | None, environ: Mapping[str, str]) -> str | None:
    """CUDA_VISIBLE_DEVICES for the ranks: the selected indices, taken from CUDA_VISIBLE_DEVICES when set."""
    if chosen is None or gpus is None:
        return None
    if VISIBLE_DEVICES not in environ:
        return ",".join(str(gpu) for gpu in gpus)
    entries = _visible_entries(environ[VISIBLE_DEVICES])
    if gpus[-1] >= len(entries):
        raise chosen.error(
            f"GPU {gpus[-1]} is out of range: {VISIBLE_DEVICES}={environ[VISIBLE_DEVICES]} gives this node "
            f"{len(entries)} (expected indices into it)"
        )
    return ",".join(entries[gpu] for gpu in gpus)


@dataclass(frozen=True)
class Hostfile:
    hosts: list[str]
    slots: int


def read_hostfile(path: str) -> Hostfile:
    """DeepSpeed's hostfile: ``host slots=G`` per line, blank lines and ``#`` comments ignored. Every
    host must have the same G (node k owns ranks k*G .. k*G+G-1)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise UsageError(f"--hostfile {path}: cannot read it ({exc.strerror})") from None
    hosts: list[str] = []
    slots: set[int] = set()
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"(\S+)\s+slots\s*=\s*(\S+)", line)
        if match is None:
            raise UsageError(f"--hostfile {path} line {number}: {raw.strip()!r}: expected `HOST slots=G`")
        host, count = match.groups()
        if host in hosts:
            raise UsageError(f"--hostfile {path} line {number}: host {host} is listed twice")
        hosts.append(host)
        slots.add(_int_in(f"--hostfile {path} line {number}: slots", count, 1, 1024))
    if not hosts:
        raise UsageError(f"--hostfile {path}: no host in it (expected `HOST slots=G` lines)")
    if len(slots) != 1:
        raise UsageError(
            f"--hostfile {path}: every host needs the same slots (found {sorted(slots)}); ReCycle's nodes each "
            "hold G ranks of the P x D grid"
        )
    if len(hosts) > MAX_NODES:
        raise UsageError(f"--hostfile {path}: {len(hosts)} hosts; at most {MAX_NODES}")
    return Hostfile(hosts, slots.pop())


def _from_hostfile(
    args: argparse.Namespace,
    environ: Mapping[str, str],
    chosen: ResourceFilter | None,
    nnodes_given: tuple[str | None, str],
    per_node_given: tuple[str, str] | None,
) -> NodeSpec:
    hostfile = read_hostfile(args.hostfile)
    kept = {host: list(range(hostfile.slots)) for host in hostfile.hosts}
    what = f"--hostfile {args.hostfile}"
    if chosen is not None:
        pool: dict[str, int | None] = dict.fromkeys(hostfile.hosts, hostfile.slots)
        kept = select(chosen, pool, lambda name: name if name in pool else None, f"slots in --hostfile {args.hostfile}")
        counts = {len(gpus) for gpus in kept.values()}
        if not kept:
            raise chosen.error(f"leaves no host of --hostfile {args.hostfile}: it must keep at least one")
        if len(counts) != 1:
            found = ", ".join(f"{host} {len(gpus)}" for host, gpus in list(kept.items())[:8])
            raise chosen.error(
                f"the hosts it keeps must have the same number of GPUs (found {found}); ReCycle's nodes each hold "
                "G ranks of the P x D grid"
            )
        what = f"{what} with {chosen.flag} {chosen.text}"
    hosts = list(kept)
    nnodes = len(hosts)
    if nnodes_given[0] is not None and str(nnodes_given[0]) != str(nnodes):
        raise UsageError(f"{nnodes_given[1]} {nnodes_given[0]} and {what} ({nnodes} hosts): give one of them")
    nproc = len(kept[hosts[0]])
    if per_node_given is not None and _int_in(per_node_given[1], per_node_given[0], 1, MAX_NPROC) != nproc:
        raise UsageError(f"{per_node_given[1]} {per_node_given[0]} and {what} (slots={nproc}): give one of them")
    if args.node_rank is not None:
        node_rank = _int_in("--node-rank", args.node_rank, 0, nnodes - 1)
    else:
        if chosen is not None:
            _check_this_host_kept(chosen, hostfile.hosts, hosts)
        node_rank = _this_host(hosts, args.hostfile)
    visible = None if chosen is None else _visible_devices(chosen, kept[hosts[node_rank]], environ)
    if args.rdzv_endpoint is not None or args.master_addr is not None:
        raise UsageError("--hostfile names the endpoint (its first host): leave out --rdzv-endpoint and --master-addr")
    port = _first(args.master_port, "--master-port", environ, "MASTER_PORT")
    endpoint = (hosts[0], DEFAULT_PORT if port is None else _int_in(port[1], port[0], 1, 65535))
    if nnodes == 1:
        return NodeSpec(1, 0, nproc, None, None, visible_devices=visible)
    return NodeSpec(nnodes, node_rank, nproc, endpoint, _token(args.token_file, environ), visible_devices=visible)


def _this_host_names() -> set[str]:
    """This machine's names: its host name (full and short), its FQDN and its addresses."""
    name = socket.gethostname()
    names = {name, name.split(".")[0], socket.getfqdn()}
    try:
        names.update(socket.gethostbyname_ex(name)[2])
    except OSError:
        pass
    return names


def _lines_naming_this_host(hosts: list[str], names: set[str]) -> list[int]:
    return [k for k, host in enumerate(hosts) if host in names or host.split(".")[0] in names]


def _check_this_host_kept(chosen: ResourceFilter, every: list[str], kept: list[str]) -> None:
    """A filter that leaves out this host: its agent has no part in the job."""
    found = _lines_naming_this_host(every, _this_host_names())
    if len(found) == 1 and every[found[0]] not in kept:
        shown = ", ".join(kept[:8]) + (", ..." if len(kept) > 8 else "")
        raise chosen.error(
            f"leaves out this host ({every[found[0]]}): start ds-recycle launch only on the hosts it keeps ({shown})"
        )


def _this_host(hosts: list[str], path: str) -> int:
    """The line of ``hosts`` that names this machine: its host name (full or short) or an address."""
    names = _this_host_names()
    found = _lines_naming_this_host(hosts, names)
    if len(found) != 1:
        what = "no line names" if not found else "several lines name"
        raise UsageError(
            f"--hostfile {path}: {what} this host ({sorted(names)}); give --node-rank K (0..{len(hosts) - 1})"
        )
    return found[0]


def _nnodes(value: str | None, environ: Mapping[str, str], flag: str = "--nnodes") -> int:
    found = _first(value, flag, environ, "SLURM_NNODES")
    if found is None:
        return 1
    text, name = found
    if ":" in str(text):
        raise UsageError(
            f"{name} {text}: ReCycle's P x D grid is fixed, so an elastic range MIN:MAX is not accepted; give "
            "one number (a lost node is survived in place and re-admitted, not re-rendezvoused)"
        )
    return _int_in(name, text, 1, MAX_NODES)


ETCD_TLS_FLAGS = {"--etcd-cacert": "etcd_cacert", "--etcd-cert": "etcd_cert", "--etcd-key": "etcd_key"}


def etcd_endpoints(args: argparse.Namespace) -> tuple[str, ...] | None:
    """The etcd members of ``--rdzv-backend etcd`` (None for c10d); raises UsageError for a bad
    backend, endpoint list or TLS file."""
    backend = getattr(args, "rdzv_backend", "c10d")
    if backend not in ("c10d", "etcd"):
        raise UsageError(f"--rdzv-backend {shorten(str(backend), 40)!r}: expected c10d or etcd")
    for flag, name in ETCD_TLS_FLAGS.items():
        path = getattr(args, name, None)
        if path is not None and backend != "etcd":
            raise UsageError(f"{flag} is for --rdzv-backend etcd")
        if path is not None and not Path(path).is_file():
            raise UsageError(f"{flag} {shorten(path, 80)}: no such file (expected a PEM file)")
    if (getattr(args, "etcd_cert", None) is None) != (getattr(args, "etcd_key", None) is None):
        raise UsageError("--etcd-cert and --etcd-key go together (etcd's client TLS needs both)")
    if backend == "c10d":
        return None
    if args.rdzv_endpoint is None:
        raise UsageError("--rdzv-backend etcd needs --rdzv-endpoint HOST:PORT[,HOST:PORT...] (the etcd members)")
    members = [part.strip() for part in str(args.rdzv_endpoint).split(",")]
    if not all(members):
        raise UsageError(f"--rdzv-endpoint {shorten(str(args.rdzv_endpoint), 80)}: expected HOST:PORT[,HOST:PORT...]")
    for member in members:
        parse_endpoint(member)
    return tuple(members)


def _endpoint(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[str, int] | None:
    if getattr(args, "rdzv_backend", "c10d") == "etcd":
        return None
    if args.rdzv_endpoint is not None:
        return parse_endpoint(str(args.rdzv_endpoint))
    host = _first(args.master_addr, "--master-addr", environ, "MASTER_ADDR")
    if host is None and environ.get("SLURM_JOB_NODELIST"):
        hosts = expand_hostlist(environ["SLURM_JOB_NODELIST"])
        host = (hosts[0], "SLURM_JOB_NODELIST")
    if host is None:
        raise UsageError("several nodes need --rdzv-endpoint HOST:PORT (or --master-addr, MASTER_ADDR, Slurm)")
    port = _first(args.master_port, "--master-port", environ, "MASTER_PORT")
    return str(host[0]), DEFAULT_PORT if port is None else _int_in(port[1], port[0], 1, 65535)


def parse_endpoint(text: str, flag: str = "--rdzv-endpoint") -> tuple[str, int]:
    """``HOST:PORT``; raises UsageError naming ``flag`` and what is expected."""
    host, _, port = text.rpartition(":")
    if not host or not port:
        raise UsageError(f"{flag} {text}: expected HOST:PORT")
    return host, _int_in(f"{flag} port", port, 1, 65535)


def _token(token_file: str | None, environ: Mapping[str, str]) -> str:
    if token_file is not None:
        path = Path(token_file)
        try:
            mode = path.stat().st_mode
            text = path.read_text().strip()
        except OSError as exc:
            raise UsageError(f"--token-file {token_file}: cannot read it ({exc.strerror})") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise UsageError(f"--token-file {token_file}: readable by others (mode {oct(mode & 0o777)}); chmod 600 it")
        token = text
    else:
        token = environ.get(TOKEN_ENV, "")
    if not re.fullmatch(r"[0-9A-Za-z_\-]{16,256}", token):
        raise UsageError(
            f"several nodes need the same job token on every node: {TOKEN_ENV} or --token-file, 16 to 256 "
            "characters of [0-9A-Za-z_-] (e.g. `export DS_RECYCLE_TOKEN=$(openssl rand -hex 16)` in the batch script)"
        )
    return token


def _first(flag_value, flag: str, environ: Mapping[str, str], *variables: str) -> tuple[str, str] | None:
    """(value, where it came from) of the flag, else of the first variable set."""
    if flag_value is not None:
        return str(flag_value), flag
    for name in variables:
        if environ.get(name):
            return environ[name], name
    return None


def _int_in(name: str, value, low: int, high: int) -> int:
    try:
        number = int(str(value))
    except ValueError:
        raise UsageError(f"{name} {value}: must be an integer in {low}..{high}") from None
    if not low <= number <= high:
        raise UsageError(f"{name} {value}: must be an integer in {low}..{high}")
    return number


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list: ``node[01-03,07],gpu5`` -> node01 node02 node03 node07 gpu5."""
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", text):
        match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if match is None:
            hosts.append(part)
            continue
        prefix, ranges, suffix = match.groups()
        for item in ranges.split(","):
            low, _, high = item.partition("-")
            if not low.isdigit() or (high and not high.isdigit()):
                raise UsageError(f"SLURM_JOB_NODELIST {text}: cannot read the range {item!r}")
            width = len(low)
            for number in range(int(low), int(high or low) + 1):
                hosts.append(f"{prefix}{number:0{width}d}{suffix}")
    if not hosts:
        raise UsageError(f"SLURM_JOB_NODELIST {text!r}: no host in it")
    return hosts
