"""The W path and the memory governor on a CUDA device (issue 41); skipped without one.

On two pre-LN GPT blocks (d = 256, head dimension 128, 2 x 128 tokens):

- BackwardInput then BackwardWeight (the W path the engine installs) give the gradients of a fused
  backward: every parameter's and the input's, in fp32 within 1e-5 of the largest magnitude of
  each gradient (IEEE fp32 matmuls: TF32 off), and under bf16 autocast within 1e-2 (bf16 keeps 8
  significant bits, about 4e-3 per rounding; the W path sums in the same dtype and order as a
  fused backward, which makes it bitwise on CPU, but cuBLAS may pick another kernel for the
  deferred GEMM);
- what a micro-batch holds between B and W is counted (ds_recycle.engine.held_memory): 16 values
  per token and hidden unit per layer, and the CUDA allocator holds those bytes;
- the memory governor's figures on CUDA are sane: its limit is at most the device's memory, its
  static bytes at least the parameters, gradients and Adam state, and one micro-batch fits.

scripts/gpu_bench.sh runs them on a GPU (well under 20 s).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ds_recycle.engine.backward_split import backward_input, backward_weight
from ds_recycle.engine.held_memory import measure_held_bytes
from ds_recycle.engine.memory_cap import BudgetRow, budget_from_table, device_budget
from ds_recycle.engine.memory_governor import MemoryGovernor
from ds_recycle.engine.weight_grad import install_weight_grad_path
from ds_recycle.models.gpt import Block

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA device (none here; scripts/gpu_bench.sh runs these on a GPU)",
    ),
]

D, HEADS, LAYERS, SEQ, BATCH = 256, 2, 2, 128, 2
FP32_TOLERANCE = 1e-5
BF16_TOLERANCE = 1e-2
HELD_VALUES_PER_TOKEN = 16
"""Per hidden unit and layer, held between B and W: the inputs of the four Linears (d, d, d, 4d)
and their output gradients (3d, d, 4d, d)."""
SLACK = 2**20
"""Bytes of small buffers the allocator may hold beside the counted ones."""
DEVICE = "cuda"


@pytest.fixture(autouse=True)
def ieee_fp32():
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


def gpt_stage() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(D, HEADS, 4) for _ in range(LAYERS)]).to(DEVICE)


def stage_input() -> torch.Tensor:
    return torch.randn(BATCH, SEQ, D, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(1))


def autocast(dtype: torch.dtype | None):
    return torch.autocast(DEVICE, dtype=dtype or torch.float32, enabled=dtype is not None)


def fused_backward(module: nn.Module, x0: torch.Tensor, grad: torch.Tensor, dtype: torch.dtype | None):
    x = x0.clone().requires_grad_()
    with autocast(dtype):
        out = module(x)
    out.backward(grad)
    return x.grad, {name: p.grad for name, p in module.named_parameters()}


def split_backward(module: nn.Module, x0: torch.Tensor, grad: torch.Tensor, dtype: torch.dtype | None):
    path = install_weight_grad_path(module)
    x = x0.clone().requires_grad_()
    with autocast(dtype):
        out = module(x)
    (input_grad,), work = backward_input([out], [grad], [x], list(module.parameters()), path=path)
    del out
    assert work.gemms, "B deferred no weight GEMM"
    assert all(layer.weight.grad is None for layer in path.linears), "a Linear's weight gradient came in B"
    backward_weight(work)
    return path, input_grad, {name: p.grad for name, p in module.named_parameters()}


def assert_close(actual: torch.Tensor | None, expected: torch.Tensor | None, tolerance: float, what: str) -> None:
    assert actual is not None and expected is not None, f"{what}: a gradient is missing"
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    scale = expected.abs().max().item()
    diff = (actual - expected).abs().max().item()
    assert diff <= tolerance * max(scale, 1e-30), f"{what}: max |diff| {diff:.3e} > {tolerance} x {scale:.3e}"


@pytest.mark.parametrize(
    ("dtype", "tolerance"), [(None, FP32_TOLERANCE), (torch.bfloat16, BF16_TOLERANCE)], ids=["fp32", "bf16-autocast"]
)
def test_w_path_gives_the_gradients_of_a_fused_backward(dtype, tolerance):
    fused = gpt_stage()
    split = copy.deepcopy(fused)
    x0 = stage_input()
    grad = torch.randn(BATCH, SEQ, D, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(2))
    want_input, want = fused_backward(fused, x0, grad, dtype)
    path, got_input, got = split_backward(split, x0, grad, dtype)
    assert len(path.linears) == 4 * LAYERS and not path.fallback, path.describe()
    assert_close(got_input, want_input, tolerance, "input gradient")
    assert want.keys() == got.keys()
    for name in want:
        assert_close(got[name], want[name], tolerance, name)


def test_held_memory_is_counted_and_allocated():
    module = gpt_stage()
    path = install_weight_grad_path(module)
    x0 = stage_input()
    held = measure_held_bytes(module, x0, path)  # also the warm-up: cuBLAS workspaces are allocated here
    expected = LAYERS * BATCH * SEQ * HELD_VALUES_PER_TOKEN * D * 4
    assert held.between_b_and_w == expected, (held, expected)
    assert held.after_w == 0 and 0 < held.between_b_and_w  # against after_forward: bench/backward_split.py

    params = list(module.parameters())
    for p in params:  # as the engine holds them: allocated once, accumulated in place
        p.grad = torch.zeros_like(p)
    x = x0.clone().requires_grad_()
    grad = torch.randn(BATCH, SEQ, D, device=DEVICE)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    out = module(x)
    after_forward = torch.cuda.memory_allocated() - base
    input_grads, work = backward_input([out], [grad], [x], params, path=path)
    del out, input_grads  # the engine sends the input gradient and drops the outputs
    torch.cuda.synchronize()
    between = torch.cuda.memory_allocated() - base
    backward_weight(work)
    # The count reaches every tensor the micro-batch keeps; the stage input (allocated before
    # `base`, saved by the first LayerNorm) is the only counted storage the allocator's delta lacks.
    assert held.after_forward <= after_forward + x.numel() * 4 + SLACK, (held, after_forward)
    assert expected <= between <= 1.1 * expected + SLACK, (between, expected)


def test_memory_governor_figures_on_cuda_are_sane():
    module = gpt_stage()
    path = install_weight_grad_path(module)
    params = list(module.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    device = torch.device(DEVICE, torch.cuda.current_device())
    governor = MemoryGovernor(None, module, device)
    assert governor.enabled and governor.meter is not None, "the governor runs on CUDA without a limit"

    # One training micro-batch as the engine runs it, the meter following it.
    x = stage_input().requires_grad_()
    buffers = {"inputs": x}
    probe: list[torch.Tensor] = []
    path.probe = probe
    buffers["outputs"] = module(x)
    path.probe = None
    meter = governor.meter
    meter.after_forward(0, [buffers["outputs"].grad_fn], probe, lambda: list(buffers.values()))
    grad = torch.randn_like(buffers["outputs"])
    _, work = backward_input([buffers["outputs"]], [grad], [x], params, path=path)
    del buffers["outputs"]
    meter.after_backward_input(0, work)
    backward_weight(work)
    meter.after_backward_weight(0)
    optimizer.step()

    row = BudgetRow(*governor.row(module, optimizer))
    _, total = torch.cuda.mem_get_info(device)
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    assert row.measured == 1.0 and row.per_microbatch > 0, row
    assert 0 < row.limit <= total, (row.limit, total)
    assert 0 < device_budget(device) <= total
    assert row.static >= 4 * param_bytes, (row.static, param_bytes)  # parameters, gradients, Adam m and v
    budget = budget_from_table([row.values()], pipelines=1, stages=1)
    assert budget is not None and budget.stages[0].cap >= 1, budget
