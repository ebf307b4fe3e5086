"""The planner: Plan IR, scheduling for any failure set, validation and lowering.

Names are imported lazily, so that ``import ds_recycle.planner`` stays cheap. No planner module
imports DeepSpeed: the lowering's actions (:mod:`ds_recycle.planner.actions`) are the engine's
instructions as they are.
"""

from importlib import import_module

from ds_recycle.planner.fault_free import fault_free_plan
from ds_recycle.planner.plan import CostModel, Op, Plan, Worker

_LAZY = {
    "PlanError": "validator",
    "validate": "validator",
    "plan_heuristic": "heuristic",
    "reroute_assignment": "heuristic",
    "lower_bound": "lower_bound",
    "NoSurvivorError": "lower_bound",
    "check_survivors": "lower_bound",
    "canonical": "normalize",
    "relabel": "normalize",
    "invert": "normalize",
    "PlanCache": "cache",
    "PlanRequest": "request",
    "canonical_failure_sets": "cache",
    "ScheduleOptions": "list_scheduler",
    "SchedulePolicy": "list_scheduler",
    "list_schedule": "list_scheduler",
}

__all__ = ["CostModel", "Op", "Plan", "Worker", "fault_free_plan", *sorted(_LAZY)]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ds_recycle.planner' has no attribute {name!r}")
    return getattr(import_module(f"ds_recycle.planner.{module}"), name)
