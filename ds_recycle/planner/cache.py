"""The plan cache: an in-memory dict in front of an optional on-disk JSON directory.

Entries are keyed by topology (D, P, m), cost model, memory cap, schedule options, solver and the
canonical failure set (:func:`normalize.canonical`), so relabelled failure sets share one entry.
The stored plan is the one for the canonical labels; a lookup maps it back to the caller's labels.
On disk every entry is one JSON file ``<sha1 of key>.json`` holding ``{"key": ..., "plan": ...}``,
so concurrent writers never corrupt each other's entries. Returned plans are shared with the
cache: treat them as read-only.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

from ds_recycle.planner.heuristic import canonical_labels, plan_heuristic
from ds_recycle.planner.lower_bound import check_survivors
from ds_recycle.planner.normalize import canonical, invert, relabel
from ds_recycle.planner.plan import Plan, Worker
from ds_recycle.planner.request import PlanRequest

MAX_RELABELLED = 4096

Planner = Callable[..., Plan]
"""``planner(D, P, m, failed, costs=..., memory_cap=..., options=...) -> Plan``."""


class PlanCache:
    def __init__(self, path: str | Path | None = None, planner: Planner = plan_heuristic, solver: str = "heuristic"):
        self.path = Path(path) if path is not None else None
        if self.path is not None:
            self.path.mkdir(parents=True, exist_ok=True)
        self.planner = planner
        self.solver = solver
        self.memory: dict[str, Plan] = {}
        self.relabelled: dict[tuple[str, tuple[Worker, ...]], Plan] = {}
        """Plans already mapped to a caller's labels, so that repeated hits skip the relabelling."""
        self.hits = 0
        self.misses = 0
        self._lock = threading.Lock()
        """Guards the dicts and counters: a background thread may plan into the cache (plans are
        made outside it)."""

    def key(self, request: PlanRequest) -> tuple[str, list[int]]:
        """The cache key of a request and the permutation to its canonical labels."""
        canon, permutation = canonical_labels(request)
        key = json.dumps(
            {
                "topology": [request.pipelines, request.stages, request.microbatches],
                "costs": request.costs.to_dict(),
                "memory_cap": request.memory_cap,
                "failed": [list(w) for w in canon],
                "decoupled": request.options.decoupled,
                "staggered": request.options.staggered,
                "solver": self.solver,
            },
            sort_keys=True,
        )
        return key, permutation

    def get(self, request: PlanRequest) -> Plan | None:
        """The cached plan for ``request``, or None."""
        with self._lock:
            return self._get(request)

    def get_or_plan(self, request: PlanRequest) -> Plan:
        """The cached plan for ``request``, planning (and storing) it on a miss."""
        with self._lock:
            plan = self._get(request)
            if plan is not None:
                return plan
            self.misses += 1
        check_survivors(request.pipelines, request.stages, request.failed)
        key, permutation = self.key(request)
        plan = self._plan(request, key)
        with self._lock:
            return self._remember(key, request.failed, _to_labels(plan, permutation, request.failed))

    def ensure(self, request: PlanRequest) -> bool:
        """Have the plan of ``request``'s canonical failure set in the cache, planning it if it is
        not, but keep no copy in the request's labels (a later lookup makes the one it needs).
        Whether it planned. Neither a hit nor a miss."""
        check_survivors(request.pipelines, request.stages, request.failed)
        key, _ = self.key(request)
        with self._lock:
            if key in self.memory:
                return False
        stored = self._load(key) if self.path is not None else None
        if stored is not None:
            with self._lock:
                self.memory[key] = stored
            return False
        self._plan(request, key)
        return True

    def _plan(self, request: PlanRequest, key: str) -> Plan:
        """Plan the canonical failure set of ``key`` and store it."""
        canon = json.loads(key)["failed"]
        plan = self.planner(
            request.pipelines,
            request.stages,
            request.microbatches,
            [tuple(w) for w in canon],
            costs=request.costs,
            memory_cap=request.memory_cap,
            options=request.options,
        )
        if self.path is not None:
            self._store(key, plan)
        with self._lock:
            self.memory[key] = plan
        return plan

    def _get(self, request: PlanRequest) -> Plan | None:
        key, permutation = self.key(request)
        mapped = self.relabelled.get((key, request.failed))
        if mapped is not None:
            self.hits += 1
            return mapped
        plan = self.memory.get(key)
        if plan is None and self.path is not None:
            plan = self._load(key)
            if plan is not None:
                self.memory[key] = plan
        if plan is None:
            return None
        self.hits += 1
        return self._remember(key, request.failed, _to_labels(plan, permutation, request.failed))

    def _remember(self, key: str, failed: tuple[Worker, ...], plan: Plan) -> Plan:
        if len(self.relabelled) >= MAX_RELABELLED:
            self.relabelled.pop(next(iter(self.relabelled)))  # the oldest
        self.relabelled[(key, failed)] = plan
        return plan

    def __len__(self) -> int:
        return len(self.memory)

    def _file(self, key: str) -> Path:
        assert self.path is not None
        return self.path / (hashlib.sha1(key.encode()).hexdigest() + ".json")

    def _load(self, key: str) -> Plan | None:
        file = self._file(key)
        if not file.exists():
            return None
        data = json.loads(file.read_text())
        if data.get("key") != key:
            return None  # a hash collision: plan it again
        return Plan.from_dict(data["plan"])

    def _store(self, key: str, plan: Plan) -> None:
        file = self._file(key)
        fd, tmp = tempfile.mkstemp(dir=file.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as out:
            json.dump({"key": key, "plan": plan.to_dict()}, out)
        os.replace(tmp, file)


def canonical_failure_sets(pipelines: int, stages: int, max_failures: int) -> Iterator[tuple[Worker, ...]]:
    """Every canonical failure set of size 0..max_failures that leaves each stage a survivor,
    each exactly once. A canonical set is a multiset of per-pipeline sets of failed stages."""
    subsets = [
        combo
        for size in range(1, min(max_failures, stages) + 1)
        for combo in itertools.combinations(range(stages), size)
    ]
    subsets.sort()
    seen = set()

    def extend(start: int, chosen: list[tuple[int, ...]], budget: int) -> Iterator[list[tuple[int, ...]]]:
        yield chosen
        if len(chosen) == pipelines:
            return
        for i in range(start, len(subsets)):
            if len(subsets[i]) <= budget:
                yield from extend(i, chosen + [subsets[i]], budget - len(subsets[i]))

    for chosen in extend(0, [], max_failures):
        failed = [(p, s) for p, stages_ in enumerate(chosen) for s in stages_]
        per_stage = [0] * stages
        for _p, s in failed:
            per_stage[s] += 1
        if any(f >= pipelines for f in per_stage):
            continue
        key, _ = canonical(pipelines, stages, failed)
        if key not in seen:
            seen.add(key)
            yield key


def _to_labels(plan: Plan, permutation: list[int], failed: tuple[Worker, ...]) -> Plan:
    if permutation == sorted(permutation):  # identity: share the cached op lists
        return replace(plan, failed=failed, extra=dict(plan.extra))
    out = relabel(plan, invert(permutation))
    out.failed = failed
    return out
