"""The ``recycle`` section of a DeepSpeed config, validated before anything starts.

Example::

    "recycle": {
        "enabled": true,
        "decoupled_backprop": true,
        "staggered_optimizer": true,
        "emulate_timing": {"F": 20, "B": 20, "W": 20},
        "profile": {"warmup": 2, "drift": 0.1},
        "stragglers": {"enabled": true, "threshold": 1.3},
        "monitor": {"wandb": {"project": "ds-recycle"}}
    }

Every key is documented in docs/config.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

SECTION = "recycle"
MONITOR_MODES = ("auto", "online", "offline", "disabled")
PLANNER_COSTS = ("emulated", "unit")
MAX_MEMORY_LIMIT_GB = 1_048_576


class RecycleConfigError(ValueError):
    """A bad ``recycle`` section or a DeepSpeed setting that ReCycle cannot run with."""


Durations = float | tuple[float, ...]
"""Milliseconds: one number for every stage, or one per stage."""


@dataclass(frozen=True)
class TimingEmulation:
    """Pad every F, B and W to at least this many milliseconds, so that a few CPU cores can
    stand in for parallel devices in benchmarks. A fused backward is padded to ``B + W``. Each of
    F, B, W is one number or one number per stage. ``slowdown`` emulates stragglers: every F, B,
    W of worker ``(pipeline, stage)`` is padded to ``factor`` times its duration."""

    F: Durations
    B: Durations
    W: Durations
    slowdown: tuple[tuple[int, int, float], ...] = ()
    planner_costs: str = "emulated"
    """What the planner is told before a profile is measured: the emulated durations, or ``unit``
    costs (to compare plans from unit costs with plans from measured ones)."""

    def milliseconds(self, kind: str, stage: int = 0) -> float:
        """The emulated duration of ``kind`` (F, B, W, or BW for a fused backward) at ``stage``."""
        if kind == "BW":
            return self.milliseconds("B", stage) + self.milliseconds("W", stage)
        value = {"F": self.F, "B": self.B, "W": self.W}[kind]
        return value[stage] if isinstance(value, tuple) else value

    def seconds(self, kind: str, stage: int = 0) -> float:
        return self.milliseconds(kind, stage) / 1000.0

    def factor(self, pipeline: int, stage: int) -> float:
        """How many times its emulated (or, with none, its real) duration an op of this worker lasts."""
        for p, s, f in self.slowdown:
            if (p, s) == (pipeline, stage):
                return f
        return 1.0

    @property
    def stages(self) -> int | None:
        """The stage count the per-stage lists name (None: every value is one number)."""
        lengths = {len(v) for v in (self.F, self.B, self.W) if isinstance(v, tuple)}
        return lengths.pop() if lengths else None

    def check_topology(self, pipelines: int, stages: int) -> None:
        """Raise RecycleConfigError unless the lists and slowdowns fit a ``pipelines x stages`` job."""
        key = f"{SECTION}.emulate_timing"
        for kind in "FBW":
            value = getattr(self, kind)
            if isinstance(value, tuple) and len(value) != stages:
                raise RecycleConfigError(
                    f"{key}.{kind} has {len(value)} values but the pipeline has {stages} stages; allowed: one "
                    f"number, or a list of {stages} numbers (milliseconds, one per stage)"
                )
        for p, s, _f in self.slowdown:
            if not (0 <= p < pipelines and 0 <= s < stages):
                raise RecycleConfigError(
                    f"{key}.slowdown names worker (pipeline {p}, stage {s}), outside the job's {pipelines} "
                    f"pipelines x {stages} stages; allowed: pipeline in [0, {pipelines - 1}], "
                    f"stage in [0, {stages - 1}]"
                )


@dataclass(frozen=True)
class ProfileConfig:
    """``recycle.profile``: measured per-stage costs for the planner (docs/config.md)."""

    enabled: bool = True
    warmup: int = 2
    """Iterations not measured at the start (and after this rank joins)."""
    window: int = 4
    """The medians are taken over the ops of this many last completed iterations."""
    interval: int = 1
    """Every this many iterations the replicas agree on the measured costs."""
    drift: float = 0.1
    """Re-plan when a stage's agreed F, B or W differs from the plan's by more than this fraction (of the
    larger of that value and a tenth of the stage's F + B + W)."""


@dataclass(frozen=True)
class StragglerConfig:
    """``recycle.stragglers``: route part of a slow worker's micro-batches to its stage's peers."""

    enabled: bool = True
    threshold: float = 1.3
    """A worker whose ops take this many times its stage peers' is a straggler."""
    patience: int = 2
    """Consecutive agreements above the threshold before it is planned as one (and below the release
    level, ``1 + (threshold - 1) / 2``, before it is released)."""


@dataclass(frozen=True)
class WandbMonitorConfig:
    """``recycle.monitor.wandb``: the W&B run that ds_recycle.integrations.wandb writes."""

    enabled: bool = True
    project: str = "ds-recycle"
    group: str | None = None
    team: str | None = None
    """The W&B entity (DeepSpeed's name for it)."""
    name: str | None = None
    mode: str = "auto"
    """``auto``: ``WANDB_MODE`` if set, else online with an API key and offline without one."""
    dir: str | None = None
    run_id: str | None = None
    """Default: ``WANDB_RUN_ID``, else one id per ``ds-recycle launch`` job (every writer resumes it)."""
    tags: tuple[str, ...] = ()
    init_timeout: float = 60.0
    """Seconds ``wandb.init`` may take before the monitor falls back to offline (or turns itself off)."""


@dataclass(frozen=True)
class MonitorConfig:
    """``recycle.monitor``: what the lowest live rank reports about membership and iterations."""

    wandb: WandbMonitorConfig | None = None
    """None: no W&B monitor."""
    log_every: int = 1
    """Log an iteration row every this many iterations (membership changes are always logged)."""
    events_table: bool = True
    """Log the ``recycle/events`` table (one row per failed, left or joined worker)."""


@dataclass(frozen=True)
class CheckpointConfig:
    """``recycle.checkpoint``: DeepSpeed checkpoints every ``interval`` iterations in ``dir``; a job
    whose stage lost every worker restarts every rank from the latest (``ds-recycle launch --respawn``)."""

    dir: str
    interval: int


@dataclass(frozen=True)
class RecycleConfig:
    enabled: bool = False
    decoupled_backprop: bool = True
    staggered_optimizer: bool = True
    prefetch_plans: bool = True
    """Plan every next single-worker (and single-node) failure in a background thread."""
    emulate_timing: TimingEmulation | None = None
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    stragglers: StragglerConfig = field(default_factory=StragglerConfig)
    join_timeout: float = 600.0
    """Seconds a respawned process waits to be admitted into the running job."""
    detect_timeout: float = 30.0
    """Seconds a worker that saw a comm error waits for the launcher to name the failed worker."""
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    checkpoint: CheckpointConfig | None = None
    """None: no periodic checkpoint; a job that loses a whole stage stops."""
    memory_limit_gb: float | None = None
    """Memory budget per worker in GiB (2^30 bytes); None: the device's memory on a GPU, no cap
    beyond the planner's default on CPU (ds_recycle.engine.memory_cap)."""

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
            raise RecycleConfigError(f"unknown key {SECTION}.{_key(unknown[0])}; allowed keys: {', '.join(allowed)}")
        values = {
            name: _boolean(section, name, default=(name == "enabled") or getattr(cls, name))
            for name in ("enabled", "decoupled_backprop", "staggered_optimizer", "prefetch_plans")
        }
        return cls(
            **values,
            emulate_timing=_timing(section.get("emulate_timing")),
            profile=_profile(section.get("profile")),
            stragglers=_stragglers(section.get("stragglers")),
            join_timeout=_seconds(section, "join_timeout", cls.join_timeout),
            detect_timeout=_seconds(section, "detect_timeout", cls.detect_timeout),
            monitor=monitor_config(section.get("monitor")),
            checkpoint=_checkpoint(section.get("checkpoint")),
            memory_limit_gb=_memory_limit(section.get("memory_limit_gb")),
        )


def _checkpoint(value: Any) -> CheckpointConfig | None:
    key = f"{SECTION}.checkpoint"
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise RecycleConfigError(f"{key} must be null or an object with keys dir, interval, got {value!r}")
    _no_unknown(value, key, ["dir", "interval"])
    directory, interval = value.get("dir"), value.get("interval")
    if not isinstance(directory, str) or not directory.strip() or "\x00" in directory:
        raise RecycleConfigError(f"{key}.dir must be a non-empty directory path, got {directory!r}")
    if isinstance(interval, bool) or not isinstance(interval, int) or not 1 <= interval <= 10**9:
        raise RecycleConfigError(f"{key}.interval must be an integer number of iterations >= 1, got {interval!r}")
    return CheckpointConfig(directory, interval)


def _memory_limit(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_MEMORY_LIMIT_GB:
        raise RecycleConfigError(
            f"{SECTION}.memory_limit_gb must be a number of GiB in (0, {MAX_MEMORY_LIMIT_GB}] (memory per worker, "
            f"e.g. 70 or 0.5), or absent (on a GPU: the device's memory); got {value!r}"
        )
    return float(value)


def _boolean(section: Mapping[str, Any], name: str, default: bool, key: str = SECTION) -> bool:
    value = section.get(name, default)
    if not isinstance(value, bool):
        raise RecycleConfigError(f"{key}.{name} must be true or false, got {value!r}")
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
    allowed = ("F", "B", "W", "slowdown", "planner_costs")
    unknown = sorted(set(value) - set(allowed), key=str)
    if unknown:
        raise RecycleConfigError(f"unknown key {key}.{_key(unknown[0])}; allowed keys: {', '.join(allowed)}")
    planner_costs = value.get("planner_costs", "emulated")
    if planner_costs not in PLANNER_COSTS:
        raise RecycleConfigError(
            f"{key}.planner_costs must be one of {', '.join(PLANNER_COSTS)}; got {planner_costs!r}"
        )
    missing = [k for k in "FBW" if k not in value]
    if missing:
        raise RecycleConfigError(f"{key}.{missing[0]} is missing; F, B and W (milliseconds) are all required")
    durations: dict[str, Durations] = {}
    lengths = set()
    for k in "FBW":
        v = value[k]
        if isinstance(v, list) and v and all(_milliseconds(x) for x in v):
            durations[k] = tuple(float(x) for x in v)
            lengths.add(len(v))
        elif _milliseconds(v):
            durations[k] = float(v)
        else:
            raise RecycleConfigError(
                f"{key}.{k} must be a number of milliseconds in [0, 60000] or a non-empty list of them (one per "
                f"stage), got {v!r}"
            )
    if len(lengths) > 1:
        raise RecycleConfigError(
            f"{key}.F, B and W lists must have one length (one value per stage), got {sorted(lengths)}"
        )
    slowdown = _slowdown(value.get("slowdown", []), f"{key}.slowdown")
    return TimingEmulation(**durations, slowdown=slowdown, planner_costs=planner_costs)


def _milliseconds(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 <= value <= 60_000


def _slowdown(value: Any, key: str) -> tuple[tuple[int, int, float], ...]:
    shape = "a list of [pipeline, stage, factor] (integers >= 0, factor a number in [1, 100])"
    if not isinstance(value, list):
        raise RecycleConfigError(f"{key} must be {shape}, got {value!r}")
    entries: list[tuple[int, int, float]] = []
    for entry in value:
        ok = isinstance(entry, list) and len(entry) == 3
        ok = ok and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1_000_000 for x in entry[:2])
        ok = ok and not isinstance(entry[2], bool) and isinstance(entry[2], (int, float)) and 1 <= entry[2] <= 100
        if not ok:
            raise RecycleConfigError(f"{key} must be {shape}; bad entry {entry!r}")
        if any((p, s) == tuple(entry[:2]) for p, s, _f in entries):
            raise RecycleConfigError(f"{key} names worker {entry[:2]} twice; allowed: one entry per worker")
        entries.append((entry[0], entry[1], float(entry[2])))
    return tuple(sorted(entries))


def _profile(value: Any) -> ProfileConfig:
    key = f"{SECTION}.profile"
    if value is None:
        return ProfileConfig()
    if isinstance(value, bool):
        return ProfileConfig(enabled=value)
    if not isinstance(value, Mapping):
        raise RecycleConfigError(
            f"{key} must be true, false or an object with keys enabled, warmup, window, interval, drift; got {value!r}"
        )
    _no_unknown(value, key, [f.name for f in fields(ProfileConfig)])
    counts = {}
    for name, low in (("warmup", 0), ("window", 1), ("interval", 1)):
        v = value.get(name, getattr(ProfileConfig, name))
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= 1_000_000:
            raise RecycleConfigError(
                f"{key}.{name} must be an integer number of iterations in [{low}, 1000000], got {v!r}"
            )
        counts[name] = v
    drift = value.get("drift", ProfileConfig.drift)
    if isinstance(drift, bool) or not isinstance(drift, (int, float)) or not 0 < drift <= 10:
        raise RecycleConfigError(f"{key}.drift must be a fraction in (0, 10] (0.1 = 10%), got {drift!r}")
    return ProfileConfig(_boolean(value, "enabled", True, key), drift=float(drift), **counts)


def _stragglers(value: Any) -> StragglerConfig:
    key = f"{SECTION}.stragglers"
    if value is None:
        return StragglerConfig()
    if isinstance(value, bool):
        return StragglerConfig(enabled=value)
    if not isinstance(value, Mapping):
        raise RecycleConfigError(
            f"{key} must be true, false or an object with keys enabled, threshold, patience; got {value!r}"
        )
    _no_unknown(value, key, [f.name for f in fields(StragglerConfig)])
    threshold = value.get("threshold", StragglerConfig.threshold)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 1 < threshold <= 100:
        raise RecycleConfigError(
            f"{key}.threshold must be a number in (1, 100] (how many times its peers' op time), got {threshold!r}"
        )
    patience = value.get("patience", StragglerConfig.patience)
    if isinstance(patience, bool) or not isinstance(patience, int) or not 1 <= patience <= 1_000_000:
        raise RecycleConfigError(
            f"{key}.patience must be an integer number of agreements in [1, 1000000], got {patience!r}"
        )
    return StragglerConfig(_boolean(value, "enabled", True, key), float(threshold), patience)


def monitor_config(value: Any) -> MonitorConfig:
    """Read and validate ``recycle.monitor`` (null or absent: no monitor)."""
    key = f"{SECTION}.monitor"
    if value is None:
        return MonitorConfig()
    if not isinstance(value, Mapping):
        raise RecycleConfigError(f"{key} must be null or an object with keys wandb, log_every, events_table")
    _no_unknown(value, key, [f.name for f in fields(MonitorConfig)])
    log_every = value.get("log_every", MonitorConfig.log_every)
    if isinstance(log_every, bool) or not isinstance(log_every, int) or not 1 <= log_every <= 1_000_000:
        raise RecycleConfigError(f"{key}.log_every must be an integer in [1, 1000000], got {log_every!r}")
    events_table = _boolean(value, "events_table", MonitorConfig.events_table, key)
    return MonitorConfig(_wandb_monitor(value.get("wandb")), log_every, events_table)


def _wandb_monitor(value: Any) -> WandbMonitorConfig | None:
    key = f"{SECTION}.monitor.wandb"
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise RecycleConfigError(f'{key} must be null or an object (e.g. {{"project": "ds-recycle"}})')
    _no_unknown(value, key, [f.name for f in fields(WandbMonitorConfig)])
    if not _boolean(value, "enabled", True, key):
        return None
    mode = value.get("mode", WandbMonitorConfig.mode)
    if not isinstance(mode, str) or mode not in MONITOR_MODES:
        raise RecycleConfigError(f"{key}.mode must be one of {', '.join(MONITOR_MODES)}; got {mode!r}")
    strings: dict[str, str | None] = {}
    for name in ("project", "group", "team", "name", "dir", "run_id"):
        v = value.get(name, getattr(WandbMonitorConfig, name))
        if name == "project" and v is None:
            raise RecycleConfigError(f"{key}.project must be a non-empty string, got null")
        if v is not None and (not isinstance(v, str) or not v.strip() or len(v) > 256):
            raise RecycleConfigError(f"{key}.{name} must be null or a non-empty string (<= 256 chars), got {v!r}")
        strings[name] = v
    tags = value.get("tags", [])
    if not isinstance(tags, list) or not all(isinstance(t, str) and 0 < len(t) <= 64 for t in tags):
        raise RecycleConfigError(f"{key}.tags must be a list of strings of 1 to 64 characters, got {tags!r}")
    timeout = value.get("init_timeout", WandbMonitorConfig.init_timeout)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 90:
        raise RecycleConfigError(f"{key}.init_timeout must be a number of seconds in (0, 90], got {timeout!r}")
    return WandbMonitorConfig(mode=mode, tags=tuple(tags), init_timeout=float(timeout), **strings)


def _no_unknown(section: Mapping[Any, Any], key: str, allowed: list[str]) -> None:
    unknown = sorted(set(section) - set(allowed), key=str)
    if unknown:
        name = unknown[0] if isinstance(unknown[0], str) and unknown[0].isprintable() else repr(unknown[0])
        raise RecycleConfigError(f"unknown key {key}.{name}; allowed keys: {', '.join(allowed)}")


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


def _key(key: object) -> str:
    """A key as it can appear in a one-line error: as written when plain, else its repr."""
    return key if isinstance(key, str) and key.isprintable() and key.strip() == key and key else repr(key)
