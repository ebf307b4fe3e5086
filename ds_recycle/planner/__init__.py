"""The planner: Plan IR, scheduling for any failure set, validation and lowering."""

from ds_recycle.planner.fault_free import fault_free_plan
from ds_recycle.planner.plan import CostModel, Op, Plan, Worker

__all__ = ["CostModel", "Op", "Plan", "Worker", "fault_free_plan"]
