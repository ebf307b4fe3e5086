"""ds_recycle.engine.autograd_graph against torch's own graph split
(``torch.distributed.pipelining._backward``): the same parameter groups and intermediates."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.pipelining import _backward as reference

from ds_recycle.engine.autograd_graph import consumers, grad_node, param_groups
from ds_recycle.models.gpt import Block


def _as_sets(groups: list[dict]) -> set[tuple[frozenset, frozenset]]:
    return {(frozenset(g["params"]), frozenset(g["intermediates"])) for g in groups}


def _block() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.LayerNorm(16), torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16), torch.nn.Tanh()
    )


class Residual(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _block()
        self.scale = torch.nn.Parameter(torch.ones(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.scale * self.inner(x)


def _gpt_blocks() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(Block(16, 4, 4), Block(16, 4, 4))


@pytest.mark.parametrize("make", [_block, Residual, _gpt_blocks], ids=["mlp", "residual", "gpt-blocks"])
def test_the_groups_are_torchs(make):
    model = make()
    x = torch.randn(4, 3, 16, requires_grad=True)
    out = model(x)
    params = [p for p in model.parameters() if p.requires_grad]
    inputs = [grad_node(x)]
    weights = [grad_node(p) for p in params]
    outputs = [grad_node(out)]
    ours = param_groups(inputs, weights, consumers(outputs))
    theirs = reference.get_param_groups(inputs, weights, reference.construct_reverse_graph(outputs))
    assert _as_sets(ours) == _as_sets(theirs)
    assert set().union(*(g["params"] for g in ours)) == set(weights), "every parameter is in one group"
    assert sum(len(g["params"]) for g in ours) == len(weights)


def test_grad_node_of_a_leaf_is_its_accumulator_and_of_a_result_its_grad_fn():
    leaf = torch.ones(3, requires_grad=True)
    assert grad_node(leaf) is reference._get_grad_fn_or_grad_acc(leaf)
    assert type(grad_node(leaf)).__name__ == "AccumulateGrad"
    y = leaf * 2
    assert grad_node(y) is y.grad_fn
    assert grad_node(torch.ones(3)) is None
