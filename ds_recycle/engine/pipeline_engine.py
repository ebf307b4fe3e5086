"""RecyclePipelineEngine: DeepSpeed's PipelineEngine running ReCycle's planned schedules.

Each ``train_batch`` runs this worker's instruction stream, lowered from the plan for the current
failure set (the fault-free plan for now): routed transfers, BackwardInput with BackwardWeight
deferred into bubbles, and a StaggeredStep. The instructions run through this class's own
instruction map. Without a ``recycle`` section, or with ``enabled: false``, it is DeepSpeed's
engine, running DeepSpeed's schedule.
"""

from __future__ import annotations

import functools
import time
from types import MethodType

import torch
import torch.utils.checkpoint
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.utils import logger

from ds_recycle.config import RecycleConfig, RecycleConfigError
from ds_recycle.engine.backward_split import backward_input, backward_weight
from ds_recycle.engine.routing import ACTIVATION, GRADIENT, PeerChannel
from ds_recycle.engine.staggered_step import StageStepper
from ds_recycle.engine.timing import InstructionEvent, event_of, pad_to
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
)
from ds_recycle.planner.fault_free import fault_free_plan
from ds_recycle.planner.list_scheduler import ScheduleOptions
from ds_recycle.planner.lowering import WorkerStream, lower

_EXTRA_BUFFERS = ("losses", "grads", "input_grads", "weight_work")


class PlannedSchedule(schedule.PipeSchedule):
    """One worker's lowered instruction stream, one instruction per step."""

    def __init__(self, stream: WorkerStream, micro_batches: int, stages: int, stage_id: int):
        super().__init__(micro_batches, stages, stage_id)
        self.stream = stream

    def num_pipe_buffers(self) -> int:
        return self.stream.num_buffers

    def steps(self):
        for instruction in self.stream.instructions:
            yield [instruction]


class RecyclePipelineEngine(PipelineEngine):
    def __init__(self, *args, recycle_config: RecycleConfig | None = None, **kwargs):
        self.recycle = recycle_config or RecycleConfig()
        super().__init__(*args, **kwargs)
        self.instruction_events: list[InstructionEvent] = []
        if not self.recycle.enabled:
            return
        self._check_supported()
        for key in _EXTRA_BUFFERS:
            self.pipe_buffers[key] = [None] * self.num_pipe_buffers
        self.worker = (self.grid.get_data_parallel_id(), self.stage_id)
        self.channel = PeerChannel(self.grid, self.device)
        self.stepper = StageStepper(self, self.channel, synchronous=not self.recycle.staggered_optimizer)
        self._trainable = [p for p in self.module.parameters() if p.requires_grad]
        self._stream_cache: dict[tuple, WorkerStream] = {}
        self._own_loss: torch.Tensor | None = None
        logger.info(
            f"ReCycle engine on worker (pipeline {self.worker[0]}, stage {self.worker[1]}): "
            f"decoupled_backprop={self.recycle.decoupled_backprop} "
            f"staggered_optimizer={self.recycle.staggered_optimizer}"
        )

    def _check_supported(self) -> None:
        if self.is_pipe_partitioned or self.is_grad_partitioned:
            raise RecycleConfigError("recycle does not support pipe/grad partitioning (tensor parallelism > 1) yet")
        if self.grid.data_parallel_size > 4096 or self.micro_batches > 65536:
            raise RecycleConfigError(
                f"recycle tags messages with 12 bits of pipeline and 16 of micro-batch: data parallelism "
                f"{self.grid.data_parallel_size} must be <= 4096 and gradient_accumulation_steps "
                f"{self.micro_batches} <= 65536"
            )
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

    # ---- schedule ---------------------------------------------------------------------------

    def _train_schedule(self):
        if not self.recycle.enabled:
            return super()._train_schedule()
        return PlannedSchedule(self._current_stream(), self.micro_batches, self.num_stages, self.stage_id)

    def _current_stream(self) -> WorkerStream:
        key = (self.dp_world_size, self.num_stages, self.micro_batches)
        if key not in self._stream_cache:
            options = ScheduleOptions(
                decoupled=self.recycle.decoupled_backprop, staggered=self.recycle.staggered_optimizer
            )
            plan = fault_free_plan(self.grid.data_parallel_size, self.num_stages, self.micro_batches, options=options)
            self._stream_cache[key] = lower(plan)[self.worker]
        return self._stream_cache[key]

    def _exec_schedule(self, pipe_schedule):
        self._reserve_pipe_buffers(pipe_schedule.num_pipe_buffers())
        self.fwd_outputs = []
        self.instruction_events = []
        self._next_own_mb = 0
        emulation = self.recycle.emulate_timing
        for step_cmds in pipe_schedule:
            for cmd in step_cmds:
                if type(cmd) not in self._INSTRUCTION_MAP:
                    raise RuntimeError(f"{self.__class__.__name__} does not understand instruction {cmd!r}")
                started = time.time()
                self._exec_instr = MethodType(self._INSTRUCTION_MAP[type(cmd)], self)
                self._exec_instr(**cmd.kwargs)
                pad_to(cmd, started, emulation)
                self.instruction_events.append(event_of(cmd, started, time.time()))
        if self.recycle.enabled and isinstance(pipe_schedule, PlannedSchedule):
            started = time.time()
            self.stepper.finish_iteration()
            self.instruction_events.append(InstructionEvent("FinishIteration", -1, -1, started, time.time()))

    # ---- loss -------------------------------------------------------------------------------

    def aggregate_last_stage_loss(self) -> torch.Tensor:
        """[this pipeline's mean loss, the mean over all pipelines], as stock DeepSpeed computes them."""
        loss = self._scale_loss_by_gas(self.total_loss)
        self.dp_group_loss = loss.clone().detach()
        agg_loss = self.dp_group_loss.clone().detach()
        if self.is_data_parallel:
            torch.distributed.all_reduce(agg_loss, group=self.mpu.get_data_parallel_group())
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
        if home != self.worker[0]:
            raise NotImplementedError(
                f"loading micro-batch ({home},{mb}) of another pipeline needs a micro-batch provider"
            )
        if mb != self._next_own_mb:
            raise RuntimeError(f"schedule loads micro-batch {mb} but the data iterator is at {self._next_own_mb}")
        self._next_own_mb += 1
        PipelineEngine._exec_load_micro_batch(self, buffer_id)

    def _exec_forward(self, buffer_id: int, home: int, mb: int):
        PipelineEngine._exec_forward_pass(self, buffer_id)
        if self.is_last_stage():
            self.pipe_buffers["losses"][buffer_id] = self.loss

    def _exec_send_activation(self, buffer_id: int, home: int, mb: int, peer):
        self.channel.send(_as_tuple(self.pipe_buffers["outputs"][buffer_id]), peer, ACTIVATION, home, mb)

    def _exec_recv_activation(self, buffer_id: int, home: int, mb: int, peer):
        received = self.channel.recv_activation(peer, home, mb)
        for tensor in received:
            tensor.requires_grad = tensor.is_floating_point()
        self.pipe_buffers["inputs"][buffer_id] = received[0] if len(received) == 1 else received

    def _exec_recv_grad(self, buffer_id: int, home: int, mb: int, peer):
        outputs = _as_tuple(self.pipe_buffers["outputs"][buffer_id])
        grads = tuple(torch.empty_like(t) for t in outputs if t.is_floating_point())
        self.pipe_buffers["grads"][buffer_id] = self.channel.recv_into(grads, peer, GRADIENT, home, mb)

    def _exec_backward_input(self, buffer_id: int, home: int, mb: int):
        inputs = _as_tuple(self.pipe_buffers["inputs"][buffer_id])
        if self.is_last_stage():
            outputs, grads = [self.pipe_buffers["losses"][buffer_id]], None
        else:
            outputs = [t for t in _as_tuple(self.pipe_buffers["outputs"][buffer_id]) if t.is_floating_point()]
            grads = self.pipe_buffers["grads"][buffer_id]
        self._running_engine_backward = True
        try:
            input_grads, work = backward_input(outputs, grads, inputs, self._trainable)
        finally:
            self._running_engine_backward = False
        self.pipe_buffers["input_grads"][buffer_id] = input_grads
        self.pipe_buffers["weight_work"][buffer_id] = work
        for key in ("outputs", "grads", "losses"):
            self.pipe_buffers[key][buffer_id] = None

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


def _as_tuple(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)
