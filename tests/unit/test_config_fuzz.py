"""Property-based fuzzing of the ``recycle`` config section (issue 11).

Any value at all, for any key (the known ones, new ones added to RecycleConfig later, unknown
ones), gives either a RecycleConfig whose every field has its declared type and a finite value, or
a one-line RecycleConfigError that names the key. Through ``ds_recycle.initialize`` a bad section
fails before any process group is created.
"""

from __future__ import annotations

import json
import math
import typing
from dataclasses import fields
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds_recycle.config import SECTION, RecycleConfig, RecycleConfigError, TimingEmulation

FIELDS = [f.name for f in fields(RecycleConfig)]
HINTS = typing.get_type_hints(RecycleConfig)

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**30), 10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from([0, 1, -1, 0.0, 1e-300, 86_400, 86_401, 60_000, 60_001, "true", "false", "1", ""]),
)
ANY = st.recursive(
    SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.one_of(st.text(max_size=6), st.integers()), children, max_size=4),
    ),
    max_leaves=12,
)
KEYS = st.one_of(st.sampled_from(FIELDS), st.text(max_size=12), st.integers(-3, 3))


@st.composite
def timing_values(draw):
    """Mostly near-valid emulate_timing objects, so the per-key checks are reached."""
    keys = draw(st.lists(st.sampled_from(["F", "B", "W", "S", "f", 1]), max_size=5, unique=True))
    return {k: draw(st.one_of(SCALARS, st.floats(0, 60_000))) for k in keys}


@st.composite
def sections(draw) -> dict:
    keys = draw(st.lists(KEYS, max_size=len(FIELDS) + 2, unique=True))
    section = {}
    for key in keys:
        if key == "emulate_timing":
            section[key] = draw(st.one_of(timing_values(), ANY))
        else:
            section[key] = draw(ANY)
    return section


@st.composite
def ds_configs(draw) -> object:
    kind = draw(st.sampled_from(["section", "section", "section", "any_section", "not_a_dict"]))
    if kind == "not_a_dict":
        return draw(st.one_of(st.lists(SCALARS, max_size=3), SCALARS, st.just([SECTION])))
    config: dict = {"train_batch_size": 4, SECTION: draw(sections()) if kind == "section" else draw(ANY)}
    for name in ("fp16", "bf16", "bfloat16", "zero_optimization"):
        if draw(st.integers(0, 4)) == 0:
            config[name] = draw(st.one_of(ANY, st.fixed_dictionaries({"enabled": ANY, "stage": ANY})))
    return config


def _value_ok(name: str, value: object) -> bool:
    hint = HINTS[name]
    if hint is bool:
        return isinstance(value, bool)
    if hint is float:
        return isinstance(value, float) and math.isfinite(value)
    if name == "emulate_timing":
        return value is None or (
            isinstance(value, TimingEmulation)
            and all(isinstance(v, float) and math.isfinite(v) and v >= 0 for v in (value.F, value.B, value.W))
        )
    return True  # a new key of another type: the type check is the lead's to add


GUIDANCE = ("must", "allowed", "missing", "not supported", "needs")


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
@given(ds_config=ds_configs())
def test_any_section_gives_a_valid_config_or_one_clear_error(ds_config: object) -> None:
    try:
        config = RecycleConfig.from_ds_config(ds_config)  # type: ignore[arg-type]
    except RecycleConfigError as exc:
        message = str(exc)
        assert "\n" not in message and message, message
        assert any(word in message for word in GUIDANCE), message
        return
    assert isinstance(config, RecycleConfig)
    for name in FIELDS:
        assert _value_ok(name, getattr(config, name)), (name, getattr(config, name), ds_config)


@st.composite
def valid_sections(draw) -> dict:
    section: dict = {}
    for name in ("enabled", "decoupled_backprop", "staggered_optimizer", "prefetch_plans"):
        if draw(st.booleans()):
            section[name] = draw(st.booleans())
    for name in ("join_timeout", "detect_timeout"):
        if name in FIELDS and draw(st.booleans()):
            section[name] = draw(st.one_of(st.integers(1, 86_400), st.floats(1e-3, 86_400)))
    if draw(st.booleans()):
        section["emulate_timing"] = {k: draw(st.floats(0, 60_000)) for k in "FBW"}
    return section


@settings(max_examples=300, deadline=None, database=None)
@given(section=valid_sections())
def test_valid_sections_round_trip(section: dict) -> None:
    config = RecycleConfig.from_ds_config({SECTION: section})
    for name, value in section.items():
        if name == "emulate_timing":
            assert config.emulate_timing == TimingEmulation(*(float(value[k]) for k in "FBW"))
        else:
            assert getattr(config, name) == value


@pytest.mark.parametrize(
    ("ds_config", "message"),
    [
        ({SECTION: {1: True, "x": 2}}, "unknown key recycle.1"),  # mixed key types: was a TypeError from sorted()
        ({SECTION: {"emulate_timing": {1: 1, "F": 1}}}, "unknown key recycle.emulate_timing.1"),
        (None, "the DeepSpeed config must be an object"),  # was a TypeError
        ([SECTION], "the DeepSpeed config must be an object"),  # was a TypeError
        ({SECTION: {"join_timeout": float("nan")}}, "recycle.join_timeout must be a number of seconds"),
        ({SECTION: {"join_timeout": float("inf")}}, "recycle.join_timeout must be a number of seconds"),
        ({SECTION: {"emulate_timing": {"F": float("nan"), "B": 1, "W": 1}}}, "recycle.emulate_timing.F"),
        ({SECTION: {}, "zero_optimization": {"stage": "0"}}, "'zero_optimization.stage' = '0' is not supported"),
    ],
)
def test_fuzz_findings(ds_config: object, message: str) -> None:
    with pytest.raises(RecycleConfigError) as err:
        RecycleConfig.from_ds_config(ds_config)  # type: ignore[arg-type]
    assert message in str(err.value)


# ----- through ds_recycle.initialize ------------------------------------------------------------


@st.composite
def bad_ds_configs(draw) -> dict:
    """A config whose recycle section is rejected (checked with the parser itself)."""
    config = draw(ds_configs().filter(lambda c: isinstance(c, dict)))
    try:
        RecycleConfig.from_ds_config(config)
    except RecycleConfigError:
        return config
    config[SECTION] = {"enabled": True, "bogus_key": draw(ANY)}
    return config


def _str_keys(value: object) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and _str_keys(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_str_keys(v) for v in value)
    return True


class _NoGroups:
    """Records any attempt to create a process group or to start DeepSpeed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import deepspeed
        import deepspeed.comm as ds_comm
        import torch.distributed as torch_dist

        self.calls: list[str] = []
        for module, name in (
            (ds_comm, "init_distributed"),
            (deepspeed, "init_distributed"),
            (deepspeed, "initialize"),
            (torch_dist, "init_process_group"),
        ):
            monkeypatch.setattr(module, name, self._record(f"{module.__name__}.{name}"))

    def _record(self, name: str):
        def record(*args, **kwargs):
            self.calls.append(name)
            raise AssertionError(f"{name} called for a bad config")

        return record


def test_initialize_rejects_every_bad_section_before_any_process_group(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import torch
    import torch.distributed as torch_dist

    import ds_recycle

    guard = _NoGroups(monkeypatch)
    models = [None, torch.nn.Linear(2, 2)]

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(config=bad_ds_configs(), model=st.sampled_from(models), as_file=st.booleans())
    def check(config: dict, model, as_file: bool) -> None:
        source: object = config
        if as_file and _str_keys(config):  # JSON would turn int keys into (possibly duplicate) strings
            path = tmp_path / "ds_config.json"
            path.write_text(json.dumps(config))
            source = str(path)
        with pytest.raises(RecycleConfigError):
            ds_recycle.initialize(model=model, config=source)
        assert guard.calls == [] and not torch_dist.is_initialized()

    check()


def test_a_config_file_that_is_not_json_or_does_not_exist_is_refused_by_name(tmp_path: Path) -> None:
    """json.dumps writes inf as Infinity, which is not JSON: DeepSpeed's loader raised hjson's
    decode error (found by the fuzz test above)."""
    import torch.distributed as torch_dist

    import ds_recycle

    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_batch_size": 4, "recycle": {"enabled": True, "join_timeout": float("inf")}}))
    with pytest.raises(RecycleConfigError, match=f"config file {path} is not valid JSON"):
        ds_recycle.initialize(model=None, config=str(path))
    missing = tmp_path / "missing.json"
    with pytest.raises(RecycleConfigError, match="a dict, the path of an existing JSON file or base64"):
        ds_recycle.initialize(model=None, config=str(missing))
    assert not torch_dist.is_initialized()
