"""RecyclePipelineEngine: DeepSpeed's PipelineEngine running ReCycle's planned schedules.

Each ``train_batch`` runs this worker's instruction stream, lowered from the plan for the current
failure set: routed transfers, BackwardInput with BackwardWeight deferred into bubbles, and a
StaggeredStep. The instructions run through this class's own instruction map. Without a
``recycle`` section, or with ``enabled: false``, it is DeepSpeed's engine, running DeepSpeed's
schedule.

The engine is a small core: wiring, the schedule, the instruction handlers, the reductions, and
the two entry points of a membership change (:meth:`install_grid`, :meth:`roll_back_to`). Its
collaborators each own one concern:

- :class:`~ds_recycle.engine.plan_book.PlanBook` (``plans``): the plan and stream of the current
  failure set, costs and memory budget, and the plans of the next failures made ahead;
- :class:`~ds_recycle.engine.cost_profiler.CostProfiler` (``costs``) and
  :class:`~ds_recycle.engine.memory_governor.MemoryGovernor` (``memory``): measured costs and
  memory caps, agreed by the live workers at a boundary in one all-reduce
  (:meth:`agree_at_boundary`), which tells the plan book once;
- :class:`~ds_recycle.engine.evaluator.Evaluator`: ``eval_batch`` over the live workers;
- :class:`~ds_recycle.engine.checkpoint.Checkpointer`: checkpoints a degraded job can write;
- :class:`~ds_recycle.engine.feed.MicroBatchFeed`: where the training micro-batches come from;
- :class:`~ds_recycle.engine.staggered_step.StageStepper` and
  :class:`~ds_recycle.engine.routing.PeerChannel`: the staggered step and routed transfers.

Under ``ds-recycle launch``, ``ds_recycle.initialize`` hands the engine the rank's
:class:`~ds_recycle.runtime.rank.recovery.RankRuntime`, the one owner of the failure path: every
``train_batch`` and ``eval_batch`` runs through it.
"""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Callable
from types import MethodType, SimpleNamespace
from typing import Protocol, TypeVar

import torch
import torch.utils.checkpoint
from deepspeed.runtime.pipe import p2p, schedule
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.utils import groups

from ds_recycle.config import RecycleConfig, RecycleConfigError
from ds_recycle.engine import autocast_p2p
from ds_recycle.engine.backward_split import backward_input, backward_weight
from ds_recycle.engine.checkpoint import Checkpointer
from ds_recycle.engine.cost_profiler import CostProfiler
from ds_recycle.engine.evaluator import Evaluator
from ds_recycle.engine.feed import MicroBatchFeed
from ds_recycle.engine.memory_governor import MemoryGovernor
from ds_recycle.engine.plan_book import PlanBook
from ds_recycle.engine.profile import CostChange, exchange_sections
from ds_recycle.engine.routing import ACTIVATION, GRADIENT, PeerChannel
from ds_recycle.engine.staggered_step import StageStepper
from ds_recycle.engine.timing import InstructionEvent, event_of, pad_to
from ds_recycle.engine.weight_grad import install_weight_grad_path
from ds_recycle.errors import RecycleDataError
from ds_recycle.log import logger
from ds_recycle.planner.actions import (
    BackwardInput,
    BackwardWeight,
    ForwardPass,
    LoadMicroBatch,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
    StaggeredStep,
    TransferAction,
)
from ds_recycle.planner.fault_free import fault_free_plan
from ds_recycle.planner.list_scheduler import ScheduleOptions
from ds_recycle.planner.lowering import WorkerStream
from ds_recycle.planner.simulate import retime
from ds_recycle.runtime.rank.groups import GROUP_TIMEOUT_SECONDS, RecycleGrid, bury
from ds_recycle.runtime.rank.waiting import Waiter
from ds_recycle.runtime.shared import placement
from ds_recycle.runtime.shared.events import IterationStats, MembershipChange, Monitor, PlanSummary
from ds_recycle.runtime.shared.records import Membership


class Runtime(Protocol):
    """What the engine calls of the rank's runtime (:class:`~ds_recycle.runtime.rank.recovery.RankRuntime`),
    which ``ds_recycle.initialize`` hands it under ``ds-recycle launch``."""

    job: object
    """The job's store (:class:`~ds_recycle.runtime.shared.job_store.JobStore`): evaluations commit there."""

    def attach(self, engine: RecyclePipelineEngine) -> None: ...

    def run(self, attempt: Callable[[], object], resume: Callable[[], object | None] = ...) -> object: ...

    def train_batch(self, run: Callable[[], torch.Tensor], checkpoint: Callable[[], None]) -> torch.Tensor: ...

    def between_iterations(self, call: Callable[[], object], what: str) -> object: ...

    def publish_status(self) -> None: ...


T = TypeVar("T")

_EXTRA_BUFFERS = ("losses", "grads", "input_grads", "weight_work")
TRAIN_BATCH_TIMER = "train_batch"


class PlannedSchedule(schedule.PipeSchedule):
    """One worker's lowered stream, one action per step (the engine's instruction map runs actions)."""

    def __init__(self, stream: WorkerStream, micro_batches: int, stages: int, stage_id: int, trains: bool = True):
        super().__init__(micro_batches, stages, stage_id)
        self.trains = trains
        """Running it is an iteration of training (the engine finishes the iteration after it)."""
        self.num_buffers = stream.num_buffers
        self.actions = stream.actions
        self.peers = {action.peer for action in stream.actions if isinstance(action, TransferAction)}
        """The workers this stream sends to or receives from."""

    def num_pipe_buffers(self) -> int:
        return self.num_buffers

    def steps(self):
        for action in self.actions:
            yield [action]


class RecyclePipelineEngine(PipelineEngine):
    def __init__(
        self,
        *args,
        recycle_config: RecycleConfig | None = None,
        micro_batch_source=None,
        runtime: Runtime | None = None,
        **kwargs,
    ):
        self.recycle = recycle_config or RecycleConfig()
        super().__init__(*args, **kwargs)
        self.instruction_events: list[InstructionEvent] = []
        self.runtime = runtime
        """The rank's membership protocol under ds-recycle launch (None under any other launcher)."""
        if not self.recycle.enabled:
            return
        self._check_supported()
        for key in _EXTRA_BUFFERS:
            self.pipe_buffers[key] = [None] * self.num_pipe_buffers
        self.slot = self.global_rank
        topo = self.module._topo
        D, P = topo.get_dim("data"), self.num_stages
        worker = (topo.get_coord(self.slot).data, topo.get_coord(self.slot).pipe)
        self.feed = MicroBatchFeed(micro_batch_source)
        self.forward_ledger: list[tuple[int, int, int, int]] | None = None
        """Set to a list to record (iteration, home, mb, stage) of every F this worker runs."""
        self.monitors: list[Monitor] = []
        self.rejoin_client_state = None
        """Set by a training loop above the engine: a callable whose result is sent to a joiner with
        the engine's state."""
        self.received_client_state: object = None
        """In a joiner: the ``rejoin_client_state()`` of the replica it copied its state from."""
        self.membership_changes: list[MembershipChange] = []
        self.options = ScheduleOptions(
            decoupled=self.recycle.decoupled_backprop, staggered=self.recycle.staggered_optimizer
        )
        prefetch = self.recycle.prefetch_plans and runtime is not None
        self.plans = PlanBook(D, P, worker, self.options, prefetch, _node_workers(topo))
        self.costs = CostProfiler(self.recycle, D, P)
        self.memory = MemoryGovernor(self.recycle.memory_limit_gb, self.module, self.device)
        self.evaluator = Evaluator(self)
        self.checkpointer = Checkpointer(self, functools.partial(PipelineEngine.save_checkpoint, self))
        self._trainable = [p for p in self.module.parameters() if p.requires_grad]
        self._weight_path = install_weight_grad_path(self.module)
        self._wire = autocast_p2p.wire_dtype(self)
        logger.info(f"ReCycle W path on stage {self.stage_id}: {self._weight_path.describe()}")
        self._own_loss: torch.Tensor | None = None
        self.waiter = Waiter()
        everyone = Membership(0, tuple(range(topo.world_size())), 0)
        self.install_grid(RecycleGrid.build(topo, everyone, self.slot, GROUP_TIMEOUT_SECONDS))
        logger.info(
            f"ReCycle engine on worker (pipeline {self.worker[0]}, stage {self.worker[1]}): "
            f"decoupled_backprop={self.recycle.decoupled_backprop} "
            f"staggered_optimizer={self.recycle.staggered_optimizer} "
            f"membership={'ds-recycle launch' if runtime else 'static (no coordinator)'}"
        )
        if runtime is not None:
            runtime.attach(self)

    # ---- what the rank's runtime (ds_recycle.runtime.rank.recovery) uses --------------------------------

    @property
    def worker(self) -> tuple[int, int]:
        return self.grid.worker

    @property
    def topology(self):
        """The job's topology of slots (DeepSpeed's PipeDataParallelTopology)."""
        return self.module._topo

    @property
    def stepped_inflight(self) -> bool:
        return self.stepper.stepped_inflight

    @property
    def cost_unit(self) -> str:
        """The unit of the planner's costs: milliseconds once measured (or emulated), else cost units."""
        return "ms" if self.costs.tracker.measured else "cost units"

    @property
    def plan(self):
        """The plan this worker runs now."""
        return self.plans.plan

    @property
    def micro_batch_source(self):
        return self.feed.source

    @micro_batch_source.setter
    def micro_batch_source(self, source) -> None:
        self.feed.source = source

    def is_lowest_live_rank(self) -> bool:
        """True on the one process that logs, saves and feeds the monitors in this epoch."""
        if not self.recycle.enabled:
            return self.global_rank == 0
        return self.slot == min(self.grid.membership.members)

    def install_grid(self, grid: RecycleGrid) -> None:
        """Point every handle the engine uses at this epoch's grid, and take its failure set's plan."""
        self.grid = self.mpu = grid
        self.data_parallel_group = grid.get_data_parallel_group()
        groups.mpu = grid
        p2p._grid = grid
        if getattr(self, "channel", None) is not None:
            bury(work for work, _ in self.channel.pending_sends)
        self.channel = PeerChannel(grid, self.device, self.waiter)
        self.stepper = StageStepper(self, self.channel, synchronous=not self.recycle.staggered_optimizer)
        self.plans.switch(grid.failed, self.costs.in_use, self.memory.budget, self.micro_batches)

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
        self.drop_buffers()
        self._own_loss = None
        if self.memory.meter is not None:
            self.memory.meter.drop()
        timer = self.timers(TRAIN_BATCH_TIMER)
        if timer.started_:
            timer.stop()
        timer.reset()
        self.stepper.drop_pending()

    def drop_buffers(self) -> None:
        """Forget every micro-batch's buffers and the loss of a run cut short or finished."""
        for key in self.pipe_buffers:
            self.pipe_buffers[key] = [None] * len(self.pipe_buffers[key])
        self.total_loss = None
        self.fwd_outputs = []

    def resync_tied_weights(self) -> None:
        self.stepper.resync_tied_weights()

    def record_change(self, change: MembershipChange, reporter: bool) -> None:
        """Keep ``change``; the ``reporter`` (the lowest member that was a member before it, which a
        joiner never is, also when it re-joins as slot 0) tells the monitors."""
        self.membership_changes.append(change)
        if reporter:
            for monitor in self.monitors:
                monitor.on_membership_change(change)

    def plan_summary(self, fault_free: float | None = None) -> PlanSummary:
        """The plan this worker runs now, as monitors report it."""
        live = tuple(len(self.grid.live_workers(s)) for s in range(self.num_stages))
        return self.plans.summary(live, fault_free)

    def check_data_available(self) -> None:
        """Stop cleanly, before the iteration, when the plan needs data this worker cannot load."""
        if self.feed.any_worker_loads:
            return
        foreign = self.plans.foreign_first_last_forwards()
        if foreign:
            worker, label = foreign[0]
            raise RecycleDataError(
                f"the plan for failure set {list(self.plan.failed)} has worker {worker} load {label} of another "
                "pipeline, but data comes from train_batch(data_iter), which holds only its own pipeline's "
                "micro-batches; pass training_data= to ds_recycle.initialize to survive first- or last-stage "
                f"failures. Training stopped at iteration {self.global_steps}, before running it."
            )

    # ---- checkpoints ------------------------------------------------------------------------

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
        """DeepSpeed's checkpoint; while workers are missing, each stage's lowest live replica
        writes the stage (:class:`~ds_recycle.engine.checkpoint.Checkpointer`). Called by the script
        between iterations, a failure during it is survived and the checkpoint written whole
        (:meth:`between_iterations`)."""
        client_state = client_state or {}
        if not self.recycle.enabled:
            return super().save_checkpoint(save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
        save = functools.partial(
            self.checkpointer.save, save_dir, tag, client_state, save_latest, exclude_frozen_parameters
        )
        return self.between_iterations(save, f"the checkpoint in {save_dir} at iteration {self.global_steps}")

    def _save_checkpoint(self, save_dir, tag, client_state=None, exclude_frozen_parameters=False):
        """DeepSpeed's writing of this rank's files; a save abandoned after a failure while it wrote
        goes no further (its next barrier would run on the survivors' new world,
        :meth:`~ds_recycle.runtime.rank.waiting.Waiter.stop_if_abandoned`)."""
        super()._save_checkpoint(
            save_dir, tag, client_state=client_state or {}, exclude_frozen_parameters=exclude_frozen_parameters
        )
        Waiter.stop_if_abandoned(f"the checkpoint {tag}")

    def between_iterations(self, call: Callable[[], T], what: str) -> T:
        """``call()``, a collective call of the script's between two iterations (a save). Under
        ``ds-recycle launch`` a failure during it is recovered and it runs again on the new plan
        (:meth:`~ds_recycle.runtime.rank.recovery.RankRuntime.between_iterations`); ``what`` names
        it in the log."""
        if self.runtime is None:
            return call()
        return self.runtime.between_iterations(call, what)

    def _set_distributed_vars(self, args) -> None:
        """DeepSpeed's, except that on a host with more ranks than GPUs (tests on one GPU) the ranks
        share them: rank ``LOCAL_RANK`` computes on GPU ``LOCAL_RANK mod GPUs``
        (:mod:`~ds_recycle.runtime.rank.communication`)."""
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count and 0 <= self.local_rank and count <= self.local_rank and not hasattr(args, "device_rank"):
            args = SimpleNamespace(device_rank=self.local_rank % count)
        super()._set_distributed_vars(args)

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
            self.checkpointer.save_if_due()
        else:
            loss = self.runtime.train_batch(
                lambda: super(RecyclePipelineEngine, self).train_batch(data_iter), self.checkpointer.save_if_due
            )
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
        """DeepSpeed's ``eval_batch`` on a forward-only plan over the live workers
        (:class:`~ds_recycle.engine.evaluator.Evaluator`).

        Returns DeepSpeed's value on every rank: the mean of the micro-batches' losses, per
        pipeline then over the D pipelines, summed in DeepSpeed's order (fault-free the result is
        bitwise stock's). ``return_logits``: also the last stage's outputs of the last micro-batch
        this worker ran (None on other stages).

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
        loss = self.evaluator.evaluate(data_iter, num_micro_batches or self.micro_batches, return_logits)
        if self.monitor.enabled and self.is_lowest_live_rank():
            self.monitor.write_events([("Train/Samples/eval_loss", loss.item(), self.global_samples)])
        if return_logits:
            outputs, self.outputs = getattr(self, "outputs", None), None
            return loss, outputs
        return loss

    def _train_schedule(self):
        if not self.recycle.enabled:
            return super()._train_schedule()
        self.agree_at_boundary(training=True)
        return PlannedSchedule(self.plans.stream, self.micro_batches, self.num_stages, self.stage_id)

    def run_stream(self, stream: WorkerStream, micro_batches: int, trains: bool) -> None:
        """Run one stream of this worker (an evaluation's; training runs through DeepSpeed's train_batch)."""
        self._exec_schedule(PlannedSchedule(stream, micro_batches, self.num_stages, self.stage_id, trains))

    def agree_at_boundary(self, training: bool) -> None:
        """At the start of an iteration (``training``) or an evaluation, the live workers agree, in
        one all-reduce over the world, on whatever is due: the measured costs (training only) and
        the memory budget. Whether each is due depends only on what every member shares (the
        iteration, the epoch, and whether this epoch has agreed), so every rank takes part, and
        every rank switches to the same plan at the same boundary."""
        i, epoch = self.global_steps, self.grid.membership.epoch
        costs_due = training and self.costs.due(i, epoch)
        memory_due = self.memory.due(i, epoch)
        if not costs_due and not memory_due:
            return
        rows = ([self.costs.row()] if costs_due else []) + (
            [self.memory.row(self.module, self.optimizer)] if memory_due else []
        )

        def all_reduce(table: torch.Tensor) -> None:
            self.waiter.collective(lambda: torch.distributed.all_reduce(table, async_op=True), "the boundary agreement")

        D, P = self.grid.data_parallel_size, self.num_stages
        tables = exchange_sections(rows, self.worker, D, P, all_reduce, self.device)
        movable = range(P) if self.feed.any_worker_loads else range(1, P - 1)
        decision = self.costs.take(tables.pop(0), epoch, movable) if costs_due else None
        first_budget = self.memory.take(tables.pop(0), D, P, epoch) if memory_due else False
        before = self.plan
        self.plans.switch(costs=self.costs.in_use, budget=self.memory.budget)
        lowest = self.is_lowest_live_rank()
        if first_budget and lowest:
            line, warning = self.memory.describe_budget(
                fault_free_plan(D, P, self.micro_batches, costs=self.costs.in_use, options=self.options)
            )
            logger.info(line)
            if warning:
                logger.warning(warning)
        if decision is None or decision.costs is None:
            return
        change = CostChange(
            i,
            tuple(decision.reasons),
            decision.costs,
            tuple(decision.changes),
            self.plan.iteration_time,
            self.plans.fault_free_time(),
            _time_without_replanning(before, decision.costs),
        )
        self.costs.changes.append(change)
        if lowest:
            for line in self.costs.describe(change, self.plan, self.grid.failed, self.micro_batches):
                logger.info(line)
            if self.runtime is not None:
                self.runtime.publish_status()

    def _exec_schedule(self, pipe_schedule):
        planned = self.recycle.enabled and isinstance(pipe_schedule, PlannedSchedule)
        if planned:
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
        if planned and pipe_schedule.trains:
            self._finish_iteration()

    def _finish_iteration(self) -> None:
        started = time.time()
        self.stepper.finish_iteration()
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        self.instruction_events.append(InstructionEvent("FinishIteration", -1, -1, started, time.time()))
        self.costs.record(self.instruction_events, self.global_steps)
        if self.memory.meter is not None and self.memory.meter.audit:
            logger.info(
                self.memory.audit_line(
                    self.worker,
                    self.global_steps - 1,
                    self.grid.membership.epoch,
                    self.instruction_events,
                    self.plan.memory_cap,
                )
            )

    # ---- reductions ---------------------------------------------------------------------------

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
        if self.evaluator.running:
            self._load(buffer_id, self.evaluator.current.data.get(home, mb, self.worker[0]))
            return
        self._load(buffer_id, self.feed.batch(self.global_steps, home, mb, self.worker[0], self.data_iterator))

    def _load(self, buffer_id: int, batch) -> None:
        """DeepSpeed's own loading (inputs on the first stage, labels on the last) of ``batch``."""
        iterator = self.data_iterator
        self.data_iterator = iter((batch,))
        try:
            PipelineEngine._exec_load_micro_batch(self, buffer_id)
        finally:
            self.data_iterator = iterator

    def _exec_forward(self, buffer_id: int, home: int, mb: int):
        if self.evaluator.running:
            evaluation = self.evaluator.current
            evaluation.forwards.append((home, mb))
            PipelineEngine._exec_forward_pass(self, buffer_id)
            if self.is_last_stage():
                evaluation.losses[(home, mb)] = self.loss.detach()
            return
        if self.forward_ledger is not None:
            self.forward_ledger.append((self.global_steps, home, mb, self.stage_id))
        meter = self.memory.meter
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
        if self.memory.meter is not None:
            self.memory.meter.after_backward_input(buffer_id, work)

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
        if self.memory.meter is not None:
            self.memory.meter.after_backward_weight(buffer_id)

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


def _time_without_replanning(plan, costs) -> float:
    """What ``plan`` would take under ``costs`` if it were kept (a cost change's "doing nothing")."""
    kept = copy.copy(plan)
    kept.costs = costs
    return retime(kept).iteration_time


def _node_workers(topo) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The workers of each node when the job runs on several (``LOCAL_WORLD_SIZE`` ranks each)."""
    layout = placement.NodeLayout.from_env(world=topo.world_size())
    if not layout.several:
        return ()
    nodes = layout.nodes.values()
    return tuple(tuple((topo.get_coord(r).data, topo.get_coord(r).pipe) for r in ranks) for ranks in nodes)


def _as_tuple(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)
