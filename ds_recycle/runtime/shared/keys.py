"""The job's store keys, the environment ``ds-recycle launch`` gives its ranks, and the exit codes
by which a rank tells its launcher what to do next.

``ds-recycle launch`` hosts one store for the whole job and is the single owner of the list of
pending membership changes. Trainers post requests; the launcher validates them (the job token's
seal, the slot, the kind) and appends the accepted ones, and the failures it detects itself, to
``pending``. At the end of every iteration the current members fix, with one ``compare_set``, which
pending changes take effect: the first member to reach the boundary decides for all, with one
``compare_set`` each (a member proposes the changes its watcher has seen; it reads no key). After a
failure the survivors post their progress and fix one recovery decision the same way.

Every record's value is sealed with the job token (:mod:`ds_recycle.runtime.shared.seal`): anyone who
reaches the store may write a key, and a record without the job's seal is refused or stops the job
with an error, never taken. Counters and wake keys are not sealed.

Every key lives under ``job/<generation>/``: a restart from a checkpoint starts a new generation,
so nothing from the previous one is read again. This table is the whole protocol; no other module
spells a key: :class:`~ds_recycle.runtime.shared.job_store.JobStore` is the one that uses them.

==============================  =====================================================  ==========
key                             value                                                  writer
==============================  =====================================================  ==========
world_size                      N (the number of slots)                                launcher
nodes                           the number of nodes (world_size / nodes ranks each)    launcher
epoch/<n>                       :class:`Membership` JSON                               members
current_epoch                   n, advanced by compare_set from n-1                    members
request_count, request/<k>      :class:`Request` JSON (k from ``add(request_count,1)``)  anyone
change/<seq>                    one :class:`Change` of ``pending``, the job's          launcher
                                append-only list of changes: ``failed``, ``leave``,
                                ``join``, ``move`` (a migration), ``retired`` (a slot
                                that will not be started again)
alert                           counter: how many changes there are (moved on after    launcher
                                their keys are written): a reader reads only new ones
node_alert/<node>/<k>           set for every node, in one write, when ``alert`` is k;  launcher
                                the node's agent blocks on its own next one and copies (its own
                                the changes into the node's store (below): every        at stop)
                                change wakes every node, and no one polls for changes
decision/<n>/<i>                :class:`Decision` for epoch n at the end of iteration i  members
progress/<n>/<slot>             a survivor's :class:`Progress` after a failure in n     members
progress_count/<n>              counter: survivors that posted their progress in n      members
recovery/<n>                    the survivors' :class:`Decision` after a failure in n  members
ready/<n>                       counter: members of epoch n ready to build its world   members
entered/<n>                     set by the member whose ``ready/<n>`` count completed    members
                                epoch n's members (the others block on it)
world/<n>/...                   the gloo rendezvous of epoch n's world                 torch
node_incarnation/<node>         counter: +1 per agent start of that node               agent
lease/<node>                    :class:`Lease` JSON, renewed by the node's agent, with  agent
                                its ranks' last :class:`Beat` (heartbeat, iteration    (node 0:
                                time: relayed from the node-local beat files)          coordinator)
domain/<node>                   the node's failure domain (``--domain``; "" for none)  agent
report_count, report/<k>        :class:`AgentReport` JSON: a rank started or exited    agent
kill_count/<node>, kill/<node>/<k>  slot and incarnation the node's agent must kill    launcher
ended/<node>                    :class:`AgentEnd` JSON: the agent's incarnation and     agent
                                exit code, written as it ends
recycle/eval_committed          the last evaluation batch a member finished: its key   members
                                and loss (JSON)
coordinator_cursor              the next request and report the coordinator reads     launcher
                                (JSON): where a successor on etcd takes over
status                          :class:`StatusReport` JSON: the current plan (times,    the lowest
                                stragglers, Gantt), each slot's worker, the last       surviving
                                changes with their latencies (read by the status page)  member
==============================  =====================================================  ==========

The node's store (``DS_RECYCLE_NODE_STORE``, on 127.0.0.1, hosted by the node's agent:
:mod:`ds_recycle.runtime.node.node_watch`) holds a copy of what the ranks' failure watchers read, under the
same keys and generation prefix: ``change/<seq>``, the latest ``epoch/<n>`` with the boundary
``decision/<n-1>/<i>`` that made it, ``current_epoch``, ``alert``, and ``alert/<slot>/<k>``, set for
each of the node's slots when the copy's ``alert`` is k. A rank's watcher blocks on its own next one
(and sets it to wake itself when it stops). The decisions are taken on the job's store only.

The node's ranks also count there what the job's store then counts once per node: a survivor posts
``progress/<n>/<slot>`` and adds 1 to ``progress_count/<n>`` on the node's store; the one whose add
completes the node's survivors claims ``progress_forwarder/<n>`` on the node's store (its slot, by
``compare_set``), copies their posts to the job's store in one ``multi_set`` and adds their number
to the job's ``progress_count/<n>``; if the claimer dies, a node's survivor that sees its failure
claims it from it and copies them again. A member entering epoch n adds 1 to the node's ``ready/<n>``;
the one whose add completes the node's members adds their number to the job's ``ready/<n>``.

Two keys live outside every generation, at the store's root: ``generation`` (the generation the
coordinator runs; written once its ``job/<g>/`` keys are) and ``check_in/<node>`` (a
:class:`CheckIn`: an agent waiting for the coordinator to start a generation). A coordinator
restarted after its host died has a fresh store: it waits for every node's check-in and runs
generation max(last) + 1, so that no process of an earlier generation can write into the new one.

A rank never writes its heartbeat to the store: it writes it to a file in its node's beat
directory (``DS_RECYCLE_BEATS``, :mod:`ds_recycle.runtime.shared.beats`), and its node's agent relays every
rank's last beat in its lease, one write per node and renewal instead of ten per rank and second.

With several nodes, node 0's agent hosts the store and the coordinator; every other node's agent
reports its ranks' starts and exits (``report/<k>``), holds a lease (``lease/<node>``), and carries
out the coordinator's kills (``kill/<node>/<k>``).
"""

from __future__ import annotations

ENV_STORE = "DS_RECYCLE_STORE"
"""``host:port`` of the coordinator store (set by ``ds-recycle launch``)."""
ENV_TOKEN = "DS_RECYCLE_TOKEN"
"""The job's secret; a request without it is refused."""
ENV_INCARNATION = "DS_RECYCLE_INCARNATION"
"""0 for a rank's first start, k after its k-th respawn: a process with k > 0 joins a running job."""
ENV_NODE_STORE = "DS_RECYCLE_NODE_STORE"
"""``127.0.0.1:port`` of the node's store, where the node's agent copies the job's changes for its
ranks' failure watchers (set by ``ds-recycle launch``)."""
ENV_BEATS = "DS_RECYCLE_BEATS"
"""The node-local directory where each rank writes its heartbeat (one file per slot) for its node's
agent to relay (set by ``ds-recycle launch``)."""
ENV_ALLOW_UNSAFE_PLACEMENT = "DS_RECYCLE_ALLOW_UNSAFE_PLACEMENT"
"""Set to 1 by ``ds-recycle launch --allow-unsafe-placement``: start even if one node holds every
replica of a stage (its loss then stops the job or restarts it from a checkpoint)."""
ENV_GENERATION = "DS_RECYCLE_GENERATION"
"""0 at first, +1 at every restart of the whole job from a checkpoint; the key prefix."""
ENV_BACKEND = "DS_RECYCLE_BACKEND"
"""``gloo`` or ``nccl`` (set by ``ds-recycle launch --backend``): the backend of the job's worlds."""
ENV_RESUME = "DS_RECYCLE_RESUME"
"""``required`` when the agents restart every rank after the coordinator's host died: a rank that
finds no checkpoint to resume from exits 76 with a message instead of training from scratch."""

RESTART_EXIT_CODE = 75
"""A trainer exits with this code when training cannot go on in place (a stage lost every worker) and
a checkpoint exists: ``ds-recycle launch --respawn`` then restarts every rank from it."""
STOP_EXIT_CODE = 76
"""A trainer exits with this code when training cannot go on in place and there is no checkpoint to
restart from: the launcher stops the job (no respawn) and exits non-zero."""
JOIN_GIVEN_UP_EXIT_CODE = 77
"""A joiner exits with this code when a failure among the members stopped it before its state
arrived: the launcher publishes it as a failure (the members leave it out of their recovery) and
respawns it at once, without counting it as a failure of the process."""
STORE_TIMEOUT_SECONDS = 120.0
"""Bound on a blocking store operation of a trainer (the launcher's store is its own host or a
neighbour; a healthy operation takes microseconds)."""
HEARTBEAT_MIN_TIMEOUT_SECONDS = 10.0
"""Default floor of the hang timeout (the launcher's ``--heartbeat-min-timeout``)."""


def prefix(generation: int) -> str:
    return f"job/{generation}/"


def epoch_key(epoch: int) -> str:
    return f"epoch/{epoch}"


def decision_key(epoch: int, iteration: int) -> str:
    return f"decision/{epoch}/{iteration}"


def recovery_key(epoch: int) -> str:
    return f"recovery/{epoch}"


def progress_key(epoch: int, slot: int) -> str:
    return f"progress/{epoch}/{slot}"


def progress_count_key(epoch: int) -> str:
    return f"progress_count/{epoch}"


def progress_forwarder_key(epoch: int) -> str:
    """On the node's store only."""
    return f"progress_forwarder/{epoch}"


def change_key(seq: int) -> str:
    return f"change/{seq}"


def alert_key(slot: int, count: int) -> str:
    """In the node's store, set once its ``alert`` reached ``count``: what ``slot``'s failure
    watcher blocks on."""
    return f"alert/{slot}/{count}"


def node_alert_key(node: int, count: int) -> str:
    """Set once ``alert`` reached ``count``: what node ``node``'s agent blocks on."""
    return f"node_alert/{node}/{count}"


def ready_key(epoch: int) -> str:
    return f"ready/{epoch}"


def entered_key(epoch: int) -> str:
    return f"entered/{epoch}"


def world_prefix(epoch: int) -> str:
    """The prefix of epoch ``epoch``'s gloo rendezvous keys."""
    return f"world/{epoch}/"


def lease_key(node: int) -> str:
    return f"lease/{node}"


def domain_key(node: int) -> str:
    return f"domain/{node}"


def node_incarnation_key(node: int) -> str:
    return f"node_incarnation/{node}"


def report_key(index: int) -> str:
    return f"report/{index}"


def kill_count_key(node: int) -> str:
    return f"kill_count/{node}"


def kill_key(node: int, index: int) -> str:
    return f"kill/{node}/{index}"


def ended_key(node: int) -> str:
    return f"ended/{node}"


def check_in_key(node: int) -> str:
    """At the store's root (no generation prefix)."""
    return f"check_in/{node}"


def request_key(index: int) -> str:
    return f"request/{index}"


WORLD_SIZE = "world_size"
NODES = "nodes"
STATUS = "status"
CURRENT_EPOCH = "current_epoch"
REQUEST_COUNT = "request_count"
REPORT_COUNT = "report_count"
ALERT = "alert"
GENERATION = "generation"
"""At the store's root (no generation prefix)."""
RENDEZVOUS = "rendezvous"
"""On etcd, at the store's root: ``host:port`` of the TCPStore that the coordinator's holder hosts for
torch's process groups (written with the role's lease: it goes with the holder)."""
COORDINATOR_CURSOR = "coordinator_cursor"
EVAL_COMMITTED = "recycle/eval_committed"
"""The job store's record of the last evaluation batch a member finished: its key and loss."""
