"""Fault-free parity with stock DeepSpeed on CUDA: ReCycle's engine and DeepSpeed's ``PipelineEngine``
trained on NCCL from the same seed and data, bitwise (fp32, the same reduction order).

Four ranks share the GPUs present (one GPU: four NCCL ranks on it, each with a host of its own,
``ds_recycle.runtime.rank.communication``). Skipped where torch sees no CUDA device (CI);
``scripts/gpu_check.sh`` runs it on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from harness import assert_bitwise_equal, run_ranks

from ds_recycle.testing.tiny import ds_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device (none here); scripts/gpu_check.sh runs it on a GPU"
    ),
]

STEPS = 5


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    m = 4
    runs = [
        {"name": f"{engine}-{opt}", "engine": engine, "optimizer": opt, "config": ds_config(m, 0.0, recycle)}
        for opt in ("sgd", "adam")
        for engine, recycle in (("stock", None), ("recycle", {"enabled": True}))
    ]
    return run_ranks(tmp_path_factory.mktemp("gpu_pp2dp2"), 2, 2, runs, steps=STEPS, timeout=240, backend="nccl")


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_parity_with_stock_deepspeed_on_cuda(dumps, optimizer):
    stock, ours = dumps[f"stock-{optimizer}"], dumps[f"recycle-{optimizer}"]
    assert all(d["engine"] == "RecyclePipelineEngine" for d in ours)
    assert all(d["engine"] == "PipelineEngine" for d in stock)
    assert stock[0]["losses"][0] != stock[0]["losses"][-1], "training did not move the parameters"
    assert_bitwise_equal(stock, ours)
