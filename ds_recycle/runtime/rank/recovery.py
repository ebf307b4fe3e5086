"""The one owner of the failure path on a rank: join, boundary decision, recovery, rollback, stop.

Under ``ds-recycle launch``, ``ds_recycle.initialize`` makes one :class:`RankRuntime` per rank and
hands it to the engine. The engine only runs instruction streams; every ``train_batch`` and
``eval_batch`` runs through :meth:`RankRuntime.run`, and everything about membership happens here,
top-down, in :meth:`RankRuntime.train_batch`:

1. run the iteration (the engine's own ``train_batch``);
2. at its boundary the members take one shared decision (:meth:`MembershipAgent.decide`); when
   workers left or joined, every member enters the new epoch: a fresh world and grid
   (:mod:`~ds_recycle.runtime.rank.groups`), joiners' state from a live replica
   (:mod:`~ds_recycle.runtime.rank.rejoin`), and the plan of the new failure set;
3. a :class:`~ds_recycle.runtime.rank.waiting.PeerFailure` (the failure watcher saw the coordinator
   publish a failure of a peer, or a gloo operation failed) stops the iteration; the survivors agree
   on the iteration they all restart from (:meth:`MembershipAgent.recover`), each rolls back to it
   (:meth:`Trainee.roll_back_to`), and they enter the epoch without the dead and run it again, so no
   sample is lost or counted twice;
4. a stage with no live worker stops the job: exit 75 (restart every rank from the latest
   checkpoint) or 76 (no checkpoint: stop).

:class:`Trainee` is all the runtime needs of the engine; :mod:`ds_recycle.runtime.rank.phases` holds the
phase table, checked at every phase change.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

import torch

from ds_recycle.errors import EpochSuperseded, PeerFailure, StageLostError
from ds_recycle.log import logger
from ds_recycle.runtime.rank import checkpoints, communication, exit_guard, rebalance, rejoin, reporting
from ds_recycle.runtime.rank.groups import (
    GROUP_TIMEOUT_SECONDS,
    RecycleGrid,
    abort_communicators,
    group_roles,
    rebuild_world,
)
from ds_recycle.runtime.rank.membership import MembershipAgent
from ds_recycle.runtime.rank.phases import Phase, PhaseTracker
from ds_recycle.runtime.rank.waiting import FailureWatcher
from ds_recycle.runtime.shared import keys, placement
from ds_recycle.runtime.shared.events import MembershipChange
from ds_recycle.runtime.shared.keys import RESTART_EXIT_CODE, STOP_EXIT_CODE
from ds_recycle.runtime.shared.records import MOVE, Change, Decision, Membership, Progress

MAX_RECOVERY_ROUNDS = 8
HELPER_LOST_EXIT_CODE = 3
"""A rank whose helper process (a DataLoader worker) died ends with this code: a failure."""


T = TypeVar("T")


class Plans(Protocol):
    """What the runtime reads of the engine's plan book."""

    def predicted_time(self, failed: tuple[tuple[int, int], ...]) -> float: ...

    def fault_free_time(self) -> float: ...


class Trainee(Protocol):
    """All the runtime needs of the engine (RecyclePipelineEngine implements it)."""

    slot: int
    global_steps: int
    grid: RecycleGrid
    waiter: object
    """The engine's :class:`~ds_recycle.runtime.rank.waiting.Waiter`: the watcher's flag bounds its waits."""
    plans: Plans
    plan: object
    """The plan running now (its costs and predicted iteration time)."""
    optimizer: object
    lr_scheduler: object
    module: torch.nn.Module
    rejoin_client_state: Callable[[], object] | None
    received_client_state: object

    @property
    def topology(self): ...

    @property
    def worker(self) -> tuple[int, int]: ...

    @property
    def stepped_inflight(self) -> bool: ...

    @property
    def cost_unit(self) -> str: ...

    def install_grid(self, grid: RecycleGrid) -> None: ...

    def roll_back_to(self, iteration: int) -> bool: ...

    def resync_tied_weights(self) -> None: ...

    def check_data_available(self) -> None: ...

    def record_change(self, change, reporter: bool) -> None: ...

    def is_lowest_live_rank(self) -> bool: ...

    def plan_summary(self, fault_free: float | None = None): ...

    def train_batch_size(self) -> int: ...


class RankRuntime:
    """Runs the membership protocol of one rank (see the module doc and :class:`Phase`)."""

    def __init__(self, agent: MembershipAgent, config) -> None:
        self.agent = agent
        self.job = agent.store
        """The job's store (:class:`~ds_recycle.runtime.shared.job_store.JobStore`)."""
        self.config = config
        """The engine's RecycleConfig (join and detect timeouts, checkpoint)."""
        self.engine: Trainee | None = None
        self.phases = PhaseTracker(agent.slot)
        self.watcher: FailureWatcher | None = None

    def attach(self, engine: Trainee) -> None:
        """The engine this runtime drives (called once, at the end of the engine's construction)."""
        self.engine = engine
        self.agent.group_roles = group_roles(engine.topology)
        exit_guard.install()  # before the heartbeat's and the watcher's stops: it runs after them

    @property
    def phase(self) -> Phase:
        return self.phases.phase

    @property
    def phase_listeners(self) -> list[Callable[[Phase], None]]:
        """Called at every phase change (tests and benches park a rank at a phase)."""
        return self.phases.listeners

    def _enter_phase(self, phase: Phase) -> None:
        self.phases.enter(phase)

    # ---- starting ------------------------------------------------------------------------------

    def check_placement(self, environ=os.environ) -> None:
        """With several nodes (contiguous ranks per node), refuse a layout in which one node holds
        every replica of a stage: its loss could not be survived in place."""
        layout = placement.NodeLayout.from_env(environ)
        if not layout.several:
            return
        topo = self.engine.topology
        worker_of = {rank: (topo.get_coord(rank).data, topo.get_coord(rank).pipe) for rank in range(layout.world)}
        nodes = layout.nodes
        domains = placement.domains_of(nodes, self._domain_labels(len(nodes)))
        unsafe = placement.unsafe_nodes(domains, worker_of, topo.get_dim("pipe"))
        if not unsafe:
            return
        domain, stages = next(iter(unsafe.items()))
        ranks = domains[domain]
        if domain.startswith("node "):
            what, spread = f"{domain} holds every replica of stage {stages[0]} (ranks {ranks[0]}..{ranks[-1]})", ""
        else:
            held = [node for node, node_ranks in nodes.items() if node_ranks[0] in ranks]
            what = f"domain {domain} (nodes {held}) holds every replica of stage {stages[0]}"
            spread = " with each stage's replicas in more than one domain"
        message = (
            f"{what}: its loss would stop the job. Build the PipelineModule with "
            f"topology=ds_recycle.pipeline_major_topology(P, D){spread}, or start with "
            "ds-recycle launch --allow-unsafe-placement"
        )
        if environ.get(keys.ENV_ALLOW_UNSAFE_PLACEMENT) == "1":
            logger.warning(f"ReCycle: {message} (allowed)")
            return
        logger.error(f"ReCycle: slot {self.engine.slot} refuses to start: {message}")
        self.agent.stop()
        raise exit_guard.exit(STOP_EXIT_CODE)

    def _domain_labels(self, nodes: int) -> dict[int, str]:
        """Every node's ``--domain`` label, as its agent registered it (before starting its ranks)."""
        return self.job.domain_labels(nodes, GROUP_TIMEOUT_SECONDS)

    def start(self) -> None:
        """A first-start process: heartbeat, failure watcher, SIGTERM-means-leave."""
        self.check_placement()
        self.agent.start_heartbeat()
        self._start_watcher()
        self.agent.install_leave_handler()
        if self.engine.is_lowest_live_rank():
            self.publish_status()
        self._enter_phase(Phase.TRAINING)

    def join(self) -> None:
        """A respawned process: wait to be admitted, enter the world, copy a live replica's state."""
        self._enter_phase(Phase.JOINING)
        self.agent.start_heartbeat()
        admitted_once = False
        while True:
            membership = self.agent.wait_for_admission(self.config.join_timeout, predecessor_removed=admitted_once)
            admitted_once = True
            if self.watcher is None:  # from admission on, a failure among the members concerns it
                self._start_watcher(seen=self.agent.applied)
            try:
                self._enter_epoch(self.agent.decision_creating(membership))
                if self.agent.created_by_recovery(membership):
                    self.engine.resync_tied_weights()  # with the survivors, who re-sync after a rollback
                break
            except EpochSuperseded:
                continue  # a failure among the members while this process waited: join their epoch
            except PeerFailure as failure:
                self._give_up_join(membership, failure)
        self.agent.install_leave_handler()
        self._enter_phase(Phase.TRAINING)
        logger.info(
            f"ReCycle: slot {self.engine.slot} re-joined as worker {self.engine.worker} in epoch {membership.epoch} "
            f"at iteration {self.engine.global_steps} ({time.time() - self.agent.requested_at:.2f} s from its request)"
        )

    def _start_watcher(self, seen: int | None = None) -> None:
        self.watcher = FailureWatcher(
            self.agent.connect_node(), self.engine.slot, self.agent.node_store, self.agent.note_changes
        ).start(seen)
        self.engine.waiter.failed = self.watcher.flag

    def _give_up_join(self, membership: Membership, failure: PeerFailure) -> None:
        """A failure among the members stopped this joiner before its state arrived: it cannot take
        part in their recovery (it has no iteration to restart from), so it ends, the launcher
        publishes that as a failure and respawns it, and the respawn asks to join again."""
        self._enter_phase(Phase.LEFT)
        logger.warning(
            f"ReCycle: slot {self.engine.slot} gives up joining epoch {membership.epoch}: {failure}; it ends "
            f"(exit {keys.JOIN_GIVEN_UP_EXIT_CODE}) and its respawn asks to join again"
        )
        self.agent.stop()
        raise exit_guard.exit(keys.JOIN_GIVEN_UP_EXIT_CODE)

    # ---- one iteration ---------------------------------------------------------------------------

    def run(self, attempt: Callable[[], T], resume: Callable[[], T | None] = lambda: None) -> T:
        """The one entry of the engine's work (an iteration, an evaluation): ``attempt()`` to its end,
        through any failures. A peer's failure is recovered (the survivors roll back to one
        iteration and enter the epoch without the dead), then ``resume()`` may give the result that
        peers had committed before the failure stopped this rank; else ``attempt()`` runs again on
        the new plan. A lost stage stops the job; a dead helper process makes this rank leave."""
        while True:
            try:
                return attempt()
            except PeerFailure as failure:
                self.recover_or_stop(failure)
                result = resume()
                if result is not None:
                    return result
            except StageLostError as lost:
                self._stop(lost)
            except RuntimeError as error:
                if not _is_helper_death(error):
                    raise
                self._leave_after_helper_death(error)

    def between_iterations(self, call: Callable[[], T], what: str) -> T:
        """A collective call that the script makes between two iterations (a checkpoint it saves, the
        HF Trainer's ``checkpoint-N``): ``call()`` runs under the engine's waiter, and a failure
        during it is recovered as one during an iteration (every survivor is at the same boundary,
        so nothing is rolled back); then ``call()`` runs again on the new plan, so what it writes is
        written whole, by the survivors. A call made inside one (the HF Trainer's checkpoint saves
        the engine's) is part of the outer one and runs as it is."""
        if self.engine.waiter.inside_blocking_call():
            return call()
        return self.run(lambda: self.engine.waiter.blocking(call, what))

    def train_batch(self, run: Callable[[], torch.Tensor], checkpoint: Callable[[], None]) -> torch.Tensor:
        """Run one iteration to its committed end, through any failures and membership changes.

        ``checkpoint()`` (a save when one is due) runs after the iteration and before the boundary
        decision, among the members that ran the iteration (a joiner admitted at that boundary has
        no part in it). A failure while it is written is recovered like any other; that checkpoint
        is abandoned (``latest`` still names the previous one) and the next is written at its
        interval.

        A failure after every survivor finished the iteration (in the checkpoint, at the boundary)
        keeps it: the call returns its loss rather than run the next one, whose boundary then takes
        the changes still pending."""
        began, start = time.time(), self.engine.global_steps
        finished: list[torch.Tensor] = []

        def iteration() -> torch.Tensor:
            finished.clear()
            finished.append(run())
            self.agent.publish_iteration_seconds(time.time() - began)
            self._checkpoint(checkpoint)
            self._at_boundary()
            return finished[0]

        def kept() -> torch.Tensor | None:
            return finished[0] if finished and self.engine.global_steps > start else None

        return self.run(iteration, kept)

    def _checkpoint(self, checkpoint: Callable[[], None]) -> None:
        iteration = self.engine.global_steps
        try:
            self.engine.waiter.blocking(checkpoint, f"the checkpoint at iteration {iteration}")
        except PeerFailure as failure:
            logger.info(f"ReCycle: slot {self.engine.slot} abandons the checkpoint at iteration {iteration}: {failure}")
            raise

    def _at_boundary(self) -> None:
        self._enter_phase(Phase.DECIDING)
        self.engine.waiter.check("the iteration boundary")
        decision = self.agent.decide(self.engine.global_steps)
        if decision.next is None:
            self._propose_move(decision)
            self._enter_phase(Phase.TRAINING)
            return
        began = time.time()
        if self.engine.slot not in decision.next.members:
            moves = [c.target for c in decision.changes if c.kind == MOVE and c.slot == self.engine.slot]
            logger.info(
                f"ReCycle: slot {self.engine.slot} (worker {self.engine.worker}) left the job at iteration "
                f"{self.engine.global_steps}"
                + (f": it moves, its device re-joins as slot {moves[-1]}" if moves else "")
            )
            self._leave()
        before = reporting.Before.of(self.engine)
        self._check_survivable(decision.next)
        self._enter_epoch(decision)
        self.engine.check_data_available()
        self._report(decision, before, began)
        self._propose_move(decision)
        self._enter_phase(Phase.TRAINING)

    def _propose_move(self, decision: Decision) -> None:
        """After a decision with changes, the lowest member proposes the migration that pays, if a
        slot is retired (:mod:`ds_recycle.runtime.rank.rebalance`); the coordinator validates it."""
        if not decision.changes or not self.engine.is_lowest_live_rank():
            return
        retired, under_way = self.agent.migrations()
        if not retired:
            return
        per_node = placement.NodeLayout.from_env(world=self.engine.topology.world_size()).per_node
        proposal = rebalance.propose(self.engine, retired, under_way, per_node)
        if proposal is None:
            logger.info(
                f"ReCycle: retired slots {sorted(retired)}: no move pays (predicted gain < {rebalance.MIN_GAIN:.0%})"
            )
            return
        logger.info(f"ReCycle: slot {self.engine.slot} proposes to {proposal.describe()}")
        self.agent.request(MOVE, slot=proposal.mover, target=proposal.target)

    def _enter_epoch(self, decision: Decision, by_recovery: bool = False) -> None:
        """Enter the epoch ``decision`` makes (``by_recovery``: the survivors' decision, which the
        node's agent copies with the key every member waits for): every member counted in, then
        its world, its grid, and the joiners' state from the decision's holders."""
        membership = decision.next
        self._enter_phase(Phase.ENTERING)
        announced = (lambda: False) if self.watcher is None else self.watcher.flag.is_set
        self.agent.enter(membership, announced, GROUP_TIMEOUT_SECONDS, copied=by_recovery)
        self._enter_phase(Phase.BUILDING)
        engine = self.engine
        kept = engine.grid.keep(decision, engine.slot)
        rebuild_world(
            self.agent.store, membership, engine.slot, GROUP_TIMEOUT_SECONDS, kept.values(), communication.job_backend()
        )
        grid = RecycleGrid.build(
            engine.topology,
            membership,
            engine.slot,
            GROUP_TIMEOUT_SECONDS,
            engine.grid.links,
            kept,
            decision.remade,
        )
        self.engine.install_grid(grid)
        rejoin.transfer_state(self.engine, grid, decision.holders())

    # ---- recovery from an unplanned failure ------------------------------------------------------

    def recover_or_stop(self, failure: PeerFailure) -> None:
        try:
            self._recover(failure)
        except StageLostError as lost:
            self._stop(lost)

    def _recover(self, failure: PeerFailure) -> None:
        """Make the interrupted iteration consistent and continue on the plan without the dead.

        The survivors agree on one decision: the new membership and the iteration they all restart
        from, the least any of them finished. A survivor that has finished that iteration, or
        stepped it, undoes its step in place; then everyone enters the new epoch and runs the
        iteration again on the new plan."""
        self._enter_phase(Phase.RECOVERING)
        engine = self.engine
        detected = self.watcher.raised_at or time.time()
        logger.info(f"ReCycle: slot {engine.slot} stopped by a failure at iteration {engine.global_steps}: {failure}")
        abort_communicators(  # NCCL: ops on the dead peer spin on the GPU until then
            lambda seconds: logger.info(
                f"ReCycle: slot {engine.slot} aborted its NCCL communicators in {seconds * 1e3:.1f} ms"
            )
        )
        # A round whose epoch is not entered to the end is reported with the round that is: one line
        # from the epoch this recovery started in, with every change decided on the way.
        reported_from = reporting.Before.of(engine)
        decided: tuple[Change, ...] = ()
        rolled_back = False
        for _ in range(MAX_RECOVERY_ROUNDS):
            before = reporting.Before.of(engine)
            grid = engine.grid
            progress = Progress(
                engine.global_steps, engine.stepped_inflight, grid.membership.epoch, grid.group_states()
            )
            decision = self.agent.recover(progress, before.members, self.config.detect_timeout, GROUP_TIMEOUT_SECONDS)
            self.watcher.acknowledge(self.agent.applied)
            logger.info(
                f"ReCycle: slot {engine.slot} recovery decision: epoch {decision.next.epoch} members "
                f"{list(decision.next.members)}, restart at iteration {decision.iteration} (this slot finished "
                f"{progress.done}, stepped in flight: {progress.stepped})"
            )
            decided += decision.changes
            began = time.time()
            rolled_back = engine.roll_back_to(decision.iteration) or rolled_back
            if engine.slot not in decision.next.members:
                logger.info(f"ReCycle: slot {engine.slot} left the job in its recovery at iteration {progress.done}")
                self._leave()
            self._check_survivable(decision.next)
            try:
                self._enter_epoch(decision, by_recovery=True)
                engine.resync_tied_weights()
            except (PeerFailure, EpochSuperseded) as again:
                self._enter_phase(Phase.RECOVERING)
                logger.info(f"ReCycle: slot {engine.slot}: another failure during recovery ({again}); deciding again")
                continue
            engine.check_data_available()
            self._report(
                dataclasses.replace(decision, changes=decided),
                reported_from,
                began,
                detected=detected,
                rolled_back=rolled_back,
            )
            self._propose_move(decision)
            self._enter_phase(Phase.TRAINING)
            return
        raise RuntimeError(f"ReCycle: no consistent epoch after {MAX_RECOVERY_ROUNDS} recovery rounds")

    # ---- ends ----------------------------------------------------------------------------------

    def _check_survivable(self, membership: Membership) -> None:
        topo = self.engine.topology
        live_stages = {topo.get_coord(slot).pipe for slot in membership.members}
        empty = [s for s in range(topo.get_dim("pipe")) if s not in live_stages]
        if empty:
            raise StageLostError(
                f"stage {empty[0]} has no live worker left in epoch {membership.epoch}: training cannot "
                "continue in place."
            )

    def _stop(self, lost: StageLostError) -> None:
        """Training cannot go on in place (a stage lost every worker, or the plan of a failure set
        cannot fit in memory): say why and what follows, once, and end this rank so that the
        launcher restarts every rank from the latest checkpoint (exit 75), or stops the job without one."""
        self._enter_phase(Phase.STOPPED)
        config = self.config.checkpoint
        logger.error(
            f"ReCycle: slot {self.engine.slot} stops: {lost} Last finished iteration: {self.engine.global_steps}. "
            f"{checkpoints.after_stop(config)}"
        )
        self.agent.stop()
        raise exit_guard.exit(STOP_EXIT_CODE if checkpoints.latest_tag(config) is None else RESTART_EXIT_CODE)

    def _leave(self) -> None:
        self._enter_phase(Phase.LEFT)
        self.agent.stop()
        raise exit_guard.exit(0)

    def _leave_after_helper_death(self, error: RuntimeError) -> None:
        """A helper process of this rank (a DataLoader worker of the script's data iterator) died:
        the iterator cannot give this iteration's micro-batches, so the rank cannot finish it. It
        ends now, non-zero, and the launcher publishes that as a failure at once: the survivors
        roll the iteration back and re-run it without this worker, and a respawn re-joins."""
        self._enter_phase(Phase.LEFT)
        cause = "after a leave signal" if self.agent.leave_requested else "unexpectedly"
        logger.error(
            f"ReCycle: slot {self.engine.slot} (worker {self.engine.worker}) lost a helper process {cause} ({error}); "
            f"it cannot finish iteration {self.engine.global_steps}, so it leaves now as a failure and the "
            "survivors re-run it"
        )
        self.agent.stop()
        raise exit_guard.exit(HELPER_LOST_EXIT_CODE)

    def _report(
        self,
        decision: Decision,
        before: reporting.Before,
        began: float,
        detected: float | None = None,
        rolled_back: bool = False,
    ) -> None:
        change = reporting.membership_change(
            self.engine, decision, before, time.time() - began, detected=detected, rolled_back=rolled_back
        )
        reporter = reporting.is_status_writer(self.engine, before.members)
        self.engine.record_change(change, reporter)
        if reporter:
            self.publish_status(change)

    def publish_status(self, change: MembershipChange | None = None) -> None:
        """Write the job's status record (:func:`reporting.publish_status`); called on its one writer."""
        reporting.publish_status(self.job, self.engine, change)


def _is_helper_death(error: RuntimeError) -> bool:
    """torch raises this in the main thread (from its SIGCHLD handler, or at the next batch) when a
    DataLoader worker process ends by a signal or exits unexpectedly."""
    return "DataLoader worker" in str(error)
