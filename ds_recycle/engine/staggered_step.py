"""StaggeredStep: each stage reduces its own gradients over its DP group and steps as soon as
its own last W is done. Nothing in it waits for another stage's progress.

Three things in stock DeepSpeed couple the stages at the optimizer step; this module replaces
each of them with a message that is sent early and received only when it is already there:

- **Tied weights** (e.g. an embedding shared by the first and last stage). The lowest stage
  holding a tied weight owns it. Every other holder (a follower) sends its local gradient to the
  owner when it steps, and takes no step on that weight itself. The owner adds the followers'
  gradients before its DP reduction, exactly as DeepSpeed's tied all-reduce does, steps, and sends
  the updated weight back. A follower installs it when its iteration ends: it could not run its
  next forward before the owner's stage had stepped anyway.
- **Global-norm gradient clipping**, post-validated (as Zero Bubble does). Each stage steps at
  once as if no clipping were needed, keeping its reduced gradients, and sends the squared norm of
  its gradients to the other stages of its pipeline. When the iteration ends every stage has every
  partial norm (the first stage, which finishes last, has sent its own), computes the true global
  norm in one fixed order, and, only if clipping applies, undoes its step in place
  (:mod:`ds_recycle.engine.undo`) and steps again with the clipped gradients. The cost is one copy
  of the gradients, and an undo plus a second step on iterations that clip. An optimizer the undo
  does not cover falls back to a snapshot of parameters and optimizer state.
- **The loss**: the last stage averages it over its DP group and sends it to the other stages of
  its pipeline, which receive it when their iteration ends. No broadcast.

With ``staggered_optimizer: false`` the step is synchronous instead, as in stock DeepSpeed: every
stage waits for the partial norms of all the other stages before it steps (with or without
clipping), so no stage steps before every stage has finished its backward.

After a failure a pipeline may lack a stage. Every replica of a stage holds the same weights and,
after the DP reduction, the same gradients, so the per-pipeline messages go to and come from the
stage's *partner* for that pipeline (``RecycleGrid.partner``): the worker itself when it is live,
else a live replica. Tied gradients are the exception: they are partial sums over the micro-batches
a worker ran, so each live follower sends its own exactly once, to its pipeline's owner partner.
Gradients are divided by D*m whoever computed them: DeepSpeed's reduction averages over the live
replicas, and the step rescales by live/D.

**Message order.** Routed p2p has no tags (:mod:`ds_recycle.engine.routing`): the messages of each
directed pair of workers match in the order they were posted, so both sides must post them in one
order. In an iteration every worker posts, in this order:

1. its stream's routed transfers (activations, gradients); ``StaggeredStep`` is the last
   instruction of every stream (:func:`ds_recycle.planner.lowering.check_streams`);
2. in :meth:`StageStepper.step`: the tied gradients (a follower sends, an owner receives), then the
   partial norm sends (synchronous, or staggered with clipping), then the loss sends (last stage),
   then in synchronous mode the partial norm receives;
3. in :meth:`StageStepper.finish_iteration`: the partial norm receives (staggered with clipping),
   then the tied weights (an owner sends, a follower receives);
4. after it, the loss receive (:meth:`StageStepper.receive_loss`, every stage but the last).

Take a directed pair A -> B. If A's stage is above B's, only gradients (1), tied gradients (a
follower is above its owner), a partial norm and the loss (from the last stage) can go from A to B;
A posts them in that order (1, 2), and B receives them in that order too: (1), tied gradients in
its step, the norm in its step or in finish_iteration, the loss after finish_iteration. If A's
stage is below B's, only activations (1), a partial norm and tied weights (the owner is below its
followers) can go; A posts them in that order (1, 2, 3), and B receives them in that order (1, the
norm in step or finish_iteration before its tied weights). Within one kind: a pair carries at most
one partial norm and one loss per iteration, since A sends to ``(p, t)`` for ``p`` in
``served_by(A)`` and ``(p, t)`` receives from ``partner(p, A's stage)``, which is A exactly then;
tied gradients and tied weights go in the order of ``self.tied`` on both sides (sorted keys, then
weight attributes), restricted to the weights both stages hold. Both sides decide whether a message
exists from the same facts (the grid's live workers, the clipping setting, the step mode), and each
message is received in the iteration it is sent in, so iterations never mix. The tied-weight
re-sync after a rollback runs on a fresh channel before the epoch's first iteration, on the
survivors and on a joiner that the recovery admitted alike.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from deepspeed.runtime.pipe.module import TiedLayerSpec

from ds_recycle.engine.routing import GRAD_NORM, LOSS, TIED_GRADIENT, TIED_WEIGHT, PeerChannel
from ds_recycle.engine.undo import (
    SnapshotUndo,
    StepUndo,
    hyperparameters,
    restore_hyperparameters,
    undo_before_step,
    unsupported_reason,
)
from ds_recycle.log import logger

CLIP_EPSILON = 1e-6  # the epsilon of DeepSpeed's and torch's clip_grad_norm_


@dataclass
class TiedWeight:
    index: int
    param: torch.nn.Parameter
    owner_stage: int
    stages: list[int]


@dataclass
class FinishedStep:
    """What undoing the last finished iteration needs: its optimizer step, and the LR scheduler's
    state and the optimizer's hyperparameters before the scheduler stepped."""

    undo: StepUndo | SnapshotUndo | None
    lr_state: dict | None
    groups: list[dict]


@dataclass
class _PendingValidation:
    reduced_grads: list[torch.Tensor | None]
    partial_sq_norm: float
    undo: StepUndo | SnapshotUndo


class StageStepper:
    """Runs the StaggeredStep of one worker and closes its iteration."""

    def __init__(self, engine, channel: PeerChannel, synchronous: bool):
        self.engine = engine
        self.channel = channel
        self.synchronous = synchronous
        self.grid = engine.grid
        self.worker = self.grid.worker
        self.pipeline, self.stage = self.worker
        self.stages = engine.num_stages
        self.tied = self._tied_weights()
        self._pending: _PendingValidation | None = None
        self._warned_snapshot = False
        self.keep_undo = getattr(engine, "runtime", None) is not None
        """Under ds-recycle launch every step stays undoable until every member has finished its
        iteration: a failure may abort an iteration that this stage has already stepped."""
        self.inflight: StepUndo | SnapshotUndo | None = None
        self.finished: FinishedStep | None = None
        self.last_grad_norm: float | None = None

    def _tied_weights(self) -> list[TiedWeight]:
        module = self.engine.module
        numbers = _tied_weight_numbers(module)
        tied = []
        for key, comm in sorted(module.tied_comms.items()):
            stages = sorted(self.engine.grid.topology().get_coord(r).pipe for r in comm["ranks"])
            for attr in comm["weight_attr"]:
                param = module._recursive_getattr(module.tied_modules[key], attr)
                tied.append(TiedWeight(numbers[(key, attr)], param, stages[0], stages))
        return tied

    @property
    def clip(self) -> float:
        return float(self.engine.gradient_clipping() or 0.0)

    @functools.cached_property
    def peers(self) -> set[tuple[int, int]]:
        """:func:`step_peers` of this stepper's grid (fixed for its life: one epoch)."""
        return step_peers(self.grid)

    def tied_peers(self) -> set[tuple[int, int]]:
        """The workers a re-sync of the tied weights exchanges them with."""
        peers = set()
        for tied in self.tied:
            if tied.owner_stage == self.stage:
                peers.update(self._followers_of_mine(tied))
            else:
                peers.add(self.grid.partner(self.pipeline, tied.owner_stage))
        return peers

    def step(self) -> None:
        engine = self.engine
        self._exchange_tied_gradients()
        engine._exec_reduce_grads()
        params = [p for p in engine.module.parameters() if p.requires_grad]
        live = len(self.grid.live_workers(self.stage))
        if live != self.grid.data_parallel_size:
            self._scale_grads(params, live / self.grid.data_parallel_size)
        followed = [t.param for t in self.tied if t.owner_stage != self.stage]
        counted = [p for p in params if not any(p is f for f in followed)]
        if self.synchronous:
            # Stock DeepSpeed's cross-stage point: every stage waits here for the global norm.
            partial = _sq_norm(counted)
            self._send_partial_norm(partial)
            self._send_loss()
            coef = self._clip_coef(self._total_sq_norm(partial))
            if self.clip > 0:
                self._scale_grads(counted, coef)
            self.finished = None
            self._remember_step(params, counted)
            self._optimizer_step(params, followed)
            return
        # This stage's all-reduce has completed, so every worker has finished the previous iteration.
        self.finished = None
        if self.clip <= 0:
            self._send_loss()
            self._remember_step(params, counted)
            self._optimizer_step(params, followed)
            return
        partial = _sq_norm(counted)
        reduced = [None if p.grad is None else p.grad.detach().clone() for p in params]
        undo = self._undo_record(params, counted, dict(zip(params, reduced, strict=True)))
        self._pending = _PendingValidation(reduced, partial, undo)
        self._send_partial_norm(partial)
        self._send_loss()
        # In flight only from here: the loss all-reduce above can be interrupted before the step.
        self.inflight = undo if self.keep_undo else None
        self._optimizer_step(params, followed)

    def _send_partial_norm(self, partial: float) -> None:
        """To every live worker of another stage whose pipeline this worker stands in for."""
        norm_msg = torch.tensor([partial], dtype=torch.float64, device=self.engine.device)
        for pipeline in self.grid.served_by(self.worker):
            for stage in range(self.stages):
                if stage != self.stage and self.grid.is_live((pipeline, stage)):
                    self.channel.send((norm_msg,), (pipeline, stage), GRAD_NORM, 0, self.stage)

    def _total_sq_norm(self, own_partial: float) -> float:
        """The global squared norm, summed in stage order from this pipeline's partners."""
        partials = {self.stage: own_partial}
        for stage in range(self.stages):
            if stage != self.stage:
                buf = torch.zeros(1, dtype=torch.float64, device=self.engine.device)
                self.channel.recv_into((buf,), self.grid.partner(self.pipeline, stage), GRAD_NORM, 0, stage)
                partials[stage] = buf.item()
        return sum(partials[s] for s in range(self.stages))

    def finish_iteration(self) -> None:
        """Validate the optimistic step, share tied weights, advance the LR schedule."""
        engine = self.engine
        if self._pending is not None:
            self._validate(self._pending)
            self._pending = None
        self._exchange_tied_weights()
        # The last wait that a failure can interrupt: from here on the iteration is finished at
        # once (LR step, undo record, then the engine's counters), so a recovery sees it either in
        # flight or done.
        self.channel.wait_sends()
        lr_state, groups = None, hyperparameters(engine.optimizer) if self.keep_undo else []
        if engine.lr_scheduler is not None:
            lr_state = engine.lr_scheduler.state_dict() if self.keep_undo else None
            engine.lr_scheduler.step()
        if self.keep_undo:
            self.finished = FinishedStep(self.inflight, lr_state, groups)
            self.inflight = None

    # ---- rollback ------------------------------------------------------------------------------

    @property
    def stepped_inflight(self) -> bool:
        return self.inflight is not None

    def rollback_inflight(self) -> None:
        """Undo the step of the iteration that a failure interrupted."""
        if self.inflight is not None:
            self.inflight.undo()
        self.inflight = None
        self._pending = None

    def rollback_finished(self) -> None:
        """Undo the last finished iteration: its step and its LR step (the engine its counters)."""
        engine, finished = self.engine, self.finished
        if finished is None:
            raise RuntimeError("the last finished iteration cannot be undone: its undo record was dropped")
        if finished.undo is not None:
            finished.undo.undo()
        if finished.lr_state is not None:
            engine.lr_scheduler.load_state_dict(finished.lr_state)
        restore_hyperparameters(engine.optimizer, finished.groups)  # a scheduler's load leaves them
        self.finished = None

    def drop_pending(self) -> None:
        """Forget the clipping validation of an iteration that a failure interrupted."""
        self._pending = None

    def resync_tied_weights(self) -> None:
        """After a rollback: followers take the owner's (restored) tied weights again."""
        self.channel.connect(self.tied_peers(), self.engine.global_steps)
        self._exchange_tied_weights()
        self.channel.wait_sends()

    def _remember_step(self, params, counted) -> None:
        if self.keep_undo:
            grads = {p: None if p.grad is None else p.grad.detach().clone() for p in params}
            self.inflight = self._undo_record(params, counted, grads)

    def _undo_record(self, params, counted, grads: dict) -> StepUndo | SnapshotUndo:
        """An undo of the step about to be taken: in place where the optimizer allows it (keeping
        ``grads``, the gradients the step uses, of the ``counted`` parameters), else a snapshot of
        the parameters and the optimizer state (with a warning, once)."""
        optimizer = self.engine.optimizer
        reason = unsupported_reason(optimizer)
        if reason is not None and not self._warned_snapshot:
            self._warned_snapshot = True
            logger.warning(f"ReCycle: a step is undone from a snapshot of the state, not in place: {reason}")
        counted_ids = {id(p) for p in counted}
        used = {p: g for p, g in grads.items() if g is not None and id(p) in counted_ids}
        return undo_before_step(optimizer, used, params)

    def receive_loss(self) -> torch.Tensor:
        loss = torch.zeros(2, dtype=torch.float32, device=self.engine.device)
        self.channel.recv_into((loss,), self.grid.partner(self.pipeline, self.stages - 1), LOSS)
        return loss

    def _validate(self, pending: _PendingValidation) -> None:
        coef = self._clip_coef(self._total_sq_norm(pending.partial_sq_norm))
        if coef >= 1.0:
            return
        engine = self.engine
        params = [p for p in engine.module.parameters() if p.requires_grad]
        followed = [t.param for t in self.tied if t.owner_stage != self.stage]
        pending.undo.undo()
        for p, grad in zip(params, pending.reduced_grads, strict=True):
            p.grad = None if grad is None else grad.mul_(coef)
        if self.keep_undo:
            counted = [p for p in params if not any(p is f for f in followed)]
            self.inflight = self._undo_record(params, counted, {p: p.grad for p in params})
        self._optimizer_step(params, followed)

    def _clip_coef(self, total_sq_norm: float) -> float:
        self.last_grad_norm = math.sqrt(total_sq_norm)
        return self.clip / (self.last_grad_norm + CLIP_EPSILON)

    @staticmethod
    def _scale_grads(params, coef: float) -> None:
        if coef < 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coef)

    def _optimizer_step(self, params, followed) -> None:
        for p in followed:
            p.grad = None
        self.engine.optimizer.step()
        for p in params:
            p.grad = None

    def _followers_of_mine(self, tied: TiedWeight) -> list[tuple[int, int]]:
        """The live followers of ``tied`` whose owner partner is this worker."""
        return [
            (pipeline, stage)
            for stage in tied.stages[1:]
            for pipeline in range(self.grid.data_parallel_size)
            if self.grid.is_live((pipeline, stage)) and self.grid.partner(pipeline, self.stage) == self.worker
        ]

    def _exchange_tied_gradients(self) -> None:
        for tied in self.tied:
            if tied.owner_stage == self.stage:
                for follower in self._followers_of_mine(tied):
                    incoming = torch.empty_like(tied.param)
                    self.channel.recv_into((incoming,), follower, TIED_GRADIENT, 0, tied.index)
                    if tied.param.grad is None:
                        tied.param.grad = torch.zeros_like(tied.param)
                    tied.param.grad.add_(incoming)
            else:
                # A copy: the DP all-reduce that follows rewrites .grad while the send may be in flight.
                grad = tied.param.grad.clone() if tied.param.grad is not None else torch.zeros_like(tied.param)
                owner = self.grid.partner(self.pipeline, tied.owner_stage)
                self.channel.send((grad,), owner, TIED_GRADIENT, 0, tied.index)

    def _exchange_tied_weights(self) -> None:
        for tied in self.tied:
            if tied.owner_stage == self.stage:
                for follower in self._followers_of_mine(tied):
                    self.channel.send((tied.param.detach(),), follower, TIED_WEIGHT, 0, tied.index)
            else:
                owner = self.grid.partner(self.pipeline, tied.owner_stage)
                with torch.no_grad():
                    self.channel.recv_into((tied.param.data,), owner, TIED_WEIGHT, 0, tied.index)

    def _send_loss(self) -> None:
        """From the last stage, after its partial norms: the other stages receive the norms first."""
        if not self.engine.is_last_stage():
            return
        losses = self.engine.aggregate_last_stage_loss()
        for pipeline in self.grid.served_by(self.worker):
            for stage in range(self.stages - 1):
                if self.grid.is_live((pipeline, stage)):
                    self.channel.send((losses,), (pipeline, stage), LOSS, 0, 0)


def step_peers(grid) -> set[tuple[int, int]]:
    """Every worker ``grid.worker`` may exchange a message of the step with in the grid's epoch: to
    each live worker of another stage whose pipeline it stands in for (partial norms, the loss,
    tied weights to followers), and from its pipeline's partner at every other stage (the same
    three, tied gradients to the owner). Symmetric: each of them has this worker among its own."""
    (pipeline, stage), stages = grid.worker, grid.pipe_parallel_size
    others = [t for t in range(stages) if t != stage]
    to = {(q, t) for q in grid.served_by(grid.worker) for t in others if grid.is_live((q, t))}
    return to | {grid.partner(pipeline, t) for t in others}


def _tied_weight_numbers(module) -> dict[tuple[str, str], int]:
    """A number for every tied (key, attribute) of the whole model, the same on every stage (a stage
    holds only some of them): it names a tied weight's messages."""
    attrs: dict[str, list[str]] = {}
    for spec in module._layer_specs:
        if isinstance(spec, TiedLayerSpec):
            attrs.setdefault(spec.key, spec.tied_weight_attr)
    names = [(key, attr) for key in sorted(attrs) for attr in attrs[key]]
    return {name: number for number, name in enumerate(names)}


def _sq_norm(params) -> float:
    total = 0.0
    for p in params:
        if p.grad is not None:
            total += float(p.grad.detach().double().pow(2).sum())
    return total
