"""Which ranks share a node, and what a node's loss does to the grid.

Launchers give node k a contiguous block of ranks. DeepSpeed's default pipe-data topology numbers
ranks stage by stage (rank = stage * D + pipeline), so a node holds replicas of one stage: with
D <= G a node's loss empties that stage and the job must restart from a checkpoint. The
pipeline-major topology (rank = pipeline * P + stage) puts whole pipelines, or runs of stages of
one pipeline, on a node: a node's loss removes whole pipelines' workers, which is ReCycle's design
point (its micro-batches go to the other pipelines). The price: the data-parallel all-reduce of
every stage crosses nodes, while activations and gradients between stages stay inside a node.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ds_recycle.planner.plan import Worker


def pipeline_major_topology(pipeline_stages: int, data_parallel: int):
    """A DeepSpeed ``ProcessTopology`` whose ranks run pipeline by pipeline (pass it to
    ``PipelineModule(topology=...)``)."""
    from deepspeed.runtime.pipe.topology import ProcessTopology

    return ProcessTopology(axes=["data", "pipe"], dims=[data_parallel, pipeline_stages])


def contiguous_nodes(world_size: int, per_node: int) -> dict[int, list[int]]:
    """Node k holds ranks k * G .. k * G + G - 1, as every launcher places them."""
    return {node: list(range(node * per_node, (node + 1) * per_node)) for node in range(world_size // per_node)}


@dataclass(frozen=True)
class NodeLayout:
    """How the launcher placed a job's ranks: ``world`` ranks, ``per_node`` contiguous ranks on each
    node (node k holds ranks k * per_node .. k * per_node + per_node - 1)."""

    world: int
    per_node: int

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] = os.environ, world: int | None = None, required: bool = False
    ) -> NodeLayout:
        """The layout of a rank's environment: ``WORLD_SIZE`` (or ``world``, say the topology's) and
        the launcher's ``LOCAL_WORLD_SIZE``; one node of every rank where that is unset or 0.
        ``required``: raise KeyError where it is unset. ValueError where a value is not an integer."""
        if world is None:
            world = int(environ.get("WORLD_SIZE", 1))
        per_node = environ["LOCAL_WORLD_SIZE"] if required else environ.get("LOCAL_WORLD_SIZE", 0) or 0
        return cls(world, int(per_node) or world)

    @property
    def several(self) -> bool:
        """Whether the job runs on more than one node."""
        return 0 < self.per_node < self.world

    @property
    def count(self) -> int:
        return max(1, self.world // self.per_node)

    @property
    def nodes(self) -> dict[int, list[int]]:
        """node -> its ranks (:func:`contiguous_nodes`)."""
        return contiguous_nodes(self.world, self.per_node)

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def slots(self, node: int) -> range:
        """The ranks of ``node``."""
        return range(node * self.per_node, (node + 1) * self.per_node)


def emptied_stages(
    nodes: Mapping[int, Iterable[int]], worker_of: Mapping[int, Worker], stages: int, failed_nodes: Iterable[int]
) -> list[int]:
    """The stages left without a live worker when ``failed_nodes`` are lost."""
    gone = {rank for node in failed_nodes for rank in nodes[node]}
    live = {worker_of[rank][1] for rank in worker_of if rank not in gone}
    return [stage for stage in range(stages) if stage not in live]


def unsafe_nodes(
    nodes: Mapping[int, Iterable[int]], worker_of: Mapping[int, Worker], stages: int
) -> dict[int, list[int]]:
    """Nodes whose loss alone would empty a stage: node -> the stages it holds every replica of."""
    return {node: emptied for node in nodes if (emptied := emptied_stages(nodes, worker_of, stages, [node]))}


def domains_of(nodes: Mapping[int, Iterable[int]], labels: Mapping[int, str]) -> dict[str, list[int]]:
    """Ranks by failure domain: nodes with the same label (a rack, a switch) form one domain; a node
    without a label is a domain of its own, named ``node <k>``."""
    domains: dict[str, list[int]] = {}
    for node, ranks in nodes.items():
        domains.setdefault(labels.get(node) or f"node {node}", []).extend(ranks)
    return domains
