"""RecyclePipelineEngine: DeepSpeed's PipelineEngine running ReCycle's planned schedules.

Each ``train_batch`` runs this worker's instruction stream, lowered from the plan for the current
failure set: routed transfers, BackwardInput with BackwardWeight deferred into bubbles, and a
StaggeredStep. The instructions run through this class's own instruction map. Without a
``recycle`` section, or with ``enabled: false``, it is DeepSpeed's engine, running DeepSpeed's
schedule.

Membership (under ``ds-recycle launch``): at the end of every iteration the members take one shared
decision (:class:`~ds_recycle.runtime.membership.MembershipAgent`). When workers left or joined,
every member enters the new epoch: a fresh world and grid (:mod:`ds_recycle.runtime.groups`), the
joiners' state copied from a live replica (:mod:`ds_recycle.runtime.rejoin`), and the plan of the
new failure set from the plan cache, lowered to this worker's stream.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from types import MethodType

import torch
import torch.utils.checkpoint
from deepspeed.runtime.pipe import p2p, schedule
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.utils import groups

from ds_recycle.config import RecycleConfig, RecycleConfigError
from ds_recycle.engine import autocast_p2p
from ds_recycle.engine import checkpoint as checkpoints
from ds_recycle.engine.backward_split import backward_input, backward_weight
from ds_recycle.engine.memory_cap import (
    AUDIT_ENV,
    BudgetRow,
    HeldMeter,
    MemoryBudget,
    MemoryCapError,
    agree_budget,
    device_budget,
    executed_peak,
    limit_bytes,
    peak_in_flight,
    static_bytes,
)
from ds_recycle.engine.profile import CostChange, CostTracker, OpTimes, agree
from ds_recycle.engine.routing import ACTIVATION, GRADIENT, PeerChannel
from ds_recycle.engine.staggered_step import StageStepper
from ds_recycle.engine.timing import InstructionEvent, event_of, pad_to
from ds_recycle.engine.weight_grad import install_weight_grad_path
from ds_recycle.instructions import (
    BackwardInput,
    BackwardWeight,
    ForwardPass,
    LoadMicroBatch,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
    StaggeredStep,
    to_instruction,
)
from ds_recycle.log import logger
from ds_recycle.planner import actions
from ds_recycle.planner.cache import PlanCache
from ds_recycle.planner.evaluation import lower_forward_only
from ds_recycle.planner.fault_free import fault_free_plan
from ds_recycle.planner.list_scheduler import ScheduleOptions
from ds_recycle.planner.lower_bound import NoSurvivorError
from ds_recycle.planner.lowering import WorkerStream, lower
from ds_recycle.planner.plan import FORWARD, CostModel, Plan, Worker
from ds_recycle.planner.prefetch import PlanPrefetcher, PrefetchRequest
from ds_recycle.planner.simulate import retime
from ds_recycle.runtime import exit_guard, placement
from ds_recycle.runtime import protocol as proto
from ds_recycle.runtime.distributed import membership_agent
from ds_recycle.runtime.events import IterationStats, MembershipChange, Monitor, PlanSummary
from ds_recycle.runtime.groups import GROUP_TIMEOUT_SECONDS, RecycleGrid, bury
from ds_recycle.runtime.protocol import Membership
from ds_recycle.runtime.recovery import RankRuntime
from ds_recycle.runtime.waiting import PeerFailure, Waiter

_EXTRA_BUFFERS = ("losses", "grads", "input_grads", "weight_work")
EVAL_COMMITTED = "recycle/eval_committed"
"""The job store's record of the last evaluation batch a member finished: its key and loss."""
TRAIN_BATCH_TIMER = "train_batch"


class PlannedSchedule(schedule.PipeSchedule):
    """One worker's lowered stream as this engine's instructions, one per step."""

    trains = True
    """Running it is an iteration of training (the engine finishes the iteration after it)."""

    def __init__(self, stream: WorkerStream, micro_batches: int, stages: int, stage_id: int):
        super().__init__(micro_batches, stages, stage_id)
        self.num_buffers = stream.num_buffers
        self.instructions = [to_instruction(action) for action in stream.actions]
        self.peers = {action.peer for action in stream.actions if isinstance(action, actions.TransferAction)}
        """The workers this stream sends to or receives from."""

    def num_pipe_buffers(self) -> int:
        return self.num_buffers

    def steps(self):
        for instruction in self.instructions:
            yield [instruction]


class ForwardOnlySchedule(PlannedSchedule):
    """One worker's forward-only (evaluation) stream."""

    trains = False


@dataclass
class EvalData:
    """The micro-batches of one ``eval_batch``: from a source ``(home, mb) -> batch`` that any worker
    can load from, or from this pipeline's iterator as DeepSpeed reads it (its own micro-batches
    only). What an iterator gave is kept, so a run again after a failure reads the same batches."""

    source: Callable[[int, int], object] | None = None
    iterator: Iterator | None = None
    read: list = field(default_factory=list)

    @classmethod
    def of(cls, data) -> EvalData:
        if data is None:
            raise ValueError(
                "eval_batch needs data: an iterator of this pipeline's micro-batches or (home, mb) -> batch"
            )
        if callable(data) and not hasattr(data, "__next__"):
            return cls(source=data)
        return cls(iterator=iter(data))

    def get(self, home: int, mb: int, own_pipeline: int):
        if self.source is not None:
            return self.source(home, mb)
        if home != own_pipeline:
            raise RecycleDataError(
                f"eval micro-batch ({home},{mb}) belongs to another pipeline and eval data comes from an iterator"
            )
        while len(self.read) <= mb:
            self.read.append(next(self.iterator))
        return self.read[mb]


@dataclass
class Evaluation:
    """One ``eval_batch`` on this worker: what it ran and the last stage's loss of each micro-batch."""

    data: EvalData
    micro_batches: int
    failed: tuple = ()
    forwards: list[tuple[int, int]] = field(default_factory=list)
    """(home, mb) of every F this worker ran, in order."""
    losses: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    key: str = ""
    """Names this batch on every rank (generation, epoch, iteration, evaluation since it)."""
    attempts: int = 0
    """Runs of this batch: more than one when a failure interrupted it."""
    seconds: float = 0.0
    from_peer: bool = False
    """A failure interrupted this worker after a peer had finished the batch: its loss is the peer's."""


class RecycleDataError(RuntimeError):
    """A plan needs micro-batches of another pipeline and the data came from an iterator."""


class RecyclePipelineEngine(PipelineEngine):
    def __init__(self, *args, recycle_config: RecycleConfig | None = None, micro_batch_source=None, **kwargs):
        self.recycle = recycle_config or RecycleConfig()
        super().__init__(*args, **kwargs)
        self.instruction_events: list[InstructionEvent] = []
        self.runtime: RankRuntime | None = None
        """The rank's membership protocol under ds-recycle launch (None under any other launcher)."""
        if not self.recycle.enabled:
            return
        self._check_supported()
        for key in _EXTRA_BUFFERS:
            self.pipe_buffers[key] = [None] * self.num_pipe_buffers
        self.slot = self.global_rank
        self.micro_batch_source = micro_batch_source
        """``(iteration, home, mb) -> batch``, or None when data comes from ``train_batch(data_iter)``."""
        self.forward_ledger: list[tuple[int, int, int, int]] | None = None
        """Set to a list to record (iteration, home, mb, stage) of every F this worker runs."""
        self.monitors: list[Monitor] = []
        self.rejoin_client_state: Callable[[], object] | None = None
        """Set by a training loop above the engine: its state, sent to a joiner with the engine's."""
        self.received_client_state: object = None
        """In a joiner: the ``rejoin_client_state()`` of the replica it copied its state from."""
        self.membership_changes: list[MembershipChange] = []
        agent = membership_agent()
        if agent is not None:
            self.runtime = RankRuntime(self, agent, self.recycle)
        self.plan_cache = PlanCache()
        self.plan: Plan | None = None
        self.plan_prefetched = False
        """Whether :attr:`plan` was in the plan cache before its failure set arose."""
        self.prefetcher = (
            PlanPrefetcher(self.plan_cache) if self.recycle.prefetch_plans and self.runtime is not None else None
        )
        self._trainable = [p for p in self.module.parameters() if p.requires_grad]
        self._weight_path = install_weight_grad_path(self.module)
        self._wire = autocast_p2p.wire_dtype(self)
        logger.info(f"ReCycle W path on stage {self.stage_id}: {self._weight_path.describe()}")
        self._stream_cache: dict[tuple, tuple[Plan, WorkerStream]] = {}
        self._own_loss: torch.Tensor | None = None
        self._fault_free_time: float | None = None
        self._setup_profile()
        self._setup_memory_cap()
        self._loaded: dict[int, list] = {}
        """Own-pipeline micro-batches read from the data iterator, by iteration (the last two)."""
        self.evaluation: Evaluation | None = None
        """The running ``eval_batch``, or after it the last one."""
        self._evaluating = False
        self._eval_streams: dict[tuple, WorkerStream] = {}
        self._evals_at: tuple[int, int] = (-1, 0)
        """(iteration, evaluations run since it): part of each evaluation's key."""
        self.waiter = Waiter()
        everyone = Membership(0, tuple(range(self.module._topo.world_size())), 0)
        self.install_grid(RecycleGrid.build(self.module._topo, everyone, self.slot, GROUP_TIMEOUT_SECONDS))
        logger.info(
            f"ReCycle engine on worker (pipeline {self.worker[0]}, stage {self.worker[1]}): "
            f"decoupled_backprop={self.recycle.decoupled_backprop} "
            f"staggered_optimizer={self.recycle.staggered_optimizer} "
            f"membership={'ds-recycle launch' if self.runtime else 'static (no coordinator)'}"
        )

    # ---- what the rank's runtime (ds_recycle.runtime.recovery) uses --------------------------------

    @property
    def worker(self) -> tuple[int, int]:
        return self.grid.worker

    @property
    def stepped_inflight(self) -> bool:
        return self.stepper.stepped_inflight

    def is_lowest_live_rank(self) -> bool:
        """True on the one process that logs, saves and feeds the monitors in this epoch."""
        if not self.recycle.enabled:
            return self.global_rank == 0
        return self.slot == min(self.grid.membership.members)

    def install_grid(self, grid: RecycleGrid) -> None:
        """Point every handle the engine uses at this epoch's grid."""
        self.grid = self.mpu = grid
        self.data_parallel_group = grid.get_data_parallel_group()
        groups.mpu = grid
        p2p._grid = grid
        if getattr(self, "channel", None) is not None:
            bury(work for work, _ in self.channel.pending_sends)
        self.channel = PeerChannel(grid, self.device, self.waiter)
        self.stepper = StageStepper(self, self.channel, synchronous=not self.recycle.staggered_optimizer)
        self._switch_plan()

    def _switch_plan(self) -> None:
        """Take the plan of the current failure set and costs, and have the plans of the next
        failures made in the background (``recycle.prefetch_plans``)."""
        D, P, m = self.grid.data_parallel_size, self.num_stages, self.micro_batches
        failed, costs, options = self.grid.failed, self._cost_model(), self._schedule_options()
        cap = self._failure_cap()
        plannable = cap is None or cap >= 1
        self.plan_prefetched = (
            bool(failed) and plannable and self.plan_cache.get(D, P, m, failed, costs, cap, options) is not None
        )
        self.plan = self._current_plan_and_stream()[0]
        if self.prefetcher is not None and plannable:
            nodes = self._node_workers()
            self.prefetcher.request(PrefetchRequest(D, P, m, failed, costs, options, nodes, cap))

    def _node_workers(self) -> tuple[tuple[Worker, ...], ...]:
        """The workers of each node when the job runs on several (``LOCAL_WORLD_SIZE`` ranks each)."""
        topo = self.module._topo
        world, per_node = topo.world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", 0) or 0)
        if not 0 < per_node < world:
            return ()
        nodes = placement.contiguous_nodes(world, per_node).values()
        return tuple(tuple((topo.get_coord(r).data, topo.get_coord(r).pipe) for r in ranks) for ranks in nodes)

    def roll_back_to(self, iteration: int) -> bool:
        """Undo this worker's steps back to the state before ``iteration``; drop the partial iteration."""
        rolled_back = False
        if self.global_steps == iteration + 1:
            self.stepper.rollback_finished()
            self.global_steps -= 1
            self.global_samples -= self.train_batch_size()
            rolled_back = True
        elif self.global_steps != iteration:
            raise RuntimeError(
                f"slot {self.slot} finished {self.global_steps} iterations but the survivors restart from "
                f"{iteration}: a survivor can be at most one iteration ahead"
            )
        if self.stepper.stepped_inflight:
            self.stepper.rollback_inflight()
            rolled_back = True
        if self.forward_ledger is not None:
            self.forward_ledger[:] = [entry for entry in self.forward_ledger if entry[0] < iteration]
        self._drop_partial_iteration()
        return rolled_back

    def _drop_partial_iteration(self) -> None:
        for p in self.module.parameters():
            p.grad = None
        for key in self.pipe_buffers:
            self.pipe_buffers[key] = [None] * len(self.pipe_buffers[key])
        self.total_loss = None
        self._own_loss = None
        if self.held_meter is not None:
            self.held_meter.drop()
        timer = self.timers(TRAIN_BATCH_TIMER)
        if timer.started_:
            timer.stop()
        timer.reset()
        self.stepper.drop_pending()

    def resync_tied_weights(self) -> None:
        self.stepper.resync_tied_weights()

    def record_change(self, change: MembershipChange) -> None:
        self.membership_changes.append(change)
        if self.is_lowest_live_rank():
            for monitor in self.monitors:
                monitor.on_membership_change(change)

    def warn_if_data_is_per_pipeline(self) -> None:
        if self.micro_batch_source is None:
            logger.warning(
                "ReCycle: data comes from train_batch(data_iter), so only a worker's own pipeline can load its "
                "micro-batches. Losing a first- or last-stage worker then stops training cleanly at that "
                "boundary. Pass training_data= (a map-style dataset or an (iteration, home, mb) provider) to "
                "ds_recycle.initialize to survive it."
            )

    # ---- checkpoints ------------------------------------------------------------------------

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
        """DeepSpeed's checkpoint; while workers are missing, each stage's lowest live replica
        writes the stage. The lowest live rank writes ``latest`` once every file is written (after
        DeepSpeed's last barrier), so that ``latest`` never names a checkpoint that a failure cut
        short."""
        client_state = client_state or {}
        if not self.recycle.enabled:
            return super().save_checkpoint(save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
        tag = str(tag or f"global_step{self.global_steps}")
        if not self.grid.failed:
            saved = super().save_checkpoint(save_dir, tag, client_state, False, exclude_frozen_parameters)
            if save_latest and self.is_lowest_live_rank():
                checkpoints.write_latest(save_dir, tag)
            return saved
        view = checkpoints.writer_view(self.grid, self.module._topo)
        os.makedirs(save_dir, exist_ok=True)
        writes, grid = self.save_non_zero_checkpoint, self.module._grid
        self.save_non_zero_checkpoint, self.module._grid = view.data_parallel_id == 0, view
        try:
            saved = super().save_checkpoint(save_dir, tag, client_state, False, exclude_frozen_parameters)
        finally:
            self.save_non_zero_checkpoint, self.module._grid = writes, grid
        if save_latest and self.is_lowest_live_rank():
            checkpoints.write_latest(save_dir, tag)
        return saved

    def resume_from_checkpoint(self) -> None:
        """At start: continue from the latest checkpoint in ``recycle.checkpoint.dir``, if any. In a
        restart of the whole job (``DS_RECYCLE_RESUME=required``: generation > 0) there must be one:
        without it the rank stops the job (exit 76) rather than train again from scratch."""
        tag = checkpoints.latest_tag(self.recycle.checkpoint)
        if tag is None and os.environ.get(proto.ENV_RESUME) == "required":
            config = self.recycle.checkpoint
            where = "no recycle.checkpoint is configured" if config is None else f"no checkpoint in {config.dir}"
            logger.error(
                f"ReCycle: slot {self.slot}: the job restarts in generation {os.environ.get(proto.ENV_GENERATION)} "
                f"(the coordinator's host died, or a stage lost every worker), but {where} to resume from: "
                "the job stops here"
            )
            raise exit_guard.exit(proto.STOP_EXIT_CODE)
        if tag is None:
            return
        self.load_checkpoint(self.recycle.checkpoint.dir, tag)
        logger.info(
            f"ReCycle: slot {self.slot} resumed from checkpoint {tag} in {self.recycle.checkpoint.dir} "
            f"at iteration {self.global_steps}"
        )

    def _save_if_due(self) -> None:
        config = self.recycle.checkpoint
        if checkpoints.due(config, self.global_steps):
            self.save_checkpoint(config.dir)

    def plan_summary(self, fault_free: float | None = None) -> PlanSummary:
        """The plan this worker runs now, as monitors report it."""
        plan = self.plan
        key = repr((plan.pipelines, plan.stages, plan.microbatches, plan.failed, plan.costs.to_dict()))
        rerouted = sum(
            1 for worker, ops in plan.workers.items() for op in ops if op.kind == FORWARD and op.home != worker[0]
        )
        return PlanSummary(
            plan_id=hashlib.sha1(key.encode()).hexdigest()[:10],
            failed=tuple(plan.failed),
            predicted_iteration_time=plan.iteration_time,
            fault_free_iteration_time=fault_free or self.fault_free_iteration_time(),
            lower_bound=plan.lower_bound or plan.iteration_time,
            live_per_stage=tuple(len(self.grid.live_workers(s)) for s in range(self.num_stages)),
            rerouted_microbatches=rerouted,
            prefetched=self.plan_prefetched,
        )

    def check_data_available(self) -> None:
        if self.micro_batch_source is not None:
            return
        foreign = [
            (worker, op.label())
            for worker, ops in self.plan.workers.items()
            for op in ops
            if op.kind == FORWARD and op.stage in (0, self.num_stages - 1) and op.home != worker[0]
        ]
        if foreign:
            worker, label = foreign[0]
            raise RecycleDataError(
                f"the plan for failure set {list(self.plan.failed)} has worker {worker} load {label} of another "
                "pipeline, but data comes from train_batch(data_iter), which holds only its own pipeline's "
                "micro-batches; pass training_data= to ds_recycle.initialize to survive first- or last-stage "
                f"failures. Training stopped at iteration {self.global_steps}, before running it."
            )

    def _check_supported(self) -> None:
        if self.is_pipe_partitioned or self.is_grad_partitioned:
            raise RecycleConfigError("recycle does not support pipe/grad partitioning (tensor parallelism > 1) yet")
        if self.dynamic_shape:
            raise RecycleConfigError(
                "recycle does not support 'pipeline.dynamic_shape': activations between stages must keep one shape"
            )
        if self.has_attention_mask or self.has_bool_tensors:
            raise RecycleConfigError("recycle does not support boolean tensors between stages; send them as float")
        if self.module.activation_checkpoint_interval > 0:
            # DeepSpeed's checkpoint functions refuse torch.autograd.grad, which BackwardInput uses.
            self.module.activation_checkpoint_func = functools.partial(
                torch.utils.checkpoint.checkpoint, use_reentrant=False
            )

    def _build_data_iter(self, dataset):
        """With ReCycle every worker loads a map-style ``training_data`` by (iteration, home, mb)
        in its own process (:class:`~ds_recycle.data.DatasetMicroBatches`): DeepSpeed's prefetching
        pipeline loader would only add DataLoader worker processes, which a signal to the rank's
        process tree kills."""
        if not self.recycle.enabled:
            super()._build_data_iter(dataset)

    # ---- schedule ---------------------------------------------------------------------------

    def train_batch(self, data_iter=None):
        if not self.recycle.enabled:
            return super().train_batch(data_iter)
        began = time.time()
        if self.runtime is None:
            loss = super().train_batch(data_iter)
        else:
            loss = self.runtime.train_batch(
                lambda: super(RecyclePipelineEngine, self).train_batch(data_iter), self._save_if_due
            )
        if self.runtime is None:
            self._save_if_due()
        if self.monitors and self.is_lowest_live_rank():
            stats = IterationStats(
                self.global_steps,
                self.grid.membership.epoch,
                float(loss),
                time.time() - began,
                self.train_batch_size(),
                self.plan_summary().plan_id,
            )
            for monitor in self.monitors:
                monitor.on_iteration(stats)
        return loss

    def eval_batch(
        self,
        data_iter,
        return_logits: bool = False,
        compute_loss: bool = True,
        reduce_output: str | None = "avg",
        bcast_loss: bool = True,
        num_micro_batches: int | None = None,
    ):
        """DeepSpeed's ``eval_batch`` on a forward-only plan over the live workers.

        Each pipeline's ``num_micro_batches`` (default: the training's) micro-batches go forward
        through live workers only, routed as the training plan routes their F, so whatever the
        failure set every micro-batch is evaluated once. Returns DeepSpeed's value on every rank:
        the mean of the micro-batches' losses, per pipeline then over the D pipelines, summed in
        DeepSpeed's order (fault-free the result is bitwise stock's). ``return_logits``: also the
        last stage's outputs of the last micro-batch this worker ran (None on other stages).

        ``data_iter``: this pipeline's micro-batches as DeepSpeed reads them (only the pipeline's
        own first and last stage can load them, so losing one of those stops with
        :class:`RecycleDataError`), or a callable ``(home, mb) -> batch`` that any worker can
        load from, which survives any failure set. Under ``ds-recycle launch`` a failure during
        the batch is recovered as during training and the batch runs again on the new plan.

        ``compute_loss=False`` or ``reduce_output`` other than ``"avg"`` run DeepSpeed's own
        schedule, which needs every pipeline whole."""
        if not self.recycle.enabled or not compute_loss or reduce_output != "avg":
            if self.recycle.enabled and self.grid.failed:
                raise RuntimeError(
                    f"eval_batch(compute_loss={compute_loss}, reduce_output={reduce_output!r}) runs DeepSpeed's own "
                    f"schedule, which needs every pipeline whole; workers {list(self.grid.failed)} are missing in "
                    f"epoch {self.grid.membership.epoch}. The default (compute_loss=True, reduce_output='avg') runs "
                    "over the live workers"
                )
            return super().eval_batch(
                data_iter, return_logits, compute_loss, reduce_output, bcast_loss, num_micro_batches
            )
        began = time.time()
        micro_batches = num_micro_batches or self.micro_batches
        evaluation = Evaluation(EvalData.of(data_iter), micro_batches, key=self._next_eval_key())
        self.evaluation = evaluation
        while True:
            try:
                loss = self._run_evaluation(evaluation, return_logits)
                self._commit_evaluation(evaluation, loss)
                break
            except PeerFailure as failure:
                if self.runtime is None:
                    raise
                # At a boundary every survivor has finished the same iteration: the recovery
                # restarts from it, undoes nothing, and enters the epoch without the dead.
                self._drop_evaluation()
                self.runtime.recover_or_stop(failure)
                loss = self._committed_loss(evaluation)
                if loss is not None:
                    evaluation.from_peer = True
                    self.outputs = None
                    break
        evaluation.seconds = time.time() - began
        if self.monitor.enabled and self.is_lowest_live_rank():
            self.monitor.write_events([("Train/Samples/eval_loss", loss.item(), self.global_samples)])
        if return_logits:
            outputs, self.outputs = getattr(self, "outputs", None), None
            return loss, outputs
        return loss

    def _next_eval_key(self) -> str:
        iteration, count = self._evals_at
        count = count + 1 if iteration == self.global_steps else 0
        self._evals_at = (self.global_steps, count)
        generation = os.environ.get("DS_RECYCLE_GENERATION", "0")
        return json.dumps([generation, self.grid.membership.epoch, self.global_steps, count])

    def _commit_evaluation(self, evaluation: Evaluation, loss: torch.Tensor) -> None:
        """Under ds-recycle launch, tell the job's store that this batch is done, and its loss,
        before leaving it. A failure announced while the last collective completes can interrupt
        some survivors after others have passed it: after their recovery those take the loss from
        here instead of running the batch again, and every survivor goes on to the same iteration."""
        if self.runtime is not None:
            self.runtime.agent.store.set(EVAL_COMMITTED, json.dumps({"key": evaluation.key, "loss": float(loss)}))

    def _committed_loss(self, evaluation: Evaluation) -> torch.Tensor | None:
        store = self.runtime.agent.store
        if not store.check([EVAL_COMMITTED]):
            return None
        committed = json.loads(store.get(EVAL_COMMITTED))
        if committed["key"] != evaluation.key:
            return None
        return torch.tensor(committed["loss"], dtype=torch.float32, device=self.device)

    def _run_evaluation(self, evaluation: Evaluation, return_logits: bool) -> torch.Tensor:
        evaluation.attempts += 1
        self._refresh_memory_cap()  # a joiner's first call may be an evaluation: it plans with the others' cap
        evaluation.failed = self.grid.failed
        evaluation.forwards, evaluation.losses = [], {}
        stream = self._eval_stream(evaluation.micro_batches, evaluation.data)
        self.module.eval()
        self._compute_loss = True
        self.eval_return_logits = return_logits
        self.outputs = None
        self._evaluating = True
        try:
            with torch.no_grad():
                self._exec_schedule(
                    ForwardOnlySchedule(stream, evaluation.micro_batches, self.num_stages, self.stage_id)
                )
                self.channel.wait_sends()
                return self._eval_loss(evaluation)
        finally:
            self._evaluating = False
            self.eval_return_logits = False
            self._drop_evaluation()

    def _drop_evaluation(self) -> None:
        for key in self.pipe_buffers:
            self.pipe_buffers[key] = [None] * len(self.pipe_buffers[key])
        self.total_loss = None
        self.fwd_outputs = []

    def _eval_stream(self, micro_batches: int, data: EvalData) -> WorkerStream:
        failed = self.grid.failed
        costs = self._cost_model()
        if data.source is None and costs.slow:
            # Routing around a straggler hands its micro-batches to another pipeline, and eval data
            # from an iterator holds only its own pipeline's: there a straggler evaluates its own.
            costs = replace(costs, slow=())
        key = (failed, micro_batches, costs.slow)
        if key not in self._eval_streams:
            self._eval_streams[key] = lower_forward_only(self._plan_for(failed, costs, micro_batches))
        streams = self._eval_streams[key]
        if data.source is None:
            foreign = [
                (worker, action)
                for worker, stream in streams.items()
                for action in stream.actions
                if isinstance(action, actions.LoadMicroBatch) and action.home != worker[0]
            ]
            if foreign:
                worker, action = foreign[0]
                raise RecycleDataError(
                    f"evaluation with workers {list(failed)} missing has worker {worker} load micro-batch "
                    f"({action.home},{action.mb}) of another pipeline, but eval data comes from an iterator, which "
                    "holds only its own pipeline's micro-batches; pass a callable (home, mb) -> batch to eval_batch "
                    "to evaluate while a first- or last-stage worker is missing"
                )
        return streams[self.worker]

    def _eval_loss(self, evaluation: Evaluation) -> torch.Tensor:
        """DeepSpeed's reduction: per pipeline the sum of its micro-batches' losses in order over
        m (in the loss's dtype), then the all-reduce over the pipelines divided by D, then sent to
        every stage as fp32. A missing last-stage worker's pipeline is summed by the live worker
        that stands in for it (``grid.partner``), after the last stage's workers have shared every
        micro-batch's loss."""
        grid, m = self.grid, evaluation.micro_batches
        last = self.num_stages - 1
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.is_last_stage():
            dtype = next(iter(evaluation.losses.values())).dtype if evaluation.losses else torch.float32
            table = torch.zeros(grid.data_parallel_size, m, dtype=torch.float32, device=self.device)
            for (home, mb), value in evaluation.losses.items():
                if value.numel() != 1:
                    raise RuntimeError(f"eval_batch over the live workers needs a scalar loss, got shape {value.shape}")
                table[home, mb] = value
            group = grid.get_data_parallel_group()
            if grid.failed:  # exact: each entry is one worker's loss and zeros elsewhere
                self.waiter.collective(
                    lambda: torch.distributed.all_reduce(table, group=group, async_op=True), "the eval losses' exchange"
                )
            losses = table.to(dtype)  # exact: the losses were of this dtype
            total = None
            for home in grid.served_by(self.worker):
                mean = sum(losses[home, mb] for mb in range(m)) / m
                total = mean if total is None else total + mean
            if grid.data_parallel_size > 1:
                self.waiter.collective(
                    lambda: torch.distributed.all_reduce(total, group=group, async_op=True), "the eval loss all-reduce"
                )
                total /= grid.data_parallel_size
            loss = total.clone().detach().float()
        source = grid.rank_of(grid.live_workers(last)[0])
        self.waiter.collective(
            lambda: torch.distributed.broadcast(loss, src=source, async_op=True), "the eval loss broadcast"
        )
        return loss

    def _train_schedule(self):
        if not self.recycle.enabled:
            return super()._train_schedule()
        self._refresh_costs()
        self._refresh_memory_cap()
        return PlannedSchedule(self._current_plan_and_stream()[1], self.micro_batches, self.num_stages, self.stage_id)

    def _schedule_options(self) -> ScheduleOptions:
        return ScheduleOptions(decoupled=self.recycle.decoupled_backprop, staggered=self.recycle.staggered_optimizer)

    def _cost_model(self) -> CostModel:
        """The planner's costs: measured (``recycle.profile``) once the replicas agreed on a profile,
        before that ``recycle.emulate_timing``'s durations, else unit costs."""
        return self.cost_tracker.in_use

    def _base_cost_model(self) -> CostModel:
        timing, P = self.recycle.emulate_timing, self.num_stages
        if timing is None or timing.planner_costs == "unit":
            return CostModel.uniform(P)
        if not any(timing.milliseconds(k, s) > 0 for k in "FBW" for s in range(P)):
            return CostModel.uniform(P)
        return CostModel(*(tuple(timing.milliseconds(k, s) for s in range(P)) for k in "FBW"))

    def _setup_profile(self) -> None:
        timing, D, P = self.recycle.emulate_timing, self.grid.data_parallel_size, self.num_stages
        if timing is not None:
            timing.check_topology(D, P)
        base = self._base_cost_model()
        measured = base != CostModel.uniform(P)
        self.cost_tracker = CostTracker(base, self.recycle.profile, self.recycle.stragglers, measured=measured)
        self.cost_changes: list[CostChange] = []
        self._op_times = OpTimes(self.recycle.profile.window)
        self._profile_epoch: int | None = None

    def _refresh_costs(self) -> None:
        """At the start of an iteration (every ``profile.interval`` after the warm-up, and the first
        of every epoch) the live workers agree on their measured op times and the tracker's state
        (:func:`~ds_recycle.engine.profile.agree`, all-reduces over the world); a drift or a
        straggler change gives every rank the same new cost model, and the iteration runs on the plan
        for it. Every rank does this at the same iteration, so all switch together."""
        config, i, epoch = self.recycle.profile, self.global_steps, self.grid.membership.epoch
        due = (i - config.warmup - 1) % config.interval == 0 or epoch != self._profile_epoch
        if not config.enabled or i <= config.warmup or not due:
            return
        self._profile_epoch = epoch
        D, P = self.grid.data_parallel_size, self.num_stages

        def all_reduce(table: torch.Tensor) -> None:
            self.waiter.collective(lambda: torch.distributed.all_reduce(table, async_op=True), "the profile exchange")

        held = self.cost_tracker.in_use
        profile = agree(self.cost_tracker, self._op_times.row(), self.worker, D, P, all_reduce, self.device)
        # without training_data only a pipeline's own first and last stage can load its micro-batches
        inner = range(P) if self.micro_batch_source is not None else range(1, P - 1)
        self.cost_tracker.straggler_stages = set(inner)
        decision = self.cost_tracker.update(profile)
        if decision.costs is None and self.cost_tracker.in_use == held:
            return
        # new costs: decided now, or taken over from the others in the agreement (a joiner)
        before = self.plan
        self._stream_cache.clear()
        getattr(self, "_eval_streams", {}).clear()
        self._fault_free_time = None
        self._switch_plan()
        if decision.costs is None:
            return
        doing_nothing = retime(_with_costs(before, decision.costs)).iteration_time
        change = CostChange(
            i,
            tuple(decision.reasons),
            decision.costs,
            tuple(decision.changes),
            self.plan.iteration_time,
            self.fault_free_iteration_time(),
            doing_nothing,
        )
        self.cost_changes.append(change)
        if self.is_lowest_live_rank():
            self._log_cost_change(change)
            if self.runtime is not None:
                self.runtime.publish_status()

    def _setup_memory_cap(self) -> None:
        """``recycle.memory_limit_gb``, or on a GPU the device's memory, makes a memory cap
        (:mod:`~ds_recycle.engine.memory_cap`); without either (CPU, no key) there is none."""
        self._memory_limit = limit_bytes(self.recycle.memory_limit_gb)
        self._memory_budgeted = self._memory_limit is not None or self.device.type == "cuda"
        audit = os.environ.get(AUDIT_ENV) == "1"
        params = list(self.module.parameters())
        self.held_meter = HeldMeter(params, audit=audit) if self._memory_budgeted or audit else None
        self.memory_budget: MemoryBudget | None = None
        """The agreed bytes and caps of every stage (None: no cap, or not measured yet)."""
        self._memory_epoch: int | None = None
        self._memory_row: BudgetRow | None = None

    def _refresh_memory_cap(self) -> None:
        """At the start of the first iteration (or evaluation) of every epoch after this job's first
        iteration (which measures), the live workers agree on the bytes of every stage (one
        all-reduce over the world); until every stage has a measured replica, at the start of every
        iteration. Whether it runs depends only on the epoch, the iteration and whether this epoch
        has agreed, which every member shares. A change of the planner's cap re-plans, on every rank
        at the same boundary."""
        epoch = self.grid.membership.epoch
        if not self._memory_budgeted or self.global_steps < 1 or self._memory_epoch == epoch:
            return
        D, P = self.grid.data_parallel_size, self.num_stages
        if self._memory_row is None and self.held_meter.per_microbatch is not None:
            limit = self._memory_limit if self._memory_limit is not None else device_budget(self.device)
            static = static_bytes(self.module, self.optimizer, self.device)
            self._memory_row = BudgetRow(1.0, 1.0, float(self.held_meter.per_microbatch), float(static), float(limit))
        row = self._memory_row or BudgetRow(
            static=float(static_bytes(self.module, self.optimizer, self.device)),
            limit=float(self._memory_limit if self._memory_limit is not None else device_budget(self.device)),
        )

        def all_reduce(table: torch.Tensor) -> None:
            self.waiter.collective(lambda: torch.distributed.all_reduce(table, async_op=True), "the memory exchange")

        budget = agree_budget(row, self.worker, D, P, all_reduce, self.device)
        if budget is None:
            return
        self._memory_epoch = epoch
        first, before = self.memory_budget is None, self._failure_cap()
        self.memory_budget = budget
        if first and self.is_lowest_live_rank():
            self._log_memory_budget(budget)
        if first or budget.planner_cap() != before:
            self._stream_cache.clear()
            self._eval_streams.clear()
            self._fault_free_time = None
            self._switch_plan()

    def _log_memory_budget(self, budget: MemoryBudget) -> None:
        cap = budget.planner_cap()
        if cap is None:
            planner = f"memory does not bind: the planner keeps its cap of {self.num_stages} (the peak of 1F1B)"
        elif cap < 1:
            planner = "no plan fits (a stage cannot hold one micro-batch)"
        else:
            planner = f"the planner's cap is {cap} micro-batches in flight per worker"
        logger.info(f"ReCycle: memory per worker, in bytes: {budget.describe()}; {planner}")
        D, P, m = self.grid.data_parallel_size, self.num_stages, self.micro_batches
        need = peak_in_flight(fault_free_plan(D, P, m, costs=self._cost_model(), options=self._schedule_options()))
        over = budget.over(need)
        if not over:
            return
        (worker, held, _), *_ = over
        if budget.least >= 1:
            what = (
                f"worker {worker} holds {held} micro-batches in flight and {budget.shortfall(worker[1], held)}; "
                f"every plan runs under a cap of {budget.least} micro-batches (slower than the fault-free schedule)"
            )
        else:
            stage = min(range(P), key=lambda s: budget.stages[s].cap)
            what = (
                f"not even one micro-batch fits: {budget.shortfall(stage, 1)}; the fault-free plan stays as it is "
                "(over the limit), and a failure takes the fallback of a lost stage"
            )
        logger.warning(f"ReCycle: the fault-free schedule does not fit in memory: {what}")

    def _log_cost_change(self, change: CostChange) -> None:
        plan, ff, nothing = change.predicted, change.fault_free, change.doing_nothing
        versus = (
            f"predicted {plan:.1f} ({plan / ff:.3f}x fault-free {ff:.1f}; "
            f"doing nothing {nothing:.1f} = {nothing / ff:.3f}x)"
        )
        failed = f" with workers {list(self.grid.failed)} failed" if self.grid.failed else ""
        for straggler in change.changes:
            what = "planned as a straggler" if straggler.detected else "released (no longer a straggler)"
            give = self.plan.extra.get("give", {}).get(f"{straggler.worker[0]},{straggler.worker[1]}", 0)
            logger.info(
                f"ReCycle: worker {straggler.worker} {what} at iteration {change.iteration}: its ops take "
                f"{straggler.slowdown:.2f}x its stage peers'; it runs {self.micro_batches - give} of "
                f"{self.micro_batches} micro-batches{failed}; new plan {versus}"
            )
        if not change.changes:
            costs = change.costs
            logger.info(
                f"ReCycle: new plan from measured costs at iteration {change.iteration} ({'; '.join(change.reasons)}): "
                f"F {list(costs.F)} B {list(costs.B)} W {list(costs.W)} step {costs.step} ms{failed}; {versus}"
            )

    def _current_plan_and_stream(self) -> tuple[Plan, WorkerStream]:
        failed = self.grid.failed
        if failed not in self._stream_cache:
            plan = self._plan_for(failed, self._cost_model(), self.micro_batches)
            self._stream_cache[failed] = (plan, lower(plan)[self.worker])
        return self._stream_cache[failed]

    def _plan_for(self, failed: tuple[Worker, ...], costs: CostModel, micro_batches: int) -> Plan:
        """The plan of ``failed`` under the memory cap: from the plan cache when workers are
        missing or a straggler is routed around (as a failure is), else the fault-free plan.
        Raises :class:`MemoryCapError` when the plan of a failure set cannot fit."""
        D, P, options = self.grid.data_parallel_size, self.num_stages, self._schedule_options()
        budget, cap = self.memory_budget, self._failure_cap()
        plannable = cap is None or cap >= 1
        if not failed and (not costs.slow or not plannable):  # no straggler is routed around where nothing fits
            plan = fault_free_plan(D, P, micro_batches, costs=costs, options=options)
            if budget is not None and budget.least >= 1 and budget.over(peak_in_flight(plan)):
                plan = fault_free_plan(D, P, micro_batches, costs, budget.least, options)
            return plan
        if not plannable:
            raise self._cannot_fit(failed, cap, "not even one micro-batch fits beside the static bytes")
        try:
            plan = self.plan_cache.get_or_plan(D, P, micro_batches, failed, costs, cap, options)
        except ValueError as error:
            if cap is None or isinstance(error, NoSurvivorError):
                raise
            raise self._cannot_fit(failed, cap, f"the planner found no schedule under it ({error})") from error
        over = budget.over(peak_in_flight(plan)) if budget is not None else []
        if over:
            (worker, held, stage_cap), *_ = over
            raise self._cannot_fit(failed, cap, f"its plan has worker {worker} hold {held} (stage cap {stage_cap})")
        return plan

    def _failure_cap(self) -> int | None:
        """The planner's cap for plans that re-route (None: its default, P)."""
        return None if self.memory_budget is None else self.memory_budget.planner_cap()

    def _cannot_fit(self, failed: tuple[Worker, ...], cap: int, why: str) -> MemoryCapError:
        budget = self.memory_budget
        stage = min(range(self.num_stages), key=lambda s: budget.stages[s].cap)
        config, tag = self.recycle.checkpoint, checkpoints.latest_tag(self.recycle.checkpoint)
        if config is None:
            after = "no checkpoint is configured (recycle.checkpoint), so the job stops here"
        elif tag is None:
            after = f"no checkpoint was written yet in {config.dir}, so the job stops here"
        else:
            after = f"every rank restarts from checkpoint {tag} in {config.dir} (ds-recycle launch --respawn)"
        return MemoryCapError(
            f"the plan for failure set {list(failed)} cannot fit in memory: memory cap {cap} micro-batches in "
            f"flight per worker, {why}; {budget.shortfall(stage, 1)}. Last finished iteration: "
            f"{self.global_steps}; {after}"
        )

    def predicted_iteration_time(self, failed: tuple[Worker, ...]) -> float:
        """The planner's iteration time for the failure set ``failed`` on the costs in use (what a
        migration's gain is judged by); infinite when its plan cannot fit in memory."""
        D, P, m = self.grid.data_parallel_size, self.num_stages, self.micro_batches
        cap = self._failure_cap()
        if cap is not None and cap < 1:
            return math.inf
        plan = self.plan_cache.get_or_plan(
            D, P, m, tuple(sorted(failed)), self._cost_model(), cap, self._schedule_options()
        )
        return plan.iteration_time

    def fault_free_iteration_time(self) -> float:
        if self._fault_free_time is None:
            plan = self._plan_for((), self._cost_model().without_stragglers(), self.micro_batches)
            self._fault_free_time = plan.iteration_time
        return self._fault_free_time

    def _exec_schedule(self, pipe_schedule):
        if self.recycle.enabled and isinstance(pipe_schedule, PlannedSchedule):
            # Every live worker starts the iteration (or evaluation) on the same plan: connecting
            # here connects each pair the plan adds from both of its workers at once.
            step_peers = self.stepper.peers if pipe_schedule.trains else set()
            self.channel.connect(pipe_schedule.peers | step_peers, self.global_steps)
        self._reserve_pipe_buffers(pipe_schedule.num_pipe_buffers())
        self.fwd_outputs = []
        self.instruction_events = []
        emulation = self.recycle.emulate_timing
        worker = self.worker if self.recycle.enabled else (self.grid.get_data_parallel_id(), self.stage_id)
        for step_cmds in pipe_schedule:
            for cmd in step_cmds:
                if type(cmd) not in self._INSTRUCTION_MAP:
                    raise RuntimeError(f"{self.__class__.__name__} does not understand instruction {cmd!r}")
                started = time.time()
                self._exec_instr = MethodType(self._INSTRUCTION_MAP[type(cmd)], self)
                self._exec_instr(**cmd.kwargs)
                pad_to(cmd, started, emulation, worker)
                self.instruction_events.append(event_of(cmd, started, time.time()))
        if self.recycle.enabled and isinstance(pipe_schedule, PlannedSchedule) and pipe_schedule.trains:
            started = time.time()
            self.stepper.finish_iteration()
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
            self.instruction_events.append(InstructionEvent("FinishIteration", -1, -1, started, time.time()))
            if self.global_steps > self.recycle.profile.warmup:
                self._op_times.record(self.instruction_events)
            if self.held_meter is not None and self.held_meter.audit:
                self._log_memory_audit()

    def _log_memory_audit(self) -> None:
        """One line per iteration (``DS_RECYCLE_MEMORY_AUDIT=1``): the most micro-batches this
        worker held in flight, from the executed instructions, and the most bytes they held."""
        budget, held = self.memory_budget, self.held_meter.take_peak()
        cap = self._failure_cap() if budget is not None else None
        stage = budget.stages[self.stage_id] if budget is not None else None
        logger.info(
            f"ReCycle memory audit: worker {self.worker} iteration {self.global_steps - 1} epoch "
            f"{self.grid.membership.epoch}: in flight at most {executed_peak(self.instruction_events)} "
            f"(plan cap {self.plan.memory_cap}, planner cap {cap}, stage cap {stage.cap if stage else None}); "
            f"held at most {held} bytes + static {stage.static if stage else None} of limit "
            f"{stage.limit if stage else None}"
        )

    def allreduce_bucket(self, bucket, dp_group, dp_world_size=None):
        """DeepSpeed's data-parallel gradient reduction, with the same arithmetic, waited for
        failure-aware (DeepSpeed's blocking all-reduce would hang on a dead peer)."""
        if not self.recycle.enabled:
            return super().allreduce_bucket(bucket, dp_group, dp_world_size)
        tensor = self.flatten(bucket)
        reduced = tensor if self.communication_data_type == tensor.dtype else tensor.to(self.communication_data_type)
        size = dp_world_size or torch.distributed.get_world_size(group=dp_group)

        def all_reduce():
            self.waiter.collective(
                lambda: torch.distributed.all_reduce(reduced, group=dp_group, async_op=True),
                f"the data-parallel all-reduce of stage {self.stage_id}",
            )

        if not self.gradient_average:
            all_reduce()
        elif self.postscale_gradients():
            if self.gradient_predivide_factor() != 1.0:
                reduced.mul_(1.0 / self.gradient_predivide_factor())
            all_reduce()
            if self.gradient_predivide_factor() != size:
                reduced.mul_(self.gradient_predivide_factor() / size)
        else:
            reduced.mul_(1.0 / size)
            all_reduce()
        if reduced is not tensor:
            tensor.copy_(reduced)
        return tensor

    # ---- loss -------------------------------------------------------------------------------

    def aggregate_last_stage_loss(self) -> torch.Tensor:
        """[this pipeline's mean loss, the mean over all pipelines], as stock DeepSpeed computes them."""
        loss = self._scale_loss_by_gas(self.total_loss)
        self.dp_group_loss = loss.clone().detach()
        agg_loss = self.dp_group_loss.clone().detach()
        if self.is_data_parallel:
            group = self.mpu.get_data_parallel_group()
            self.waiter.collective(
                lambda: torch.distributed.all_reduce(agg_loss, group=group, async_op=True), "the loss all-reduce"
            )
            agg_loss /= self.dp_world_size
        self._own_loss = torch.stack([self.dp_group_loss, agg_loss]).float()
        return self._own_loss

    def _aggregate_total_loss(self):
        if not self.recycle.enabled:
            return super()._aggregate_total_loss()
        self.agg_additional_losses = None
        losses = self._own_loss if self.is_last_stage() else self.stepper.receive_loss()
        self.dp_group_loss = losses[0].clone().detach()
        return losses[1].clone().detach()

    # ---- instructions -----------------------------------------------------------------------

    def _exec_load(self, buffer_id: int, home: int, mb: int):
        if self._evaluating:
            self._load(buffer_id, self.evaluation.data.get(home, mb, self.worker[0]))
            return
        if self.micro_batch_source is not None:
            self._load(buffer_id, self.micro_batch_source(self.global_steps, home, mb))
            return
        if home != self.worker[0]:
            raise RecycleDataError(
                f"micro-batch ({home},{mb}) belongs to another pipeline and data comes from an iterator"
            )
        # An iteration that a failure interrupted runs again: replay what it read from the iterator.
        loaded = self._loaded.setdefault(self.global_steps, [])
        for old in [i for i in self._loaded if i < self.global_steps - 1]:
            del self._loaded[old]
        if mb == len(loaded):
            loaded.append(next(self.data_iterator))
        elif mb > len(loaded):
            raise RuntimeError(f"schedule loads micro-batch {mb} but the data iterator is at {len(loaded)}")
        self._load(buffer_id, loaded[mb])

    def _load(self, buffer_id: int, batch) -> None:
        """DeepSpeed's own loading (inputs on the first stage, labels on the last) of ``batch``."""
        iterator = self.data_iterator
        self.data_iterator = iter((batch,))
        try:
            PipelineEngine._exec_load_micro_batch(self, buffer_id)
        finally:
            self.data_iterator = iterator

    def _exec_forward(self, buffer_id: int, home: int, mb: int):
        if self._evaluating:
            self.evaluation.forwards.append((home, mb))
            PipelineEngine._exec_forward_pass(self, buffer_id)
            if self.is_last_stage():
                self.evaluation.losses[(home, mb)] = self.loss.detach()
            return
        if self.forward_ledger is not None:
            self.forward_ledger.append((self.global_steps, home, mb, self.stage_id))
        meter = self.held_meter
        probe = [] if meter is not None and meter.wants() else None
        self._weight_path.probe = probe
        try:
            PipelineEngine._exec_forward_pass(self, buffer_id)
        finally:
            self._weight_path.probe = None
        if self.is_last_stage():
            self.pipe_buffers["losses"][buffer_id] = self.loss
        if probe is not None:
            ends = [self.loss] if self.is_last_stage() else _as_tuple(self.pipe_buffers["outputs"][buffer_id])
            roots = [t.grad_fn for t in ends if isinstance(t, torch.Tensor)]
            meter.after_forward(buffer_id, roots, probe, functools.partial(self._held_buffers, buffer_id))

    def _held_buffers(self, buffer_id: int) -> list:
        """What the engine's buffers hold of the micro-batch in ``buffer_id`` (memory accounting)."""
        keys = ("inputs", "labels", "outputs", "grads", "input_grads", "losses")
        return [self.pipe_buffers[key][buffer_id] for key in keys]

    def _exec_send_activation(self, buffer_id: int, home: int, mb: int, peer):
        outputs = autocast_p2p.activations_to_wire(_as_tuple(self.pipe_buffers["outputs"][buffer_id]), self._wire)
        self.channel.send(outputs, peer, ACTIVATION, home, mb)

    def _exec_recv_activation(self, buffer_id: int, home: int, mb: int, peer):
        received = self.channel.recv_activation(peer, home, mb)
        for tensor in received:
            tensor.requires_grad = tensor.is_floating_point()
        self.pipe_buffers["inputs"][buffer_id] = received[0] if len(received) == 1 else received

    def _exec_recv_grad(self, buffer_id: int, home: int, mb: int, peer):
        outputs = _as_tuple(self.pipe_buffers["outputs"][buffer_id])
        grads = self.channel.recv_into(autocast_p2p.grad_buffers(outputs, self._wire), peer, GRADIENT, home, mb)
        self.pipe_buffers["grads"][buffer_id] = autocast_p2p.grads_from_wire(grads, outputs)

    def _exec_backward_input(self, buffer_id: int, home: int, mb: int):
        inputs = _as_tuple(self.pipe_buffers["inputs"][buffer_id])
        if self.is_last_stage():
            outputs, grads = [self.pipe_buffers["losses"][buffer_id]], None
        else:
            outputs = [t for t in _as_tuple(self.pipe_buffers["outputs"][buffer_id]) if t.is_floating_point()]
            grads = self.pipe_buffers["grads"][buffer_id]
        self._running_engine_backward = True
        try:
            input_grads, work = backward_input(outputs, grads, inputs, self._trainable, path=self._weight_path)
        finally:
            self._running_engine_backward = False
        self.pipe_buffers["input_grads"][buffer_id] = input_grads
        self.pipe_buffers["weight_work"][buffer_id] = work
        for key in ("outputs", "grads", "losses"):
            self.pipe_buffers[key][buffer_id] = None
        if self.held_meter is not None:
            self.held_meter.after_backward_input(buffer_id, work)

    def _exec_send_grad(self, buffer_id: int, home: int, mb: int, peer):
        inputs = _as_tuple(self.pipe_buffers["inputs"][buffer_id])
        input_grads = self.pipe_buffers["input_grads"][buffer_id]
        grads = tuple(
            g if g is not None else torch.zeros_like(x)
            for x, g in zip(inputs, input_grads, strict=True)
            if x.is_floating_point()
        )
        self.channel.send(grads, peer, GRADIENT, home, mb)
        self.pipe_buffers["input_grads"][buffer_id] = None

    def _exec_backward_weight(self, buffer_id: int, home: int, mb: int):
        self._running_engine_backward = True
        try:
            backward_weight(self.pipe_buffers["weight_work"][buffer_id])
        finally:
            self._running_engine_backward = False
        for key in ("weight_work", "inputs", "labels", "input_grads"):
            self.pipe_buffers[key][buffer_id] = None
        if self.held_meter is not None:
            self.held_meter.after_backward_weight(buffer_id)

    def _exec_staggered_step(self):
        self.stepper.step()

    _INSTRUCTION_MAP = {
        **PipelineEngine._INSTRUCTION_MAP,
        LoadMicroBatch: _exec_load,
        ForwardPass: _exec_forward,
        SendActivation: _exec_send_activation,
        RecvActivation: _exec_recv_activation,
        RecvGrad: _exec_recv_grad,
        BackwardInput: _exec_backward_input,
        SendGrad: _exec_send_grad,
        BackwardWeight: _exec_backward_weight,
        StaggeredStep: _exec_staggered_step,
    }


def _with_costs(plan: Plan, costs: CostModel) -> Plan:
    out = copy.copy(plan)
    out.costs = costs
    return out


def _as_tuple(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)
