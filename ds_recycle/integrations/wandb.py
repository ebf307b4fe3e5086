"""Weights & Biases monitoring of a ReCycle job: failures, re-joins, plans and throughput.

Configured under ``recycle.monitor`` in the ds_config (validated by :mod:`ds_recycle.config`)::

    "recycle": {
      "enabled": true,
      "monitor": {
        "wandb": {"project": "ds-recycle", "group": null, "team": null, "name": null,
                  "mode": "auto", "dir": null, "run_id": null, "tags": [], "init_timeout": 60},
        "log_every": 1,
        "events_table": true
      }
    }

``ds_recycle.initialize`` builds a :class:`WandbMonitor` on every rank and appends it to
``engine.monitors``; the engine calls monitors on the lowest live rank only, so there is one writer
at a time. The run is opened on the first event the writer sees. When the writer dies, the next
lowest rank opens the *same* run id (``resume="allow"``) from its next event on, and seeds its
events table and totals from the engine's membership history, so a job is one run. Every row
carries ``train/global_step`` (the iteration), the step metric of all ``recycle/*`` keys and of HF's
``WandbCallback``: no explicit ``step=`` is ever passed, so rows of several writers never clash.

- ``mode: "auto"`` is online when an API key is configured (``WANDB_API_KEY`` or a netrc entry),
  offline otherwise; ``WANDB_MODE`` set in the environment wins. An online start that fails falls
  back to offline, ``wandb.init`` is bounded by ``init_timeout``, and any W&B error disables the
  monitor with a warning: monitoring never stops or hangs training.
- A run already open in the process (HF ``report_to=["wandb"]``) is reused, never a second
  ``wandb.init``. :func:`share_run_through_environment` exports the run id, project and resolved
  mode as ``WANDB_*`` variables so that HF's own ``wandb.init`` opens this same run, offline when
  there is no key, on whichever rank leads.
- DeepSpeed's own ``wandb`` section logs from global rank 0 only (which may die) with explicit
  steps (``global_samples``) that W&B silently drops next to ours: :func:`without_deepspeed_wandb`
  turns it off, with a warning, when ``recycle.monitor.wandb`` is on.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import netrc
import os
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import urlparse

from ds_recycle.config import MonitorConfig, RecycleConfig, WandbMonitorConfig
from ds_recycle.runtime.shared.events import IterationStats, MembershipChange, Monitor, PlanSummary

logger = logging.getLogger(__name__)

STEP_METRIC = "train/global_step"
FLUSH_INTERVAL_SECONDS = 1.0
"""How often W&B writes the run's ``.wandb`` file (its default is 15 s). A writer killed by SIGKILL
takes its ``wandb-core`` down unflushed: it loses at most this much of its rows."""
EVENT_COLUMNS = [
    "iteration",
    "epoch",
    "kind",
    "pipeline",
    "stage",
    "detection_s",
    "switch_s",
    "recovery_s",
    "rolled_back",
    "plan_id",
    "time",
]


def build_monitors(
    config: MonitorConfig,
    ds_config: Mapping[str, Any] | None = None,
    engine: Any = None,
) -> list[Monitor]:
    """The monitors ``recycle.monitor`` asks for. Build them on every rank: they open nothing
    until their first event, which only the lowest live rank receives. With ``engine`` (a
    RecyclePipelineEngine) a new writer seeds its events from ``engine.membership_changes`` and
    looks up the summary of a plan it has not seen."""
    monitors: list[Monitor] = []
    if config.wandb is None:
        return monitors
    run_config: dict[str, Any] = {}
    if ds_config is not None:
        run_config["ds_config"] = json_safe(ds_config)
    history = plan_summary = None
    if engine is not None:
        run_config.update(_topology(engine))
        history = lambda: list(engine.membership_changes)  # noqa: E731
        # The engine summarises its current plan on demand (a private method: see the report).
        plan_summary = getattr(engine, "plan_summary", None)
    share_run_through_environment(config.wandb)
    monitors.append(WandbMonitor(config, run_config=run_config, history=history, plan_summary=plan_summary))
    return monitors


def _topology(engine: Any) -> dict[str, Any]:
    topo = getattr(getattr(engine, "module", None), "_topo", None)
    if topo is None:
        return {}
    return {
        "recycle_topology": {
            "pipeline_stages": topo.get_dim("pipe"),
            "data_parallel": topo.get_dim("data"),
            "world": topo.world_size(),
            "micro_batches": getattr(engine, "micro_batches", None),
        }
    }


def attach_monitors(engine: Any, recycle: RecycleConfig, ds_config: Mapping[str, Any]) -> list[Monitor]:
    """Build the monitors of ``recycle.monitor`` and append them to ``engine.monitors`` (what
    ``ds_recycle.initialize`` does)."""
    if recycle.monitor.wandb is None:
        return []
    if not recycle.enabled or not hasattr(engine, "monitors"):
        logger.warning("recycle.monitor is set but ReCycle is off (recycle.enabled false): no monitor runs")
        return []
    monitors = build_monitors(recycle.monitor, ds_config, engine)
    engine.monitors.extend(monitors)
    return monitors


def without_deepspeed_wandb(ds_config: Mapping[str, Any], recycle: RecycleConfig | None = None) -> dict:
    """``ds_config`` with DeepSpeed's own ``wandb`` monitor turned off when ``recycle.monitor.wandb``
    is on (with a warning): DeepSpeed logs from global rank 0 only, with ``step=global_samples``,
    which W&B silently drops next to rows logged by step, and its ``wandb.init`` would fight ours.
    Unchanged (a copy) otherwise."""
    config = dict(ds_config)
    recycle = recycle or RecycleConfig.from_ds_config(config)
    theirs = config.get("wandb")
    if recycle.enabled and recycle.monitor.wandb is not None and isinstance(theirs, Mapping) and theirs.get("enabled"):
        logger.warning(
            "both DeepSpeed's 'wandb' monitor and recycle.monitor.wandb are enabled; DeepSpeed's is turned off "
            "(it logs from rank 0 only, which may die, and its explicit steps would be dropped next to ReCycle's "
            "rows). ReCycle's monitor logs the training loss as recycle/loss."
        )
        config["wandb"] = {**theirs, "enabled": False}
    return config


def prepare_ds_config(ds_config: Mapping[str, Any], recycle: RecycleConfig) -> dict:
    """The hook :mod:`ds_recycle.monitoring` runs before the engine exists."""
    return without_deepspeed_wandb(ds_config, recycle)


def share_run_through_environment(settings: WandbMonitorConfig) -> None:
    """Export this job's run as ``WANDB_*`` variables (without overriding any already set), so a
    ``wandb.init`` made by other code in this process (HF's ``WandbCallback``) opens the same run,
    in the same mode and with the same flush interval, and never raises for a missing API key on
    the one rank that logs."""
    values = {
        "WANDB_RUN_ID": resolve_run_id(settings.run_id),
        "WANDB_RESUME": "allow",
        "WANDB_PROJECT": settings.project,
        "WANDB_ENTITY": settings.team,
        "WANDB_RUN_GROUP": settings.group,
        "WANDB_DIR": settings.dir,
        "WANDB_MODE": resolve_mode(settings.mode),
        "WANDB__TRANSACTION_LOG_FLUSH_INTERVAL": str(FLUSH_INTERVAL_SECONDS),  # x_transaction_log_flush_interval
    }
    if values["WANDB_RUN_ID"] is None:
        del values["WANDB_RESUME"]
    for key, value in values.items():
        if value is not None:
            os.environ.setdefault(key, value)


# ---- the monitor -------------------------------------------------------------------------------


class WandbMonitor:
    """Logs ReCycle's events to one W&B run (see the module doc). Implements
    :class:`ds_recycle.runtime.shared.events.Monitor`."""

    def __init__(
        self,
        config: MonitorConfig,
        run_config: Mapping[str, Any] | None = None,
        history: Callable[[], Sequence[MembershipChange]] | None = None,
        plan_summary: Callable[[], PlanSummary] | None = None,
    ):
        if config.wandb is None:
            raise ValueError("WandbMonitor needs recycle.monitor.wandb")
        self.config = config
        self.settings: WandbMonitorConfig = config.wandb
        self.run_config = dict(run_config or {})
        self.history = history
        self.plan_summary = plan_summary
        self.run = None
        self.owns_run = False
        self.disabled = False
        self.plan: PlanSummary | None = None
        self.events: list[list] = []
        self.totals = {"failures": 0, "leaves": 0, "joins": 0, "rolled_back": 0}
        self.recoveries: list[float] = []
        self.fault_free_seconds: list[float] = []
        """Measured iteration times on a plan without failures (the baseline of the measured ratio)."""

    # Monitor protocol

    def on_membership_change(self, event: MembershipChange) -> None:
        self._guarded(self._membership_change, event)

    def on_iteration(self, stats: IterationStats) -> None:
        self._guarded(self._iteration, stats)

    def close(self) -> None:
        """Write the summary and finish the run if this monitor opened it (idempotent)."""
        if self.run is not None:
            self._guarded(self._close)

    # internals

    def _guarded(self, method: Callable[..., None], *args: Any) -> None:
        if self.disabled:
            return
        try:
            method(*args)
        except Exception as error:  # noqa: BLE001 - monitoring must never stop training
            self.disabled = True
            logger.warning(f"W&B monitor disabled after an error: {type(error).__name__}: {error}")

    def _ensure_run(self, current: MembershipChange | None = None):
        if self.run is not None:
            return self.run
        import wandb

        if wandb.run is not None:
            self.run, self.owns_run = wandb.run, False  # HF's WandbCallback opened it: share it
        else:
            self.run, self.owns_run = self._open(wandb), True
            atexit.register(self.close)
        self.run.define_metric(STEP_METRIC)
        self.run.define_metric("recycle/*", step_metric=STEP_METRIC)
        if self.run_config:
            self.run.config.update(self.run_config, allow_val_change=True)
        self._seed(current)
        return self.run

    def _open(self, wandb):
        mode = resolve_mode(self.settings.mode)
        kwargs = dict(
            project=self.settings.project,
            group=self.settings.group,
            entity=self.settings.team,
            name=self.settings.name,
            dir=self.settings.dir,
            tags=list(self.settings.tags) or None,
            id=resolve_run_id(self.settings.run_id),
            resume="allow",
            settings=wandb.Settings(
                init_timeout=self.settings.init_timeout,
                console="off",
                silent=True,
                x_transaction_log_flush_interval=FLUSH_INTERVAL_SECONDS,
            ),
        )
        try:
            return wandb.init(mode=mode, **kwargs)
        except Exception as error:
            if mode != "online":
                raise
            logger.warning(f"W&B online start failed ({type(error).__name__}: {error}); logging offline")
            return wandb.init(mode="offline", **kwargs)

    def _seed(self, current: MembershipChange | None) -> None:
        """A writer that takes over (the previous lowest rank died or left) starts from the
        membership changes it did not log itself, so its events table and totals cover the job."""
        if self.history is None:
            return
        for change in self.history():
            if change is not current:
                self._count(change)

    def _count(self, event: MembershipChange) -> None:
        if event.plan is not None:
            self.plan = event.plan
        self.totals["failures"] += len(event.failed)
        self.totals["leaves"] += len(event.left)
        self.totals["joins"] += len(event.joined)
        self.totals["rolled_back"] += int(event.rolled_back)
        if event.recovery_seconds is not None:
            self.recoveries.append(event.recovery_seconds)
        plan_id = event.plan.plan_id if event.plan else None
        for kind, workers in (("failed", event.failed), ("left", event.left), ("joined", event.joined)):
            for pipeline, stage in workers:
                self.events.append(
                    [
                        event.iteration,
                        event.epoch,
                        kind,
                        pipeline,
                        stage,
                        event.detection_seconds,
                        event.switch_seconds,
                        event.recovery_seconds,
                        event.rolled_back,
                        plan_id,
                        event.time,
                    ]
                )

    def _membership_change(self, event: MembershipChange) -> None:
        run = self._ensure_run(event)
        self._count(event)
        row: dict[str, Any] = {
            STEP_METRIC: event.iteration,
            "recycle/membership_epoch": event.epoch,
            "recycle/event/failed": len(event.failed),
            "recycle/event/left": len(event.left),
            "recycle/event/joined": len(event.joined),
            "recycle/event/rolled_back": int(event.rolled_back),
            "recycle/event/switch_s": event.switch_seconds,
        }
        if event.detection_seconds is not None:
            row["recycle/event/detection_s"] = event.detection_seconds
        if event.recovery_seconds is not None:
            row["recycle/event/recovery_s"] = event.recovery_seconds
        row.update(self._plan_fields())
        if self.config.events_table:
            import wandb

            row["recycle/events"] = wandb.Table(columns=EVENT_COLUMNS, data=[list(r) for r in self.events])
        run.log(row)
        self._summary()

    def _iteration(self, stats: IterationStats) -> None:
        if self.plan is None or self.plan.plan_id != stats.plan_id:
            plan = stats.extra.get("plan") if isinstance(stats.extra, Mapping) else None
            if not isinstance(plan, PlanSummary) and self.plan_summary is not None:
                plan = self.plan_summary()
            self.plan = plan if isinstance(plan, PlanSummary) and plan.plan_id == stats.plan_id else None
        if (self.plan is None and stats.epoch == 0) or (self.plan is not None and not self.plan.failed):
            self.fault_free_seconds.append(stats.seconds)
        if stats.iteration % self.config.log_every:
            return
        run = self._ensure_run()
        row: dict[str, Any] = {
            STEP_METRIC: stats.iteration,
            "recycle/membership_epoch": stats.epoch,
            "recycle/loss": stats.loss,
            "recycle/iteration_time_s": stats.seconds,
            "recycle/samples_per_s": stats.samples_per_s,
        }
        row.update(self._plan_fields())
        row["recycle/plan_id"] = stats.plan_id
        if self.fault_free_seconds and stats.seconds > 0:
            row["recycle/measured_ratio_to_fault_free"] = stats.seconds / statistics.median(self.fault_free_seconds)
        for key, value in (stats.extra or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                row[f"recycle/{key}"] = value
        run.log(row)

    def _plan_fields(self) -> dict[str, Any]:
        plan = self.plan
        if plan is None:
            return {}
        out: dict[str, Any] = {
            "recycle/plan_id": plan.plan_id,
            "recycle/failed_workers": len(plan.failed),
            "recycle/live_workers": sum(plan.live_per_stage),
            "recycle/min_live_per_stage": min(plan.live_per_stage, default=0),
            "recycle/predicted_iteration_time": plan.predicted_iteration_time,
            "recycle/fault_free_iteration_time": plan.fault_free_iteration_time,
            "recycle/lower_bound": plan.lower_bound,
            "recycle/ratio_to_fault_free": plan.ratio_to_fault_free,
            "recycle/ratio_to_lower_bound": plan.ratio_to_lower_bound,
            "recycle/rerouted_microbatches": plan.rerouted_microbatches,
        }
        for stage, live in enumerate(plan.live_per_stage):
            out[f"recycle/live_workers/stage_{stage}"] = live
        return out

    def _summary(self) -> None:
        summary = self.run.summary
        summary["recycle/total_failures"] = self.totals["failures"]
        summary["recycle/total_leaves"] = self.totals["leaves"]
        summary["recycle/total_joins"] = self.totals["joins"]
        summary["recycle/total_rolled_back"] = self.totals["rolled_back"]
        if self.recoveries:
            summary["recycle/max_recovery_s"] = max(self.recoveries)
            summary["recycle/mean_recovery_s"] = sum(self.recoveries) / len(self.recoveries)

    def _close(self) -> None:
        atexit.unregister(self.close)
        self._summary()
        run, self.run = self.run, None
        if self.owns_run:
            run.finish()


# ---- helpers -----------------------------------------------------------------------------------


def resolve_mode(mode: str) -> str:
    """``auto`` -> ``WANDB_MODE`` if set, else online with an API key and offline without one."""
    if mode != "auto":
        return mode
    env = os.environ.get("WANDB_MODE")
    if env in ("online", "offline", "disabled", "dryrun", "run"):
        return {"dryrun": "offline", "run": "online"}.get(env, env)
    return "online" if has_api_key() else "offline"


def has_api_key() -> bool:
    """An API key in the environment or in netrc for the W&B host; no network, no prompt."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def resolve_run_id(configured: str | None) -> str | None:
    """The run every writer of this job opens: configured, else ``WANDB_RUN_ID``, else derived from
    the ``ds-recycle launch`` job (a hash of its token: the same in every rank, respawns included),
    else None (W&B picks one; without the launcher a new writer starts a new run)."""
    if configured:
        return configured
    if os.environ.get("WANDB_RUN_ID"):
        return os.environ["WANDB_RUN_ID"]
    token = os.environ.get("DS_RECYCLE_TOKEN")
    if token:
        return "recycle-" + hashlib.sha256(token.encode()).hexdigest()[:12]
    return None


def json_safe(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)
