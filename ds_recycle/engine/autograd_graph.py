"""The autograd graph as the decoupled backward reads it: the node a tensor's gradient flows into,
the graph's edges read towards the outputs, and the nodes where each parameter's subgraph joins
the path from the stage inputs to the outputs (the graph split of
``torch.distributed.pipelining``, in our own code: importing that package costs a rank about a
second of CPU)."""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable, Sequence

import torch
from torch.autograd.graph import Node


def grad_node(t: torch.Tensor) -> Node | None:
    """The node that receives ``t``'s gradient: its ``grad_fn``, or for a leaf that requires grad
    its ``AccumulateGrad`` node (autograd creates that one lazily; a view makes it exist)."""
    if t.grad_fn is not None or not t.requires_grad:
        return t.grad_fn
    node = t.view_as(t).grad_fn
    if node is None:
        raise RuntimeError("a tensor that requires grad has no gradient node: was it made under torch.no_grad()?")
    return node.next_functions[0][0]


def consumers(roots: Iterable[Node | None]) -> dict[Node, list[Node]]:
    """For every node reachable from ``roots`` through ``next_functions``, the nodes that use its
    output: the edges read from the inputs towards the outputs."""
    used_by: dict[Node, list[Node]] = defaultdict(list)
    queue = deque(dict.fromkeys(n for n in roots if n is not None))
    seen = set(queue)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in seen:
                seen.add(child)
                queue.append(child)
            used_by[child].append(node)
    return used_by


def _towards_outputs(
    starts: Iterable[Node | None], used_by: dict[Node, list[Node]], stop: set[Node] | None = None
) -> tuple[set[Node], set[Node]]:
    """The nodes reached from ``starts`` towards the outputs without entering ``stop``, and the
    ``stop`` nodes met on the way."""
    reached = {n for n in starts if n is not None}
    met: set[Node] = set()
    queue = deque(reached)
    while queue:
        for user in used_by.get(queue.popleft(), ()):
            if user in reached:
                continue
            if stop is not None and user in stop:
                met.add(user)
                continue
            reached.add(user)
            queue.append(user)
    return reached, met


def param_groups(inputs: Sequence[Node], params: Sequence[Node], used_by: dict[Node, list[Node]]) -> list[dict]:
    """Parameters grouped by the intermediate nodes where their subgraphs join the inputs' path to
    the outputs: ``{"params": set, "intermediates": set}``, groups sharing an intermediate merged.
    Back-propagating the gradients captured at a group's intermediates gives its parameters'
    gradients. A parameter whose subgraph never joins that path is in no group."""
    on_input_path, _ = _towards_outputs(inputs, used_by)
    groups: list[dict] = []
    group_of: dict[Node, dict] = {}
    for param in params:
        _, joins = _towards_outputs([param], used_by, stop=on_input_path)
        if not joins:
            continue
        group = {"params": {param}, "intermediates": set(joins)}
        absorbed = list({id(group_of[n]): group_of[n] for n in joins if n in group_of}.values())
        for other in absorbed:
            group["params"] |= other["params"]
            group["intermediates"] |= other["intermediates"]
        groups = [g for g in groups if all(g is not other for other in absorbed)] + [group]
        for node in group["intermediates"]:
            group_of[node] = group
    return groups
