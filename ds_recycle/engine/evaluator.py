"""Evaluator: ``eval_batch`` on a forward-only plan over the live workers.

Each pipeline's micro-batches go forward through live workers only, routed as the training plan
routes their F, so whatever the failure set every micro-batch is evaluated once, and the loss is
DeepSpeed's (fault-free, bitwise stock's). Under ``ds-recycle launch`` a failure during the batch
is recovered by the rank's runtime like one during training (:meth:`RankRuntime.run`), and the
batch runs again on the new plan, unless a peer had finished it: then its committed loss is taken.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from deepspeed.runtime.pipe.engine import PipelineEngine

from ds_recycle.errors import RecycleDataError
from ds_recycle.planner.lowering import WorkerStream
from ds_recycle.runtime.shared import keys


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


class Evaluator:
    """Runs the engine's ``eval_batch`` over the live workers (see the module doc)."""

    def __init__(self, engine: PipelineEngine) -> None:
        self.engine = engine
        """The :class:`~ds_recycle.engine.pipeline_engine.RecyclePipelineEngine` it evaluates with."""
        self.current: Evaluation | None = None
        """The running evaluation, or after it the last one."""
        self.running = False
        """True while an evaluation's stream runs: the engine's load and forward handlers serve it."""
        self._at: tuple[int, int] = (-1, 0)
        """(iteration, evaluations run since it): part of each evaluation's key."""

    def evaluate(self, data, micro_batches: int, return_logits: bool) -> torch.Tensor:
        """One batch to its end, through any failures (the runtime's recovery); its loss."""
        began = time.time()
        engine = self.engine
        evaluation = Evaluation(EvalData.of(data), micro_batches, key=self._next_key())
        self.current = evaluation
        if engine.runtime is None:
            loss = self._attempt(evaluation, return_logits)
        else:
            loss = engine.runtime.run(
                lambda: self._attempt(evaluation, return_logits), lambda: self._finished_by_a_peer(evaluation)
            )
        evaluation.seconds = time.time() - began
        return loss

    def _next_key(self) -> str:
        engine = self.engine
        iteration, count = self._at
        count = count + 1 if iteration == engine.global_steps else 0
        self._at = (engine.global_steps, count)
        generation = os.environ.get(keys.ENV_GENERATION, "0")
        return json.dumps([generation, engine.grid.membership.epoch, engine.global_steps, count])

    def _attempt(self, evaluation: Evaluation, return_logits: bool) -> torch.Tensor:
        """Run the batch once on the plan of the current failure set. Under ds-recycle launch,
        tell the job's store that it is done, and its loss, before leaving it: a failure announced
        while the last collective completes can interrupt some survivors after others have passed
        it; after their recovery those take the loss from there instead of running the batch again
        (:meth:`_finished_by_a_peer`), and every survivor goes on to the same iteration."""
        engine = self.engine
        evaluation.attempts += 1
        engine.agree_at_boundary(training=False)  # a joiner's first call may be an evaluation
        evaluation.failed = engine.grid.failed
        evaluation.forwards, evaluation.losses = [], {}
        stream = self._stream(evaluation)
        engine.module.eval()
        engine._compute_loss = True
        engine.eval_return_logits = return_logits
        engine.outputs = None
        self.running = True
        try:
            with torch.no_grad():
                engine.run_stream(stream, evaluation.micro_batches, trains=False)
                engine.channel.wait_sends()
                loss = self._loss(evaluation)
        finally:
            self.running = False
            engine.eval_return_logits = False
            engine.drop_buffers()
        self._commit(evaluation, loss)
        return loss

    def _commit(self, evaluation: Evaluation, loss: torch.Tensor) -> None:
        if self.engine.runtime is not None:
            self.engine.runtime.job.commit_evaluation(evaluation.key, float(loss))

    def _finished_by_a_peer(self, evaluation: Evaluation) -> torch.Tensor | None:
        """After a recovery: the loss a peer committed for this batch, or None to run it again."""
        committed = self.engine.runtime.job.committed_evaluation()
        if committed is None or committed[0] != evaluation.key:
            return None
        evaluation.from_peer = True
        self.engine.outputs = None
        return torch.tensor(committed[1], dtype=torch.float32, device=self.engine.device)

    def _stream(self, evaluation: Evaluation) -> WorkerStream:
        engine = self.engine
        any_worker_loads = evaluation.data.source is not None
        streams = engine.plans.evaluation_stream(evaluation.micro_batches, any_worker_loads)
        foreign = [] if any_worker_loads else engine.plans.foreign_loads(streams)
        if foreign:
            worker, action = foreign[0]
            raise RecycleDataError(
                f"evaluation with workers {list(evaluation.failed)} missing has worker {worker} load micro-batch "
                f"({action.home},{action.mb}) of another pipeline, but eval data comes from an iterator, which "
                "holds only its own pipeline's micro-batches; pass a callable (home, mb) -> batch to eval_batch "
                "to evaluate while a first- or last-stage worker is missing"
            )
        return streams[engine.worker]

    def _loss(self, evaluation: Evaluation) -> torch.Tensor:
        """DeepSpeed's reduction: per pipeline the sum of its micro-batches' losses in order over
        m (in the loss's dtype), then the all-reduce over the pipelines divided by D, then sent to
        every stage as fp32. A missing last-stage worker's pipeline is summed by the live worker
        that stands in for it (``grid.partner``), after the last stage's workers have shared every
        micro-batch's loss."""
        engine = self.engine
        grid, m, waiter = engine.grid, evaluation.micro_batches, engine.waiter
        last = engine.num_stages - 1
        loss = torch.zeros((), dtype=torch.float32, device=engine.device)
        if engine.is_last_stage():
            dtype = next(iter(evaluation.losses.values())).dtype if evaluation.losses else torch.float32
            table = torch.zeros(grid.data_parallel_size, m, dtype=torch.float32, device=engine.device)
            for (home, mb), value in evaluation.losses.items():
                if value.numel() != 1:
                    raise RuntimeError(f"eval_batch over the live workers needs a scalar loss, got shape {value.shape}")
                table[home, mb] = value
            group = grid.get_data_parallel_group()
            if grid.failed:  # exact: each entry is one worker's loss and zeros elsewhere
                waiter.collective(
                    lambda: torch.distributed.all_reduce(table, group=group, async_op=True), "the eval losses' exchange"
                )
            losses = table.to(dtype)  # exact: the losses were of this dtype
            total = None
            for home in grid.served_by(engine.worker):
                mean = sum(losses[home, mb] for mb in range(m)) / m
                total = mean if total is None else total + mean
            if grid.data_parallel_size > 1:
                waiter.collective(
                    lambda: torch.distributed.all_reduce(total, group=group, async_op=True), "the eval loss all-reduce"
                )
                total /= grid.data_parallel_size
            loss = total.clone().detach().float()
        source = grid.rank_of(grid.live_workers(last)[0])
        waiter.collective(
            lambda: torch.distributed.broadcast(loss, src=source, async_op=True), "the eval loss broadcast"
        )
        return loss
