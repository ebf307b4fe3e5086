"""``causal_lm_pipeline``: logits and loss bit for bit those of ``AutoModelForCausalLM.from_config``
with the same weights (padded rows included), names mapped both ways, HF's init applied."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_configs import CONFIGS

HERE = Path(__file__).parent
pytestmark = [pytest.mark.multiprocess, pytest.mark.beside]  # fault-free and bitwise: no timing


@pytest.fixture(scope="module")
def parity(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("parity") / "parity.json"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(HERE / "parity_worker.py"), str(out)],
        env=env,
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_and_loss_bitwise_equal_to_hf(parity, name):
    result = parity[name]
    assert result["missing"] == (["lm_head.weight"] if result["tied"] else [])
    assert result["unexpected"] == []
    assert result["logits_equal"], f"max |diff| {result['max_abs_diff']}"
    assert result["loss_equal"]
    assert result["unpadded_equal"]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tie_names_init_follow_hf(parity, name):
    result = parity[name]
    assert result["tied"] == result["ref_tied"] == (name != "llama_untied")
    assert result["roundtrip"]
    assert result["deterministic"]
    # HF's _init_weights ran (torch's defaults would give nn.Embedding std 1, Linear ~1/sqrt(fan_in))
    for param, std in result["stds"].items():
        assert std < 2.5 * result["initializer_range"], (param, std)
    assert abs(result["loss"] - 4.605) < 0.1  # ln(vocab 100) at init


def _free_port() -> int:
    from ds_recycle.runtime.node.launcher import free_port

    return free_port()
