"""Where ReCycle's events go: the monitors that ``recycle.monitor`` names, and any passed in.

Each section of ``recycle.monitor`` is implemented by an integration module, named here and
imported only when a config turns that section on, so ``ds_recycle.initialize`` itself depends on
no integration. An integration module provides ``prepare_ds_config(ds_config, recycle) -> dict``
(run before the engine exists, e.g. to turn off a DeepSpeed monitor it replaces) and
``attach_monitors(engine, recycle, ds_config) -> list[Monitor]``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from importlib import import_module
from types import ModuleType
from typing import Any

from ds_recycle.config import RecycleConfig
from ds_recycle.runtime.shared.events import IterationStats, MembershipChange, Monitor

SECTIONS = {"wandb": "ds_recycle.integrations.wandb"}
"""``recycle.monitor.<section>`` -> the module that implements it."""


def integrations(recycle: RecycleConfig) -> list[ModuleType]:
    """The integration modules of the sections ``recycle`` turns on."""
    return [import_module(module) for name, module in SECTIONS.items() if getattr(recycle.monitor, name) is not None]


def prepare_ds_config(ds_config: Mapping[str, Any], recycle: RecycleConfig) -> dict:
    config = dict(ds_config)
    for integration in integrations(recycle):
        config = integration.prepare_ds_config(config, recycle)
    return config


def attach(engine: Any, recycle: RecycleConfig, ds_config: Mapping[str, Any], extra: Iterable[Monitor] = ()) -> None:
    """Give ``engine`` the monitors of ``recycle.monitor``, DeepSpeed's own monitors (``tensorboard``,
    ``csv_monitor``, ``comet`` sections) and the ``extra`` ones (the engine calls them on the
    lowest live rank only)."""
    for integration in integrations(recycle):
        integration.attach_monitors(engine, recycle, ds_config)
    if recycle.enabled and getattr(getattr(engine, "monitor", None), "enabled", False):
        engine.monitors.append(DeepSpeedMonitors(engine))
    extra = list(extra)
    if extra:
        if not hasattr(engine, "monitors"):
            raise ValueError("monitors= needs ReCycle (recycle.enabled true and a PipelineModule)")
        engine.monitors.extend(extra)


class DeepSpeedMonitors:
    """ReCycle's events written to the monitors of the DeepSpeed config, as ``Recycle/...`` series
    stepped by ``global_samples`` like DeepSpeed's own. DeepSpeed opens them on global rank 0 only;
    the engine calls this on the lowest live rank, which is rank 0 of every epoch's world, so a new
    leader opens its own writers at its first event. An iteration is written at least once: the
    one a leader died after may be written again by the next leader, at the same step (the dead
    leader wrote it as it finished, the survivors kept it at its boundary)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._writer = None

    def _write(self, events: list[tuple[str, float, int]]) -> None:
        if self._writer is None:
            from deepspeed.monitor.monitor import MonitorMaster

            self._writer = MonitorMaster(self.engine._config.monitor_config)
        self._writer.write_events(events)

    def on_iteration(self, stats: IterationStats) -> None:
        step = self.engine.global_samples
        self._write(
            [
                ("Recycle/iteration_time_s", stats.seconds, step),
                ("Recycle/samples_per_s", stats.samples_per_s, step),
                ("Recycle/membership_epoch", stats.epoch, step),
            ]
        )

    def on_membership_change(self, event: MembershipChange) -> None:
        step = self.engine.global_samples
        events = [
            ("Recycle/event/left", len(event.left), step),
            ("Recycle/event/failed", len(event.failed), step),
            ("Recycle/event/joined", len(event.joined), step),
            ("Recycle/event/switch_s", event.switch_seconds, step),
        ]
        if event.detection_seconds is not None:
            events.append(("Recycle/event/detection_s", event.detection_seconds, step))
        if event.recovery_seconds is not None:
            events.append(("Recycle/event/recovery_s", event.recovery_seconds, step))
        if event.plan is not None:
            events.append(("Recycle/plan/ratio_to_fault_free", event.plan.ratio_to_fault_free, step))
            events += [
                (f"Recycle/live_workers/stage_{stage}", live, step)
                for stage, live in enumerate(event.plan.live_per_stage)
            ]
        self._write(events)

    def close(self) -> None:
        self._writer = None
