"""One rank of a multi-process engine test (a :mod:`ds_recycle.testing.engine_runs` rank script).

For each run in --runs, it builds the GPT pipeline afresh from the same seed, initializes the requested engine,
trains --steps iterations on the deterministic provider, evaluates one batch, and writes out/<run>/rank<N>.pt with
the losses, the eval loss, initial and final parameters, instruction events and, for ReCycle, the global gradient
norms it computed and the cost model it planned with.
"""

from __future__ import annotations

import argparse

import torch.distributed as dist

from ds_recycle.data import pipeline_iterator
from ds_recycle.testing.engine_runs import TokenWindows, initialize, main, make_optimizer
from ds_recycle.testing.tiny import tiny_pipeline


def run_one(run: dict, args: argparse.Namespace) -> dict:
    tiny = tiny_pipeline(args.pp, seed=run.get("seed", 0), checkpoint=run.get("checkpoint", 0))
    model = tiny.model
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optimizer = make_optimizer(run["optimizer"], model)
    dataset = TokenWindows(tiny.tokens, tiny.cfg.seq_len) if run.get("data") == "dataset" else None
    engine = initialize(run["engine"], model=model, optimizer=optimizer, config=run["config"], training_data=dataset)
    provider = tiny.provider(engine.train_micro_batch_size_per_gpu())
    data = pipeline_iterator(provider, engine.grid.get_data_parallel_id(), engine.gradient_accumulation_steps())
    if dataset is not None:
        data = None  # the engine loads from training_data itself
    losses, norms, events, costs = [], [], [], []
    for _ in range(args.steps):
        losses.append(float(engine.train_batch(data)))
        stepper = getattr(engine, "stepper", None)
        norms.append(getattr(stepper, "last_grad_norm", None))
        events.append([tuple(vars(e).values()) for e in getattr(engine, "instruction_events", [])])
        tracker = getattr(getattr(engine, "costs", None), "tracker", None)
        costs.append(None if tracker is None else tracker.in_use.to_dict())
    eval_data = pipeline_iterator(
        provider, engine.grid.get_data_parallel_id(), engine.gradient_accumulation_steps(), 99
    )
    return {
        "rank": dist.get_rank(),
        "stage": engine.stage_id,
        "pipeline": engine.grid.get_data_parallel_id(),
        "engine": type(engine).__name__,
        "losses": losses,
        "eval_loss": float(engine.eval_batch(eval_data)),
        "grad_norms": norms,
        "initial": initial,
        "params": {k: v.detach().clone() for k, v in engine.module.state_dict().items()},
        "events": events,
        "costs": costs,
    }


if __name__ == "__main__":
    main(run_one, steps=5)
