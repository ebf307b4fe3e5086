"""One rank of a static job (``launch(membership=False)``) that trains several engines one after
the other, each from the same seed: the rank script of bench/measured_costs.py's straggler runs.

``--runs`` is a JSON list of ``{"name", "config", "steps"}``; a config whose ``recycle.enabled`` is
false runs DeepSpeed's own schedule (``ds_recycle.initialize`` with ReCycle off: DeepSpeed's engine,
padded as ``recycle.emulate_timing`` says, stragglers included). Each rank writes
``out/<name>/rank<N>.pt``: every iteration's ``train_batch`` seconds and, for ReCycle, the cost model's
changes, the micro-batches each straggler handed over per iteration and the plan's summary.

    python -m ds_recycle.testing.engine_runs --pp P --runs runs.json --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ds_recycle  # noqa: E402
from ds_recycle.data import TokenWindowProvider, pipeline_iterator, shipped_corpus_tokens  # noqa: E402
from ds_recycle.models import build_gpt_pipeline  # noqa: E402
from ds_recycle.testing.tiny import TINY_GPT  # noqa: E402


def run_one(run: dict, pp: int, out: Path) -> None:
    tokenizer, tokens = shipped_corpus_tokens()
    cfg = TINY_GPT.config(tokenizer.vocab_size)
    model = build_gpt_pipeline(cfg, num_stages=pp, seed=0)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=5e-2, momentum=0.9)
    recycle = run["config"].get("recycle", {}).get("enabled", False)
    provider = TokenWindowProvider(tokens, cfg.seq_len, run["config"]["train_micro_batch_size_per_gpu"], seed=0)
    kwargs = {"training_data": provider} if recycle else {}
    engine, _, _, _ = ds_recycle.initialize(model=model, optimizer=optimizer, config=run["config"], **kwargs)
    data = None
    if not recycle:
        data = pipeline_iterator(provider, engine.grid.get_data_parallel_id(), engine.gradient_accumulation_steps())
    seconds, gives = [], []
    for _ in range(run["steps"]):
        began = time.perf_counter()
        engine.train_batch(data)
        seconds.append(time.perf_counter() - began)
        plan = getattr(engine, "plan", None)
        gives.append(dict(plan.extra.get("give", {})) if plan is not None else {})
    record = {"rank": dist.get_rank(), "seconds": seconds, "gives": gives}
    if recycle:
        record["cost_changes"] = [dataclasses.asdict(c) for c in engine.cost_changes]
        record["plan"] = vars(engine.plan_summary())
    (out / run["name"]).mkdir(parents=True, exist_ok=True)
    torch.save(record, out / run["name"] / f"rank{dist.get_rank()}.pt")
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pp", type=int, required=True)
    parser.add_argument("--runs", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)  # several CPU ranks share this host's cores
    ds_recycle.init_distributed()
    for run in json.loads(args.runs.read_text()):
        run_one(run, args.pp, args.out)


if __name__ == "__main__":
    main()
