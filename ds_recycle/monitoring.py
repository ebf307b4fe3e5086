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
from ds_recycle.runtime.events import Monitor

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
    """Give ``engine`` the monitors of ``recycle.monitor`` and the ``extra`` ones (the engine calls
    them on the lowest live rank only)."""
    for integration in integrations(recycle):
        integration.attach_monitors(engine, recycle, ds_config)
    extra = list(extra)
    if extra:
        if not hasattr(engine, "monitors"):
            raise ValueError("monitors= needs ReCycle (recycle.enabled true and a PipelineModule)")
        engine.monitors.extend(extra)
