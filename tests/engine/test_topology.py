"""ReCycle on DeepSpeed's other rank numbering: with a pipeline-major ``ProcessTopology`` (axes
``data``, ``pipe``: a node holds whole pipelines) the engine trains bitwise like stock DeepSpeed
with the same topology (examples/train_gpt.py both ways, 2 stages x 2 pipelines). Clipping is off:
a clip that triggers is applied by undoing the optimistic step in place and stepping again, a few
ulps from stock (tests/engine/test_multiprocess.py checks that case with a tolerance)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ds_recycle.runtime.node.launcher import launch
from ds_recycle.runtime.node.preload import PRELOAD_MODULES
from ds_recycle.testing.tiny import TINY_GPT, ds_config

pytestmark = [pytest.mark.multiprocess, pytest.mark.beside]  # fault-free and bitwise: no timing

ROOT = Path(__file__).resolve().parents[2]


def train(tmp_path: Path, name: str, *extra: str) -> dict[int, dict]:
    config = tmp_path / f"{name}.json"
    config.write_text(json.dumps(ds_config(4, 0.0, {"enabled": name != "stock"})))
    argv = [str(ROOT / "examples" / "train_gpt.py"), "--deepspeed_config", str(config), "--steps", "6"]
    argv += [*TINY_GPT.script_args(), "--optimizer", "adam", "--lr", "0.01"]
    argv += ["--pipeline-major", "--dump", str(tmp_path / name), *extra]
    results = launch(argv, world_size=4, timeout=240, log_dir=tmp_path / f"{name}_logs", preload=PRELOAD_MODULES)
    assert all(r.ok for r in results), [r.log[-3000:] for r in results if not r.ok]
    return {rank: torch.load(tmp_path / name / f"rank{rank}.pt", weights_only=False) for rank in range(4)}


def test_pipeline_major_topology_trains_bitwise_like_stock(tmp_path):
    ours, stock = train(tmp_path, "recycle"), train(tmp_path, "stock", "--stock")
    for rank in range(4):
        # rank = pipeline * P + stage: rank 1 is stage 1 of pipeline 0
        assert (ours[rank]["pipeline"], ours[rank]["stage"]) == (rank // 2, rank % 2)
        assert ours[rank]["losses"] == stock[rank]["losses"]
        for name, value in stock[rank]["params"].items():
            assert torch.equal(ours[rank]["params"][name], value), f"rank {rank} {name}"
