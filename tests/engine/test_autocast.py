"""bf16 through torch autocast (DeepSpeed's ``torch_autocast`` section) with fp32 weights and a
plain optimizer: ReCycle's engine, with the W path and bf16 activations between stages, computes
bitwise what stock DeepSpeed computes under the same autocast for the model whose stages end
with a cast to bf16 (which is what ReCycle sends)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from ds_recycle.runtime.node.launcher import launch
from ds_recycle.runtime.node.preload import PRELOAD_MODULES
from ds_recycle.testing.tiny import ds_config

pytestmark = [pytest.mark.multiprocess, pytest.mark.beside]  # fault-free and bitwise: no timing

WORKER = Path(__file__).with_name("autocast_worker.py")
STEPS = 3
PP, DP, M = 2, 2, 4


def _config(recycle: dict | None) -> dict:
    config = ds_config(M, 0.0, recycle)
    config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    return config


RUNS = [
    {"name": "stock-sgd", "engine": "stock", "optimizer": "sgd", "config": _config(None), "cast_stage_outputs": True},
    {"name": "recycle-sgd", "engine": "recycle", "optimizer": "sgd", "config": _config({"enabled": True})},
    {"name": "stock-adam", "engine": "stock", "optimizer": "adam", "config": _config(None), "cast_stage_outputs": True},
    {"name": "recycle-adam", "engine": "recycle", "optimizer": "adam", "config": _config({"enabled": True})},
    {
        "name": "recycle-sgd-checkpointed",
        "engine": "recycle",
        "optimizer": "sgd",
        "config": _config({"enabled": True}),
        "checkpoint": 1,
    },
]


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> dict[str, list[dict]]:
    tmp = tmp_path_factory.mktemp("autocast")
    (tmp / "runs.json").write_text(json.dumps(RUNS))
    args = [str(WORKER), "--pp", str(PP), "--steps", str(STEPS), "--runs", str(tmp / "runs.json"), "--out"]
    results = launch(
        [*args, str(tmp / "out")],
        world_size=PP * DP,
        timeout=300,
        log_dir=tmp / "logs",
        membership=False,
        preload=PRELOAD_MODULES,
    )  # stock and ReCycle engines in one process: no coordinator
    failed = [r for r in results if not r.ok]
    if failed:
        sys.stderr.write(failed[0].log[-6000:])
        raise AssertionError(f"rank {failed[0].rank} failed; its log is above")
    return {
        run["name"]: [torch.load(tmp / "out" / run["name"] / f"rank{rank}.pt") for rank in range(PP * DP)]
        for run in RUNS
    }


def _assert_bitwise(expected: list[dict], actual: list[dict]) -> None:
    for want, got in zip(expected, actual, strict=True):
        assert got["losses"] == want["losses"], f"rank {got['rank']}: {got['losses']} != {want['losses']}"
        assert got["eval_loss"] == want["eval_loss"], f"rank {got['rank']}: eval loss differs"
        for name, value in want["params"].items():
            diff = (got["params"][name] - value).abs().max().item()
            assert torch.equal(got["params"][name], value), f"rank {got['rank']} {name}: max |diff| {diff:.3e}"


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_autocast_parity_with_stock(dumps, optimizer):
    stock, ours = dumps[f"stock-{optimizer}"], dumps[f"recycle-{optimizer}"]
    assert stock[0]["losses"][0] != stock[0]["losses"][-1], "training did not move the parameters"
    assert all(d["param_dtypes"] == ["torch.float32"] for d in ours), "weights stay fp32"
    assert all(d["deferred_linears"] > 0 for d in ours), "the W path covers the GPT's Linears"
    _assert_bitwise(stock, ours)


def test_autocast_with_activation_checkpointing(dumps):
    _assert_bitwise(dumps["stock-sgd"], dumps["recycle-sgd-checkpointed"])


def test_activations_travel_in_bf16(dumps):
    for dump in dumps["recycle-sgd"]:
        if dump["stage"] < PP - 1:
            assert dump["sent_dtypes"] == ["torch.bfloat16"], dump["sent_dtypes"]
        else:
            assert dump["sent_dtypes"] == ["torch.bfloat16"], "input gradients of a bf16 input are bf16"
