"""Plans ready before they are needed: the plan of every next failure, made in a background thread
into a plan cache, so that when a worker (or a node) fails, its plan is a cache hit instead of a
planner run on the recovery's critical path.

"Next failure" means one failure away from the failure set in use: the failed workers plus any one
live worker, and plus all live workers of any one node (the usual unit of failure), when that leaves
every stage a survivor. The engine asks again whenever its plan changes (a new epoch, new measured
costs); a newer request abandons what is left of an older one. The plans are made with the very
request the engine will make (the same costs, memory cap and options), so a prefetched plan is the
plan the failure would have got, and every rank has the same one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from ds_recycle.log import logger
from ds_recycle.planner.cache import PlanCache
from ds_recycle.planner.plan import Worker
from ds_recycle.planner.request import PlanRequest

Nodes = tuple[tuple[Worker, ...], ...]
"""The workers of each node, when the job runs on several (empty: one node)."""


def next_failure_sets(request: PlanRequest, nodes: Nodes = ()) -> Iterator[tuple[Worker, ...]]:
    """Every failure set one worker or one node of ``nodes`` beyond ``request.failed`` that leaves
    each stage a live worker, each once, single workers first."""
    D, P = request.pipelines, request.stages
    failed = set(request.failed)
    seen: set[tuple[Worker, ...]] = set()
    candidates = [{(p, s)} for s in range(P) for p in range(D) if (p, s) not in failed]
    candidates += [set(node) - failed for node in nodes]
    for extra in candidates:
        workers = tuple(sorted(failed | extra))
        if not extra or workers in seen:
            continue
        seen.add(workers)
        lost = {s: sum(1 for _, t in workers if t == s) for s in range(P)}
        if all(lost[s] < D for s in range(P)):
            yield workers


class PlanPrefetcher:
    """Plans :func:`next_failure_sets` into ``cache`` in one daemon thread (see the module doc)."""

    def __init__(self, cache: PlanCache) -> None:
        self.cache = cache
        self.planned = 0
        """Canonical failure sets this thread planned, over its life (an equivalent set, one
        that differs by a relabelling of the pipelines, shares its plan)."""
        self.seconds = 0.0
        """Time spent on them."""
        self.done: PlanRequest | None = None
        """The last request covered to its end."""
        self._latest: tuple[PlanRequest, Nodes] | None = None
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._thread: threading.Thread | None = None

    def request(self, request: PlanRequest, nodes: Nodes = ()) -> None:
        """Cover the next failures of ``request`` on ``nodes`` (dropping the rest of an earlier
        request)."""
        self._latest = (request, tuple(tuple(node) for node in nodes))
        self._idle.clear()
        self._wake.set()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="recycle-plan-prefetch", daemon=True)
            self._thread.start()

    def wait_idle(self, timeout: float) -> bool:
        """Whether the latest request was covered within ``timeout`` seconds (benchmarks, tests)."""
        return self._idle.wait(timeout)

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            latest = self._latest
            if latest is None or self._cover(latest):
                self.done = None if latest is None else latest[0]
                if self._latest is latest:
                    self._idle.set()

    def _cover(self, latest: tuple[PlanRequest, Nodes]) -> bool:
        request, nodes = latest
        for failed in next_failure_sets(request, nodes):
            if self._latest is not latest:
                return False
            began = time.perf_counter()
            try:
                planned = self.cache.ensure(request.with_failed(failed))
            except ValueError as error:  # no plan for this set: the failure path will say so itself
                logger.debug(f"ReCycle: no plan prefetched for failed {list(failed)}: {error}")
                continue
            if planned:
                self.planned += 1
                self.seconds += time.perf_counter() - began
        return True
