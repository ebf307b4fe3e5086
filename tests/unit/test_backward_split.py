"""BackwardInput + BackwardWeight give the gradients of a fused backward, bitwise: the generic
graph split ("graph") and the W path that defers Linear weight GEMMs ("path"), in fp32 and under
bf16 autocast."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ds_recycle.engine.backward_split import backward_input, backward_weight
from ds_recycle.engine.held_memory import measure_held_bytes
from ds_recycle.engine.weight_grad import install_weight_grad_path
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


def _deferred_weights(module: nn.Module, path) -> set[int]:
    return {id(linear.weight) for linear in path.linears} if path is not None else {id(p) for p in module.parameters()}


def _autocast(enabled: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled)


def _assert_same_grads(fused: nn.Module, split: nn.Module) -> None:
    for (name, want), got in zip(fused.named_parameters(), split.parameters(), strict=True):
        assert got.grad is not None, name
        assert got.grad.dtype == want.grad.dtype, name
        assert torch.equal(got.grad, want.grad), f"{name}: max diff {(got.grad - want.grad).abs().max():.3e}"


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("mode", ["graph", "path"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_split_equals_fused_backward(case, mode, bf16):
    make_module, make_input, with_loss = CASES[case]
    torch.manual_seed(0)
    fused = make_module()
    split = copy.deepcopy(fused)
    path = install_weight_grad_path(split) if mode == "path" else None
    x = make_input()
    labels = torch.randint(0, 11, (2, 6))

    def run(module, inp):
        with _autocast(bf16):
            out = module(inp)
        if with_loss:
            return [lm_loss(out, labels)], None
        return [out], [torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)]

    x_fused = x.clone().requires_grad_(x.is_floating_point())
    outs, grads = run(fused, x_fused)
    torch.autograd.backward(outs, grads)

    x_split = x.clone().requires_grad_(x.is_floating_point())
    outs, grads = run(split, x_split)
    input_grads, work = backward_input(outs, grads, [x_split], list(split.parameters()), path=path)
    if x.is_floating_point():
        assert torch.equal(input_grads[0], x_fused.grad)
        assert x_split.grad is None, "B returns the input gradient; it leaves none behind"
    else:
        assert input_grads == (None,)
    deferred = _deferred_weights(split, path)
    assert all(p.grad is None for p in split.parameters() if id(p) in deferred), "B must not produce W's grads"
    if path is not None:
        assert len(work.gemms) == len(path.linears)
    backward_weight(work)
    _assert_same_grads(fused, split)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("mode", ["graph", "path"])
def test_weight_grads_accumulate_over_microbatches_like_fused(mode, bf16):
    """All Bs first, then all Ws (as a deferred schedule runs them)."""
    torch.manual_seed(0)
    fused = Block(16, 4, 2)
    split = copy.deepcopy(fused)
    path = install_weight_grad_path(split) if mode == "path" else None
    inputs = [torch.randn(2, 6, 16) for _ in range(3)]
    grads = [torch.randn(2, 6, 16) for _ in range(3)]
    for x, g in zip(inputs, grads, strict=True):
        with _autocast(bf16):
            out = fused(x.clone().requires_grad_())
        out.backward(g.to(out.dtype))
    works = []
    for x, g in zip(inputs, grads, strict=True):
        xi = x.clone().requires_grad_()
        with _autocast(bf16):
            out = split(xi)
        works.append(backward_input([out], [g.to(out.dtype)], [xi], list(split.parameters()), path=path)[1])
    for work in works:
        backward_weight(work)
    _assert_same_grads(fused, split)


@pytest.mark.parametrize("mode", ["graph", "path"])
def test_output_hook_runs_once_per_microbatch(mode):
    """DeepSpeed scales the last stage's output gradient with a tensor hook; W must not rerun it."""
    torch.manual_seed(0)
    fused = TiedHead()
    split = copy.deepcopy(fused)
    path = install_weight_grad_path(split) if mode == "path" else None
    x = torch.randn(2, 6, 16)
    labels = torch.randint(0, 11, (2, 6))

    def forward(module, inp):
        logits = module(inp)
        logits.register_hook(lambda g: g / 4)
        return lm_loss(logits, labels)

    forward(fused, x.clone().requires_grad_()).backward()
    xi = x.clone().requires_grad_()
    backward_weight(backward_input([forward(split, xi)], None, [xi], list(split.parameters()), path=path)[1])
    _assert_same_grads(fused, split)


class MiddleWithCustomParam(nn.Module):
    """A middle stage with a module the W path does not cover (a 2-D parameter outside a Linear)."""

    def __init__(self):
        super().__init__()
        self.pos = PositionEmbedding(6, 16)
        self.block = Block(16, 4, 2)

    def forward(self, x):
        return self.block(self.pos(x))


class ReusedLinear(nn.Module):
    """One Linear called twice, one called on a non-contiguous input (which runs plain
    ``F.linear``, its weight gradient in B), and two Linears sharing a weight."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.strided = nn.Linear(16, 16)
        self.tied = nn.Linear(16, 16)
        self.other = nn.Linear(16, 16)
        self.other.weight = self.tied.weight

    def forward(self, x):
        y = self.lin(self.lin(x).relu())
        y = y + self.strided(y.transpose(0, 1)).transpose(0, 1)
        return self.other(self.tied(y))


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("make_module", [MiddleWithCustomParam, ReusedLinear])
def test_path_falls_back_where_it_does_not_cover(make_module, bf16):
    torch.manual_seed(0)
    fused = make_module()
    split = copy.deepcopy(fused)
    path = install_weight_grad_path(split)
    if make_module is MiddleWithCustomParam:
        assert list(path.fallback) == ["pos"] and "generic graph split for: pos" in path.describe()
    else:
        assert path.tied_linears == ["tied", "other"] and [id(m) for m in path.linears] == [
            id(split.lin),
            id(split.strided),
        ]
    x, g = torch.randn(2, 6, 16), torch.randn(2, 6, 16)
    for module, mode in ((fused, None), (split, path)):
        for _ in range(2):
            xi = x.clone().requires_grad_()
            with _autocast(bf16):
                out = module(xi)
            if mode is None:
                out.backward(g.to(out.dtype))
                continue
            input_grads, work = backward_input([out], [g.to(out.dtype)], [xi], list(module.parameters()), path=mode)
            backward_weight(work)
    _assert_same_grads(fused, split)


def test_first_stage_path_runs_b_then_only_gemms():
    torch.manual_seed(0)
    fused = FirstStage()
    split = copy.deepcopy(fused)
    path = install_weight_grad_path(split)
    tokens = torch.randint(0, 11, (2, 6))
    g = torch.randn(2, 6, 16)
    fused(tokens).backward(g)
    _, work = backward_input([split(tokens)], [g], [tokens], list(split.parameters()), path=path)
    assert not work.param_groups and not work.deferred_outputs and len(work.gemms) == 4
    assert split.pos.weight.grad is not None, "on the first stage uncovered parameters take their grad in B"
    backward_weight(work)
    _assert_same_grads(fused, split)


def test_plain_backward_through_the_path_is_a_fused_backward():
    torch.manual_seed(0)
    fused = Block(16, 4, 2)
    split = copy.deepcopy(fused)
    path = install_weight_grad_path(split)
    x = torch.randn(2, 6, 16)
    fused(x).sum().backward()
    split(x).sum().backward()
    _assert_same_grads(fused, split)
    path.uninstall()
    assert all("forward" not in m.__dict__ for m in split.modules())


def test_path_with_activation_checkpointing():
    """torch's non-reentrant checkpoint (what the engine uses) recomputes what the path saved."""
    torch.manual_seed(0)
    fused = Block(16, 4, 2)
    split = copy.deepcopy(fused)
    path = install_weight_grad_path(split)
    x, g = torch.randn(2, 6, 16), torch.randn(2, 6, 16)
    xf = x.clone().requires_grad_()
    torch.utils.checkpoint.checkpoint(fused, xf, use_reentrant=False).backward(g)
    xs = x.clone().requires_grad_()
    out = torch.utils.checkpoint.checkpoint(split, xs, use_reentrant=False)
    input_grads, work = backward_input([out], [g], [xs], list(split.parameters()), path=path)
    assert torch.equal(input_grads[0], xf.grad)
    backward_weight(work)
    _assert_same_grads(fused, split)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_w_path_holds_less_between_b_and_w(bf16):
    """On a GPT stage the W path holds at most 0.6x of the graph split's bytes between B and W,
    and nothing after W; the graph split holds more than the forward did."""
    torch.manual_seed(0)
    stage = nn.Sequential(Block(32, 4, 4), Block(32, 4, 4))
    with_path = copy.deepcopy(stage)
    path = install_weight_grad_path(with_path)
    x = torch.randn(2, 16, 32)
    dtype = torch.bfloat16 if bf16 else None
    graph = measure_held_bytes(stage, x, None, dtype)
    ours = measure_held_bytes(with_path, x, path, dtype)
    assert graph.after_forward == ours.after_forward > 0
    assert graph.ratio > 1.2
    assert ours.between_b_and_w <= 0.6 * graph.between_b_and_w
    assert ours.after_w == graph.after_w == 0


def test_generic_split_of_an_uncovered_module_keeps_its_graph():
    torch.manual_seed(0)
    stage = MiddleWithCustomParam()
    path = install_weight_grad_path(stage)
    held = measure_held_bytes(stage, torch.randn(2, 6, 16), path)
    assert held.ratio > 1.0, "the fallback retains the graph until W"
