"""The one owner of the failure path on a rank: join, boundary decision, recovery, rollback, stop.

Under ``ds-recycle launch`` every ReCycle engine gets a :class:`RankRuntime`. The engine only runs
instruction streams; everything about membership happens here, top-down, in
:meth:`RankRuntime.train_batch`:

1. run the iteration (the engine's own ``train_batch``);
2. at its boundary the members take one shared decision (:meth:`MembershipAgent.decide`); when
   workers left or joined, every member enters the new epoch: a fresh world and grid
   (:mod:`~ds_recycle.runtime.groups`), joiners' state from a live replica
   (:mod:`~ds_recycle.runtime.rejoin`), and the plan of the new failure set;
3. a :class:`~ds_recycle.runtime.waiting.PeerFailure` (the failure watcher saw the coordinator
   publish a failure of a peer, or a gloo operation failed) stops the iteration; the survivors agree
   on the iteration they all restart from (:meth:`MembershipAgent.recover`), each rolls back to it
   (:meth:`Trainee.roll_back_to`), and they enter the epoch without the dead and run it again, so no
   sample is lost or counted twice;
4. a stage with no live worker stops the job: exit 75 (restart every rank from the latest
   checkpoint) or 76 (no checkpoint: stop).

:class:`Trainee` is all the runtime needs of the engine.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Protocol

import torch

from ds_recycle.log import logger
from ds_recycle.runtime import exit_guard, placement, rebalance, rejoin, reporting
from ds_recycle.runtime import protocol as proto
from ds_recycle.runtime.events import MembershipChange
from ds_recycle.runtime.groups import GROUP_TIMEOUT_SECONDS, RecycleGrid, group_roles, rebuild_world
from ds_recycle.runtime.membership import EpochSuperseded, MembershipAgent
from ds_recycle.runtime.protocol import RESTART_EXIT_CODE, STOP_EXIT_CODE, Change, Decision, Membership, Progress
from ds_recycle.runtime.waiting import FailureWatcher, PeerFailure

MAX_RECOVERY_ROUNDS = 8
HELPER_LOST_EXIT_CODE = 3
"""A rank whose helper process (a DataLoader worker) died ends with this code: a failure."""


class Phase(enum.Enum):
    """Where a rank stands in the membership protocol. These transitions are the spec:

    - ``STARTING`` -> ``TRAINING`` (a first start: heartbeat, failure watcher, leave signals) or
      ``JOINING`` (a respawned process).
    - ``JOINING`` -> ``TRAINING``: admitted by a decision, world entered, state copied from a live
      replica. An epoch superseded while entering (a failure among the members): ``JOINING`` again.
      A failure announced among the members before its state arrived: ``LEFT`` (it gives up its
      join, exit 77, and the launcher respawns it).
    - ``TRAINING`` -> ``DECIDING`` at every iteration boundary; -> ``RECOVERING`` when a peer
      failure interrupts the iteration.
    - ``DECIDING`` -> ``TRAINING`` (no change), ``ENTERING`` (members changed) or ``LEFT`` (this
      slot left).
    - ``RECOVERING`` -> ``ENTERING`` (the survivors agreed on the restart iteration and this rank
      rolled back to it) or ``LEFT`` (this slot's leave was decided with the failure).
    - ``ENTERING`` -> ``BUILDING`` once every member counted itself in: the world and the groups
      are made (they connect lazily, in ops waited for against the failure flag), joiners get
      their state.
    - ``BUILDING`` -> ``TRAINING``. ``ENTERING`` or ``BUILDING`` -> ``RECOVERING`` when a failure
      interrupts it.
    - any phase -> ``STOPPED`` when a stage has no live worker left.
    """

    STARTING = "starting"
    JOINING = "joining"
    TRAINING = "training"
    DECIDING = "deciding"
    RECOVERING = "recovering"
    ENTERING = "entering"
    BUILDING = "building"
    LEFT = "left"
    STOPPED = "stopped"


class StageLostError(RuntimeError):
    """Every worker of a stage is gone: there is no replica left to re-route to."""


class Trainee(Protocol):
    """What the runtime needs of the engine (RecyclePipelineEngine implements it)."""

    slot: int
    global_steps: int
    grid: RecycleGrid

    @property
    def worker(self) -> tuple[int, int]: ...

    @property
    def stepped_inflight(self) -> bool: ...

    def install_grid(self, grid: RecycleGrid) -> None: ...

    def roll_back_to(self, iteration: int) -> bool: ...

    def resync_tied_weights(self) -> None: ...

    def check_data_available(self) -> None: ...

    def record_change(self, change) -> None: ...

    def is_lowest_live_rank(self) -> bool: ...

    def predicted_iteration_time(self, failed: tuple[tuple[int, int], ...]) -> float: ...


class RankRuntime:
    """Runs the membership protocol of one rank (see the module doc and :class:`Phase`)."""

    def __init__(self, engine: Trainee, agent: MembershipAgent, config) -> None:
        self.engine = engine
        self.agent = agent
        agent.group_roles = group_roles(engine.module._topo)
        self.config = config
        """The engine's RecycleConfig (join and detect timeouts, checkpoint)."""
        self.phase = Phase.STARTING
        self.watcher: FailureWatcher | None = None
        self.phase_listeners: list[Callable[[Phase], None]] = []
        """Called at every phase change (tests and benches park a rank at a phase)."""
        exit_guard.install()  # before the heartbeat's and the watcher's stops: it runs after them

    def _enter_phase(self, phase: Phase) -> None:
        self.phase = phase
        for listener in self.phase_listeners:
            listener(phase)

    @property
    def failure_flag(self):
        return self.watcher.flag

    # ---- starting ------------------------------------------------------------------------------

    def check_placement(self, environ=os.environ) -> None:
        """With several nodes (contiguous ranks per node), refuse a layout in which one node holds
        every replica of a stage: its loss could not be survived in place."""
        world, per_node = int(environ.get("WORLD_SIZE", 1)), int(environ.get("LOCAL_WORLD_SIZE", 0) or 0)
        if not 0 < per_node < world:
            return
        topo = self.engine.module._topo
        worker_of = {rank: (topo.get_coord(rank).data, topo.get_coord(rank).pipe) for rank in range(world)}
        nodes = placement.contiguous_nodes(world, per_node)
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
            f"topology=ds_recycle.runtime.placement.pipeline_major_topology(P, D){spread}, or start with "
            "ds-recycle launch --allow-unsafe-placement"
        )
        if environ.get(proto.ENV_ALLOW_UNSAFE_PLACEMENT) == "1":
            logger.warning(f"ReCycle: {message} (allowed)")
            return
        logger.error(f"ReCycle: slot {self.engine.slot} refuses to start: {message}")
        self.agent.stop()
        raise exit_guard.exit(STOP_EXIT_CODE)

    def _domain_labels(self, nodes: int) -> dict[int, str]:
        """Every node's ``--domain`` label, as its agent registered it (before starting its ranks)."""
        keys = [proto.domain_key(node) for node in range(nodes)]
        self.agent.store.wait(keys, timedelta(seconds=GROUP_TIMEOUT_SECONDS))
        return {node: self.agent.store.get(key).decode() for node, key in enumerate(keys)}

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
            f"(exit {proto.JOIN_GIVEN_UP_EXIT_CODE}) and its respawn asks to join again"
        )
        self.agent.stop()
        raise exit_guard.exit(proto.JOIN_GIVEN_UP_EXIT_CODE)

    # ---- one iteration ---------------------------------------------------------------------------

    def train_batch(self, run: Callable[[], torch.Tensor], checkpoint: Callable[[], None]) -> torch.Tensor:
        """Run one iteration to its committed end, through any failures and membership changes.

        ``checkpoint()`` (a save when one is due) runs after the iteration and before the boundary
        decision, among the members that ran the iteration (a joiner admitted at that boundary has
        no part in it). A failure while it is written is recovered like any other; that checkpoint
        is abandoned (``latest`` still names the previous one) and the next is written at its
        interval."""
        began = time.time()
        while True:
            try:
                loss = run()
                self.agent.publish_iteration_seconds(time.time() - began)
                self._checkpoint(checkpoint)
                self._at_boundary()
                return loss
            except PeerFailure as failure:
                self.recover_or_stop(failure)
            except StageLostError as lost:
                self._stop(lost)
            except RuntimeError as error:
                if not _is_helper_death(error):
                    raise
                self._leave_after_helper_death(error)

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
            moves = [c.target for c in decision.changes if c.kind == proto.MOVE and c.slot == self.engine.slot]
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
        slot is retired (:mod:`ds_recycle.runtime.rebalance`); the coordinator validates it."""
        if not decision.changes or not self.engine.is_lowest_live_rank():
            return
        retired, under_way = self.agent.migrations()
        if not retired:
            return
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 0) or 0) or self.engine.module._topo.world_size()
        proposal = rebalance.propose(self.engine, retired, under_way, per_node)
        if proposal is None:
            logger.info(
                f"ReCycle: retired slots {sorted(retired)}: no move pays (predicted gain < {rebalance.MIN_GAIN:.0%})"
            )
            return
        logger.info(f"ReCycle: slot {self.engine.slot} proposes to {proposal.describe()}")
        self.agent.request(proto.MOVE, slot=proposal.mover, target=proposal.target)

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
        rebuild_world(self.agent.store, membership, engine.slot, GROUP_TIMEOUT_SECONDS, kept.values())
        grid = RecycleGrid.build(
            engine.module._topo,
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
        topo = self.engine.module._topo
        live_stages = {topo.get_coord(slot).pipe for slot in membership.members}
        empty = [s for s in range(topo.get_dim("pipe")) if s not in live_stages]
        if not empty:
            return
        config, tag = self.config.checkpoint, self._latest_checkpoint()
        if config is None:
            after = "No checkpoint is configured (recycle.checkpoint), so the job stops here."
        elif tag is None:
            after = f"No checkpoint was written yet in {config.dir}, so the job stops here."
        else:
            after = (
                f"Last checkpoint: {tag} in {config.dir}; ds-recycle launch --respawn restarts every rank "
                "from it (without --respawn the job ends with exit code 75)."
            )
        raise StageLostError(
            f"stage {empty[0]} has no live worker left in epoch {membership.epoch}: training cannot "
            f"continue in place. Last finished iteration: {self.engine.global_steps}. {after}"
        )

    def _latest_checkpoint(self) -> str | None:
        from ds_recycle.engine import checkpoint

        return checkpoint.latest_tag(self.config.checkpoint)

    def _stop(self, lost: StageLostError) -> None:
        """Training cannot go on in place: say why, once, and end this rank so that the launcher
        restarts every rank from the latest checkpoint (exit 75), or stops the job without one."""
        self._enter_phase(Phase.STOPPED)
        logger.error(f"ReCycle: slot {self.engine.slot} stops: {lost}")
        self.agent.stop()
        raise exit_guard.exit(STOP_EXIT_CODE if self._latest_checkpoint() is None else RESTART_EXIT_CODE)

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
        self.engine.record_change(change)
        if reporting.is_status_writer(self.engine, before.members):
            self.publish_status(change)

    def publish_status(self, change: MembershipChange | None = None) -> None:
        """Write the job's status record (:func:`reporting.publish_status`); called on its one writer."""
        reporting.publish_status(self.agent.store, self.engine, change)


def _is_helper_death(error: RuntimeError) -> bool:
    """torch raises this in the main thread (from its SIGCHLD handler, or at the next batch) when a
    DataLoader worker process ends by a signal or exits unexpectedly."""
    return "DataLoader worker" in str(error)
