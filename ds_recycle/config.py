"""The ``recycle`` section of a DeepSpeed config, validated before anything starts.

Example::

    "recycle": {
        "enabled": true,
        "decoupled_backprop": true,
        "staggered_optimizer": true,
        "emulate_timing": {"F": 20, "B": 20, "W": 20}
    }

Every key is documented in docs/config.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

SECTION = "recycle"


class RecycleConfigError(ValueError):
    """A bad ``recycle`` section or a DeepSpeed setting that ReCycle cannot run with."""


@dataclass(frozen=True)
class TimingEmulation:
    """Pad every F, B and W to at least this many milliseconds, so that a few CPU cores can
    stand in for parallel devices in benchmarks. A fused backward is padded to ``B + W``."""

    F: float
    B: float
    W: float

    def seconds(self, kind: str) -> float:
        return {"F": self.F, "B": self.B, "W": self.W, "BW": self.B + self.W}[kind] / 1000.0


@dataclass(frozen=True)
class RecycleConfig:
    enabled: bool = False
    decoupled_backprop: bool = True
    staggered_optimizer: bool = True
    emulate_timing: TimingEmulation | None = None
    join_timeout: float = 600.0
    """Seconds a respawned process waits to be admitted into the running job."""
    detect_timeout: float = 30.0
    """Seconds a worker that saw a comm error waits for the launcher to name the failed worker."""

    @classmethod
    def from_ds_config(cls, ds_config: Mapping[str, Any]) -> RecycleConfig:
        """Read and validate the ``recycle`` section and the DeepSpeed settings it depends on."""
        if not isinstance(ds_config, Mapping):
            raise RecycleConfigError(f"the DeepSpeed config must be an object (a dict), got {type(ds_config).__name__}")
        if SECTION not in ds_config:
            return cls(enabled=False)
        section = ds_config[SECTION]
        if not isinstance(section, Mapping):
            raise RecycleConfigError(f"'{SECTION}' must be an object (a dict of keys), got {type(section).__name__}")
        config = cls.from_section(section)
        if config.enabled:
            _check_deepspeed_compatibility(ds_config)
        return config

    @classmethod
    def from_section(cls, section: Mapping[str, Any]) -> RecycleConfig:
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(section) - set(allowed), key=str)
        if unknown:
            raise RecycleConfigError(f"unknown key {SECTION}.{unknown[0]}; allowed keys: {', '.join(allowed)}")
        values = {
            name: _boolean(section, name, default=(name == "enabled") or getattr(cls, name))
            for name in ("enabled", "decoupled_backprop", "staggered_optimizer")
        }
        return cls(
            **values,
            emulate_timing=_timing(section.get("emulate_timing")),
            join_timeout=_seconds(section, "join_timeout", cls.join_timeout),
            detect_timeout=_seconds(section, "detect_timeout", cls.detect_timeout),
        )


def _boolean(section: Mapping[str, Any], name: str, default: bool) -> bool:
    value = section.get(name, default)
    if not isinstance(value, bool):
        raise RecycleConfigError(f"{SECTION}.{name} must be true or false, got {value!r}")
    return value


def _seconds(section: Mapping[str, Any], name: str, default: float) -> float:
    value = section.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 86_400:
        raise RecycleConfigError(f"{SECTION}.{name} must be a number of seconds in (0, 86400], got {value!r}")
    return float(value)


def _timing(value: Any) -> TimingEmulation | None:
    key = f"{SECTION}.emulate_timing"
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise RecycleConfigError(f"{key} must be null or an object with keys F, B, W (milliseconds), got {value!r}")
    allowed = ("F", "B", "W")
    unknown = sorted(set(value) - set(allowed), key=str)
    if unknown:
        raise RecycleConfigError(f"unknown key {key}.{unknown[0]}; allowed keys: F, B, W")
    missing = [k for k in allowed if k not in value]
    if missing:
        raise RecycleConfigError(f"{key}.{missing[0]} is missing; F, B and W (milliseconds) are all required")
    for k in allowed:
        v = value[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 60_000:
            raise RecycleConfigError(f"{key}.{k} must be a number of milliseconds in [0, 60000], got {v!r}")
    return TimingEmulation(float(value["F"]), float(value["B"]), float(value["W"]))


def _check_deepspeed_compatibility(ds_config: Mapping[str, Any]) -> None:
    """ReCycle keeps every DP replica's full optimizer state (a dead rank must not take a shard
    with it) and runs fp32 math; reject settings that break either."""
    for precision in ("fp16", "bf16", "bfloat16"):
        section = ds_config.get(precision)
        if isinstance(section, Mapping) and section.get("enabled", False):
            raise RecycleConfigError(
                f"'{precision}.enabled' is not supported with recycle: DeepSpeed's {precision} optimizers shard or "
                "rescale state across ranks. Allowed: fp32 (leave fp16/bf16 disabled), or torch autocast with a "
                "plain optimizer"
            )
    zero = ds_config.get("zero_optimization")
    stage = zero.get("stage", 0) if isinstance(zero, Mapping) else 0
    if stage != 0:
        raise RecycleConfigError(
            f"'zero_optimization.stage' = {stage!r} is not supported with recycle: ZeRO shards optimizer state "
            "across data-parallel ranks, so a dead rank loses its shard. Allowed: 0"
        )
