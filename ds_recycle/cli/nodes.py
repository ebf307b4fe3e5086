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
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import socket
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ds_recycle.cli.common import UsageError, float_in

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
        "--hostfile",
        default=None,
        metavar="FILE",
        help="DeepSpeed's hostfile (`host slots=G` per line): the nodes, their ranks and the endpoint",
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


def resolve(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> NodeSpec:
    """The node this agent is; raises UsageError naming the flag or variable and what is allowed."""
    spec = _resolve(args, environ)
    domain = getattr(args, "domain", None)
    if domain is None:
        return spec
    if not re.fullmatch(DOMAIN_PATTERN, domain):
        raise UsageError(f"--domain {domain!r}: 1 to 64 characters of [A-Za-z0-9_.:-] (e.g. rack3)")
    return dataclasses.replace(spec, domain=domain)


def resolve_job(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> JobSpec:
    """The job a standalone coordinator hosts (several nodes, an endpoint, the token); raises
    UsageError naming the flag or variable and what is allowed."""
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


def _resolve(args: argparse.Namespace, environ: Mapping[str, str]) -> NodeSpec:
    if getattr(args, "hostfile", None) is not None and args.nproc is None:
        return _from_hostfile(args, environ)
    nnodes = _nnodes(args.nnodes, environ)
    if args.nproc is not None and args.nproc_per_node is not None:
        raise UsageError("--nproc and --nproc-per-node: give one of them (--nproc N is one node of N ranks)")
    if args.nproc is not None:
        if nnodes != 1:
            raise UsageError(f"--nproc with --nnodes {nnodes}: use --nproc-per-node G on several nodes")
        several = [flag for flag, value in _NODE_FLAGS.items() if getattr(args, value) is not None]
        if several:
            raise UsageError(f"{several[0]} is for several nodes; with --nproc N (one node) leave it out")
        return NodeSpec(1, 0, _int_in("--nproc", args.nproc, 1, 1024), None, None)
    per_node = _first(args.nproc_per_node, "--nproc-per-node", environ, "SLURM_GPUS_ON_NODE")
    if per_node is None:
        raise UsageError("--nproc N (one node) or --nproc-per-node G is required (or SLURM_GPUS_ON_NODE)")
    nproc = _int_in(per_node[1], per_node[0], 1, 1024)
    rank = _first(args.node_rank, "--node-rank", environ, "SLURM_NODEID", "NODE_RANK", "GROUP_RANK")
    node_rank = 0 if rank is None else _int_in(rank[1], rank[0], 0, nnodes - 1)
    if nnodes == 1:
        return NodeSpec(1, 0, nproc, None, None)
    endpoint = _endpoint(args, environ)
    return NodeSpec(nnodes, node_rank, nproc, endpoint, _token(args.token_file, environ))


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


def _from_hostfile(args: argparse.Namespace, environ: Mapping[str, str]) -> NodeSpec:
    hostfile = read_hostfile(args.hostfile)
    nnodes = len(hostfile.hosts)
    if args.nnodes is not None and str(args.nnodes) != str(nnodes):
        raise UsageError(f"--nnodes {args.nnodes} and --hostfile {args.hostfile} ({nnodes} hosts): give one of them")
    nproc = hostfile.slots
    if args.nproc_per_node is not None and _int_in("--nproc-per-node", args.nproc_per_node, 1, 1024) != nproc:
        raise UsageError(
            f"--nproc-per-node {args.nproc_per_node} and --hostfile {args.hostfile} (slots={nproc}): give one of them"
        )
    if args.node_rank is not None:
        node_rank = _int_in("--node-rank", args.node_rank, 0, nnodes - 1)
    else:
        node_rank = _this_host(hostfile.hosts, args.hostfile)
    if args.rdzv_endpoint is not None or args.master_addr is not None:
        raise UsageError("--hostfile names the endpoint (its first host): leave out --rdzv-endpoint and --master-addr")
    port = _first(args.master_port, "--master-port", environ, "MASTER_PORT")
    endpoint = (hostfile.hosts[0], DEFAULT_PORT if port is None else _int_in(port[1], port[0], 1, 65535))
    if nnodes == 1:
        return NodeSpec(1, 0, nproc, None, None)
    return NodeSpec(nnodes, node_rank, nproc, endpoint, _token(args.token_file, environ))


def _this_host(hosts: list[str], path: str) -> int:
    """The line of ``hosts`` that names this machine: its host name (full or short) or an address."""
    name = socket.gethostname()
    names = {name, name.split(".")[0], socket.getfqdn()}
    try:
        names.update(socket.gethostbyname_ex(name)[2])
    except OSError:
        pass
    found = [k for k, host in enumerate(hosts) if host in names or host.split(".")[0] in names]
    if len(found) != 1:
        what = "no line names" if not found else "several lines name"
        raise UsageError(
            f"--hostfile {path}: {what} this host ({sorted(names)}); give --node-rank K (0..{len(hosts) - 1})"
        )
    return found[0]


def _nnodes(value: str | None, environ: Mapping[str, str]) -> int:
    found = _first(value, "--nnodes", environ, "SLURM_NNODES")
    if found is None:
        return 1
    text, name = found
    if ":" in str(text):
        raise UsageError(
            f"{name} {text}: ReCycle's P x D grid is fixed, so an elastic range MIN:MAX is not accepted; give "
            "one number (a lost node is survived in place and re-admitted, not re-rendezvoused)"
        )
    return _int_in(name, text, 1, MAX_NODES)


def _endpoint(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[str, int]:
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
