"""One rank of the measured-costs tests (tests/engine/test_profile.py). Started by our launcher.

For each run in --runs it builds the GPT pipeline from one seed, trains ``steps`` iterations from
a map-style dataset (so any worker can load any micro-batch), switches ``recycle.emulate_timing``
at the iterations ``switch`` names (a straggler that recovers, stages that get slower), and writes
out/<run>/rank<N>.pt: losses, final parameters, the F ledger, and per iteration the cost model
in use and the micro-batches each straggler handed over, plus the engine's cost changes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from worker import TokenWindows  # noqa: E402

import ds_recycle  # noqa: E402
from ds_recycle.config import RecycleConfig  # noqa: E402
from ds_recycle.data import TokenWindowProvider, pipeline_iterator, shipped_corpus_tokens  # noqa: E402
from ds_recycle.models import build_gpt_pipeline  # noqa: E402
from ds_recycle.testing.tiny import TINY_GPT  # noqa: E402


def run_one(run: dict, pp: int, out: Path) -> None:
    tokenizer, tokens = shipped_corpus_tokens()
    cfg = TINY_GPT.config(tokenizer.vocab_size)
    model = build_gpt_pipeline(cfg, num_stages=pp, seed=0)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=5e-2, momentum=0.9)
    dataset = TokenWindows(tokens, cfg.seq_len)
    engine, _, _, _ = ds_recycle.initialize(
        model=model, optimizer=optimizer, config=run["config"], training_data=dataset
    )
    engine.forward_ledger = []
    switch = {int(i): timing for i, timing in run.get("switch", {}).items()}
    provider = TokenWindowProvider(tokens, cfg.seq_len, engine.train_micro_batch_size_per_gpu(), seed=0)
    losses, costs, gives, profiles, evaluated = [], [], [], [], []
    for i in range(run["steps"]):
        if i in switch:
            timing = RecycleConfig.from_section({"emulate_timing": switch[i]}).emulate_timing
            engine.recycle = dataclasses.replace(engine.recycle, emulate_timing=timing)
        losses.append(float(engine.train_batch()))
        costs.append(engine.cost_tracker.in_use.to_dict())
        gives.append(dict(engine.plan.extra.get("give", {})))
        last = engine.cost_tracker.last
        profiles.append(None if last is None else dataclasses.asdict(last))
        if engine.cost_tracker.in_use.slow and not evaluated:
            # Eval data from an iterator while a straggler is planned around: it holds only this
            # pipeline's micro-batches, so the straggler must evaluate its own.
            home = engine.grid.get_data_parallel_id()
            data = pipeline_iterator(provider, home, engine.gradient_accumulation_steps(), 99)
            evaluated.append((i, float(engine.eval_batch(data))))
    rank = dist.get_rank()
    (out / run["name"]).mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "rank": rank,
            "worker": engine.worker,
            "losses": losses,
            "params": {k: v.detach().clone() for k, v in engine.module.state_dict().items()},
            "ledger": list(engine.forward_ledger),
            "costs": costs,
            "gives": gives,
            "evaluated": evaluated,
            "profiles": profiles,
            "changes": [dataclasses.asdict(change) for change in engine.cost_changes],
            "events": [tuple(vars(e).values()) for e in engine.instruction_events],
        },
        out / run["name"] / f"rank{rank}.pt",
    )
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pp", type=int, required=True)
    parser.add_argument("--runs", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    for run in json.loads(args.runs.read_text()):
        run_one(run, args.pp, args.out)


if __name__ == "__main__":
    main()
