"""One rank of the measured-costs tests (tests/engine/test_profile.py), a
:mod:`ds_recycle.testing.engine_runs` rank script.

For each run in --runs it builds the GPT pipeline from one seed, trains ``steps`` iterations from
a map-style dataset (so any worker can load any micro-batch), switches ``recycle.emulate_timing``
at the iterations ``switch`` names (a straggler that recovers, stages that get slower), and writes
out/<run>/rank<N>.pt: losses, final parameters, the F ledger, and per iteration the cost model
in use and the micro-batches each straggler handed over, plus the engine's cost changes.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch.distributed as dist

from ds_recycle.config import RecycleConfig
from ds_recycle.data import pipeline_iterator
from ds_recycle.testing.engine_runs import TokenWindows, initialize, main, make_optimizer
from ds_recycle.testing.tiny import tiny_pipeline


def run_one(run: dict, args: argparse.Namespace) -> dict:
    tiny = tiny_pipeline(args.pp)
    optimizer = make_optimizer("sgd", tiny.model)
    dataset = TokenWindows(tiny.tokens, tiny.cfg.seq_len)
    engine = initialize("recycle", model=tiny.model, optimizer=optimizer, config=run["config"], training_data=dataset)
    engine.forward_ledger = []
    switch = {int(i): timing for i, timing in run.get("switch", {}).items()}
    provider = tiny.provider(engine.train_micro_batch_size_per_gpu())
    losses, costs, gives, profiles, evaluated = [], [], [], [], []
    for i in range(run["steps"]):
        if i in switch:
            timing = RecycleConfig.from_section({"emulate_timing": switch[i]}).emulate_timing
            engine.recycle = dataclasses.replace(engine.recycle, emulate_timing=timing)
        losses.append(float(engine.train_batch()))
        costs.append(engine.costs.tracker.in_use.to_dict())
        gives.append(dict(engine.plan.extra.get("give", {})))
        last = engine.costs.tracker.last
        profiles.append(None if last is None else dataclasses.asdict(last))
        if engine.costs.tracker.in_use.slow and not evaluated:
            # Eval data from an iterator while a straggler is planned around: it holds only this
            # pipeline's micro-batches, so the straggler must evaluate its own.
            home = engine.grid.get_data_parallel_id()
            data = pipeline_iterator(provider, home, engine.gradient_accumulation_steps(), 99)
            evaluated.append((i, float(engine.eval_batch(data))))
    return {
        "rank": dist.get_rank(),
        "worker": engine.worker,
        "losses": losses,
        "params": {k: v.detach().clone() for k, v in engine.module.state_dict().items()},
        "ledger": list(engine.forward_ledger),
        "costs": costs,
        "gives": gives,
        "evaluated": evaluated,
        "profiles": profiles,
        "changes": [dataclasses.asdict(change) for change in engine.costs.changes],
        "events": [tuple(vars(e).values()) for e in engine.instruction_events],
    }


if __name__ == "__main__":
    main(run_one)
