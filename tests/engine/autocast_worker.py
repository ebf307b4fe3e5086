"""One rank of the bf16-autocast engine tests (tests/engine/test_autocast.py), a
:mod:`ds_recycle.testing.engine_runs` rank script.

For each run in --runs it builds the GPT pipeline from the same seed, trains --steps iterations
under DeepSpeed's ``torch_autocast`` section and writes out/<run>/rank<N>.pt: losses, final
parameters, the dtypes of the activations this rank sent, and how many Linears the W path covers.

A run with ``"cast_stage_outputs": true`` (the stock DeepSpeed baseline) wraps every stage but the
last so that it returns its output in the autocast dtype: what ReCycle sends between stages.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from ds_recycle.data import pipeline_iterator
from ds_recycle.engine.routing import ACTIVATION, GRADIENT
from ds_recycle.testing.engine_runs import initialize, main, make_optimizer
from ds_recycle.testing.tiny import tiny_pipeline


def _cast_outputs(model: torch.nn.Module, dtype: torch.dtype) -> None:
    forward = model.forward

    def cast(*args, **kwargs):
        out = forward(*args, **kwargs)
        return out.to(dtype) if out.dtype == torch.float32 else out

    model.forward = cast


def _record_sends(engine, sent: list[str]) -> None:
    """Record the dtypes of the activations and input gradients this rank sends."""
    channel = engine.channel
    send = channel.send

    def recording(tensors, peer, kind, home, mb):
        if kind in (ACTIVATION, GRADIENT):
            sent.extend(str(t.dtype) for t in tensors)
        return send(tensors, peer, kind, home, mb)

    channel.send = recording


def run_one(run: dict, args: argparse.Namespace) -> dict:
    pp = args.pp
    tiny = tiny_pipeline(pp, checkpoint=run.get("checkpoint", 0))
    model = tiny.model
    dtype = getattr(torch, run["config"]["torch_autocast"]["dtype"])
    if run.get("cast_stage_outputs") and model.stage_id < pp - 1:
        _cast_outputs(model, dtype)
    optimizer = make_optimizer(run["optimizer"], model)
    engine = initialize(run["engine"], model=model, optimizer=optimizer, config=run["config"])
    sent: list[str] = []
    path = getattr(engine, "_weight_path", None)
    if run["engine"] != "stock":
        _record_sends(engine, sent)
    provider = tiny.provider(engine.train_micro_batch_size_per_gpu())
    data = pipeline_iterator(provider, engine.grid.get_data_parallel_id(), engine.gradient_accumulation_steps())
    losses = [float(engine.train_batch(data)) for _ in range(args.steps)]
    home, m = engine.grid.get_data_parallel_id(), engine.gradient_accumulation_steps()
    eval_loss = float(engine.eval_batch(pipeline_iterator(provider, home, m, start_iteration=99)))
    return {
        "rank": dist.get_rank(),
        "stage": engine.stage_id,
        "losses": losses,
        "eval_loss": eval_loss,
        "params": {k: v.detach().clone() for k, v in engine.module.state_dict().items()},
        "param_dtypes": sorted({str(p.dtype) for p in engine.module.parameters()}),
        "sent_dtypes": sorted(set(sent)),
        "deferred_linears": len(path.linears) if path is not None else 0,
    }


if __name__ == "__main__":
    main(run_one, steps=3)
