"""BackwardInput + BackwardWeight give the gradients of a fused backward, bitwise."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ds_recycle.engine.backward_split import backward_input, backward_weight
from ds_recycle.models.gpt import Block, CausalSelfAttention, PositionEmbedding, TokenEmbedding, lm_head, lm_loss


class TiedHead(nn.Module):
    """The last stage of the GPT: a block, the final LayerNorm and the tied LM head."""

    def __init__(self):
        super().__init__()
        self.block = Block(16, 4, 2)
        self.norm = nn.LayerNorm(16)
        self.embed = TokenEmbedding(11, 16)

    def forward(self, x):
        return lm_head(self.embed, self.norm(self.block(x)))


class FirstStage(nn.Module):
    """The first stage: token embedding (tied), positions and a block; its input is data."""

    def __init__(self):
        super().__init__()
        self.embed = TokenEmbedding(11, 16)
        self.pos = PositionEmbedding(6, 16)
        self.block = Block(16, 4, 2)

    def forward(self, tokens):
        return self.block(self.pos(self.embed(tokens)))


def _float_input(shape):
    return torch.randn(*shape)


CASES = {
    "linear": (lambda: nn.Linear(16, 8), lambda: _float_input((3, 16)), False),
    "layernorm": (lambda: nn.LayerNorm(16), lambda: _float_input((3, 5, 16)), False),
    "attention": (lambda: CausalSelfAttention(16, 4), lambda: _float_input((2, 6, 16)), False),
    "block": (lambda: Block(16, 4, 2), lambda: _float_input((2, 6, 16)), False),
    "tied_head_stage_with_loss": (TiedHead, lambda: _float_input((2, 6, 16)), True),
    "first_stage_tied_embedding": (FirstStage, lambda: torch.randint(0, 11, (2, 6)), False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_split_equals_fused_backward(case):
    make_module, make_input, with_loss = CASES[case]
    torch.manual_seed(0)
    fused = make_module()
    split = copy.deepcopy(fused)
    x = make_input()
    labels = torch.randint(0, 11, (2, 6))

    def run(module, inp):
        out = module(inp)
        if with_loss:
            return [lm_loss(out, labels)], None
        return [out], [torch.randn_like(out, generator=torch.Generator().manual_seed(1))]

    x_fused = x.clone().requires_grad_(x.is_floating_point())
    outs, grads = run(fused, x_fused)
    torch.autograd.backward(outs, grads)

    x_split = x.clone().requires_grad_(x.is_floating_point())
    outs, grads = run(split, x_split)
    input_grads, work = backward_input(outs, grads, [x_split], list(split.parameters()))
    if x.is_floating_point():
        assert torch.equal(input_grads[0], x_fused.grad)
    else:
        assert input_grads == (None,)
    assert all(p.grad is None for p in split.parameters()), "BackwardInput must not produce weight grads"
    backward_weight(work)
    for (name, want), got in zip(fused.named_parameters(), split.parameters(), strict=True):
        assert got.grad is not None, name
        assert torch.equal(got.grad, want.grad), f"{name}: max diff {(got.grad - want.grad).abs().max():.3e}"


def test_weight_grads_accumulate_over_microbatches_like_fused():
    torch.manual_seed(0)
    fused = Block(16, 4, 2)
    split = copy.deepcopy(fused)
    inputs = [torch.randn(2, 6, 16) for _ in range(3)]
    grads = [torch.randn(2, 6, 16) for _ in range(3)]
    for x, g in zip(inputs, grads, strict=True):
        fused(x.clone().requires_grad_()).backward(g)
    works = []
    for x, g in zip(inputs, grads, strict=True):
        xi = x.clone().requires_grad_()
        works.append(backward_input([split(xi)], [g], [xi], list(split.parameters()))[1])
    for work in works:
        backward_weight(work)
    for want, got in zip(fused.parameters(), split.parameters(), strict=True):
        assert torch.equal(got.grad, want.grad)


def test_output_hook_runs_once_per_microbatch():
    """DeepSpeed scales the last stage's output gradient with a tensor hook; W must not rerun it."""
    torch.manual_seed(0)
    fused = TiedHead()
    split = copy.deepcopy(fused)
    x = torch.randn(2, 6, 16)
    labels = torch.randint(0, 11, (2, 6))

    def forward(module, inp):
        logits = module(inp)
        logits.register_hook(lambda g: g / 4)
        return lm_loss(logits, labels)

    forward(fused, x.clone().requires_grad_()).backward()
    xi = x.clone().requires_grad_()
    backward_weight(backward_input([forward(split, xi)], None, [xi], list(split.parameters()))[1])
    for want, got in zip(fused.parameters(), split.parameters(), strict=True):
        assert torch.equal(got.grad, want.grad)
