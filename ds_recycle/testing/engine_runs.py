"""The rank script of a static job (``launch(membership=False)``) that trains several engines one
after the other, each from the same seed, and the harness such scripts share.

A rank script hands :func:`main` its ``run_one(run, args) -> record``: ``--runs`` is a JSON list of
runs (dicts with at least a ``name``), and what ``run_one`` returns for a run is saved as
``out/<name>/rank<N>.pt``. tests/engine/worker.py, autocast_worker.py and profile_worker.py are
such scripts, built from :func:`tiny_pipeline`, :func:`make_optimizer` and :func:`initialize`.

Run as a module, it is the rank script of bench/measured_costs.py's straggler runs: each run is
``{"name", "config", "steps"}``; a config whose ``recycle.enabled`` is false runs DeepSpeed's own
schedule (``ds_recycle.initialize`` with ReCycle off: DeepSpeed's engine, padded as
``recycle.emulate_timing`` says, stragglers included). Its record: every iteration's ``train_batch``
seconds and, for ReCycle, the cost model's changes, the micro-batches each straggler handed over per
iteration and the plan's summary.

    python -m ds_recycle.testing.engine_runs --pp P --runs runs.json --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ds_recycle.data import pipeline_iterator  # noqa: E402
from ds_recycle.testing.rank import start_rank  # noqa: E402
from ds_recycle.testing.tiny import tiny_pipeline  # noqa: E402

RunOne = Callable[[dict, argparse.Namespace], dict]
"""``run_one(run, args) -> record``: train one run on this rank; ``args`` holds ``pp``, ``steps``,
``runs`` and ``out``."""


def main(run_one: RunOne, steps: int | None = None) -> None:
    """Parse ``--pp P --runs FILE --out DIR [--steps N]`` (``steps``: its default), start this rank
    (:func:`~ds_recycle.testing.rank.start_rank`), and for each run save ``run_one``'s record as
    ``out/<name>/rank<N>.pt``, every rank past it before the next run starts."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--pp", type=int, required=True)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--runs", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    start_rank()
    for run in json.loads(args.runs.read_text()):
        record = run_one(run, args)
        folder = args.out / run["name"]
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(record, folder / f"rank{dist.get_rank()}.pt")
        dist.barrier()


def make_optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    """``adam`` (lr 1e-2) or, for any other name, SGD with momentum (lr 5e-2)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-2)
    return torch.optim.SGD(params, lr=5e-2, momentum=0.9)


def initialize(engine: str, **kwargs: Any) -> Any:
    """The engine of a run: DeepSpeed's own for ``engine == "stock"``, else ReCycle's
    (``ds_recycle.initialize``); ``kwargs`` go to either."""
    if engine == "stock":
        import deepspeed

        if torch.cuda.is_available() and "args" not in kwargs:  # ranks beyond the GPUs share them, as ReCycle's do
            kwargs["args"] = argparse.Namespace(device_rank=int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        return deepspeed.initialize(**kwargs)[0]
    import ds_recycle

    return ds_recycle.initialize(**kwargs)[0]


class TokenWindows(torch.utils.data.Dataset):
    """A map-style dataset: sample i is (tokens[i*seq : (i+1)*seq], the same shifted by one)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.seq_len
        return self.tokens[start : start + self.seq_len], self.tokens[start + 1 : start + self.seq_len + 1]


def straggler_run(run: dict, args: argparse.Namespace) -> dict:
    """One run of bench/measured_costs.py's straggler runs (see the module doc)."""
    tiny = tiny_pipeline(args.pp)
    optimizer = make_optimizer("sgd", tiny.model)
    recycle = run["config"].get("recycle", {}).get("enabled", False)
    provider = tiny.provider(run["config"]["train_micro_batch_size_per_gpu"])
    kwargs = {"training_data": provider} if recycle else {}
    engine = initialize("recycle", model=tiny.model, optimizer=optimizer, config=run["config"], **kwargs)
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
        record["cost_changes"] = [dataclasses.asdict(c) for c in engine.costs.changes]
        record["plan"] = vars(engine.plan_summary())
    return record


if __name__ == "__main__":
    main(straggler_run)
