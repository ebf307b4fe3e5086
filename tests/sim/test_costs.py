"""Presets, custom models and the per-stage cost model."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from ds_recycle.sim.cost_model import head_layer_ratio, split_layers, stage_costs
from ds_recycle.sim.job import Job
from ds_recycle.sim.presets import PRESETS, SEQ_LEN, W_PATH_HELD_BYTES, ModelSpec, get_model, w_path_held_mib


def test_presets_cover_the_gpt3_family() -> None:
    for name in ("350M", "1.3B", "2.7B", "6.7B", "13B", "175B"):
        spec = get_model(name)
        assert spec.layers >= 24 and spec.F_ms > 0
    assert get_model("175B", tp=4).tp == 4


def test_layers_split_evenly_and_the_head_is_on_the_last_stage() -> None:
    assert split_layers(24, 5) == (5, 5, 5, 5, 4)
    spec = get_model("1.3B")
    c = stage_costs(spec, 4, 4).costs
    assert c.F[0] == pytest.approx(6 * spec.F_ms)
    assert c.F[3] == pytest.approx((6 + head_layer_ratio(spec)) * spec.F_ms)
    plain = stage_costs(spec, 4, 4, embeddings=False).costs
    assert plain.F[3] == pytest.approx(plain.F[0])


def test_memory_cap_falls_with_model_size_and_redundancy() -> None:
    small, big = stage_costs(get_model("1.3B"), 8, 4), stage_costs(get_model("13B"), 8, 4)
    assert small.memory_cap > big.memory_cap > 0
    assert stage_costs(get_model("13B"), 8, 4, redundancy=2.0).fused_memory_cap < big.fused_memory_cap
    with pytest.raises(ValueError, match="does not fit"):
        Job(get_model("175B"), 2, 4, 8)


def test_held_bytes_are_what_the_w_path_holds() -> None:
    """The presets' bytes held between B and W are the W path's, measured here on a GPT block
    under bf16 autocast (as bench/backward_split.py does): 32 B per token and hidden unit."""
    torch = pytest.importorskip("torch")
    from ds_recycle.engine.held_memory import measure_held_bytes
    from ds_recycle.engine.weight_grad import install_weight_grad_path
    from ds_recycle.models.gpt import Block

    torch.manual_seed(0)
    layers, batch, tokens, hidden = 2, 2, 32, 64
    stage = torch.nn.Sequential(*[Block(hidden, 2, 4) for _ in range(layers)])
    path = install_weight_grad_path(stage)
    held = measure_held_bytes(stage, torch.randn(batch, tokens, hidden), path, torch.bfloat16)
    assert held.between_b_and_w == W_PATH_HELD_BYTES * layers * batch * tokens * hidden
    for spec in PRESETS.values():
        assert spec.held_mib == w_path_held_mib(spec.hidden) == W_PATH_HELD_BYTES * SEQ_LEN * spec.hidden / 2**20
    assert get_model("1.3B").held_mib == 128.0


def test_memory_cap_counts_the_larger_of_activations_and_held_bytes() -> None:
    spec = get_model("6.7B")
    costs = stage_costs(spec, 8, 4)
    assert spec.held_mib < spec.act_mib and costs.memory_cap == costs.fused_memory_cap
    heavy = stage_costs(replace(spec, held_mib=2 * spec.act_mib), 8, 4)
    assert heavy.memory_cap < heavy.fused_memory_cap == costs.fused_memory_cap


def test_all_reduce_grows_with_pipelines() -> None:
    spec = get_model("1.3B")
    assert stage_costs(spec, 4, 1).costs.step < stage_costs(spec, 4, 2).costs.step < stage_costs(spec, 4, 8).costs.step


def test_custom_model_file(tmp_path) -> None:
    data = {k: v for k, v in vars(PRESETS["6.7B"]).items() if k not in ("name", "source")}
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(data))
    spec = get_model(str(path))
    assert spec.name == "mine" and spec.hidden == 4096


@pytest.mark.parametrize(
    "change",
    [{"F_ms": float("nan")}, {"F_ms": -1}, {"layers": "24"}, {"layers": 2.5}, {"hidden": True}, {"act_mib": math.inf}],
)
def test_bad_model_values_are_refused(change: dict) -> None:
    data = {**vars(PRESETS["1.3B"]), **change}
    with pytest.raises(ValueError, match="must be"):
        ModelSpec(**data)


def test_bad_model_files(tmp_path) -> None:
    for content in ("[1]", "{", '{"layers": 2}', '{"nope": 1}'):
        path = tmp_path / "bad.json"
        path.write_text(content)
        with pytest.raises(ValueError):
            get_model(str(path))
    with pytest.raises(ValueError, match="unknown model"):
        get_model("GPT-5")
