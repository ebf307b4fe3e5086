"""One rank of the bf16-autocast engine tests (tests/engine/test_autocast.py).

For each run in --runs it builds the GPT pipeline from the same seed, trains --steps iterations
under DeepSpeed's ``torch_autocast`` section and writes out/<run>/rank<N>.pt: losses, final
parameters, the dtypes of the activations this rank sent, and how many Linears the W path covers.

A run with ``"cast_stage_outputs": true`` (the stock DeepSpeed baseline) wraps every stage but the
last so that it returns its output in the autocast dtype: what ReCycle sends between stages.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ds_recycle  # noqa: E402
from ds_recycle.data import TokenWindowProvider, pipeline_iterator, shipped_corpus_tokens  # noqa: E402
from ds_recycle.engine.routing import ACTIVATION, GRADIENT  # noqa: E402
from ds_recycle.models import build_gpt_pipeline  # noqa: E402
from ds_recycle.testing.tiny import TINY_GPT  # noqa: E402


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


def run_one(run: dict, pp: int, steps: int, out: Path) -> None:
    tokenizer, tokens = shipped_corpus_tokens()
    cfg = TINY_GPT.config(tokenizer.vocab_size)
    model = build_gpt_pipeline(cfg, num_stages=pp, seed=0, activation_checkpoint_interval=run.get("checkpoint", 0))
    dtype = getattr(torch, run["config"]["torch_autocast"]["dtype"])
    if run.get("cast_stage_outputs") and model.stage_id < pp - 1:
        _cast_outputs(model, dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    if run["optimizer"] == "adam":
        optimizer = torch.optim.Adam(params, lr=1e-2)
    else:
        optimizer = torch.optim.SGD(params, lr=5e-2, momentum=0.9)
    init = deepspeed.initialize if run["engine"] == "stock" else ds_recycle.initialize
    engine, _, _, _ = init(model=model, optimizer=optimizer, config=run["config"])
    sent: list[str] = []
    path = getattr(engine, "_weight_path", None)
    if run["engine"] != "stock":
        _record_sends(engine, sent)
    provider = TokenWindowProvider(tokens, cfg.seq_len, engine.train_micro_batch_size_per_gpu(), seed=0)
    data = pipeline_iterator(provider, engine.grid.get_data_parallel_id(), engine.gradient_accumulation_steps())
    losses = [float(engine.train_batch(data)) for _ in range(steps)]
    home, m = engine.grid.get_data_parallel_id(), engine.gradient_accumulation_steps()
    eval_loss = float(engine.eval_batch(pipeline_iterator(provider, home, m, start_iteration=99)))
    rank = dist.get_rank()
    (out / run["name"]).mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "rank": rank,
            "stage": engine.stage_id,
            "losses": losses,
            "eval_loss": eval_loss,
            "params": {k: v.detach().clone() for k, v in engine.module.state_dict().items()},
            "param_dtypes": sorted({str(p.dtype) for p in engine.module.parameters()}),
            "sent_dtypes": sorted(set(sent)),
            "deferred_linears": len(path.linears) if path is not None else 0,
        },
        out / run["name"] / f"rank{rank}.pt",
    )
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pp", type=int, required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--runs", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    for run in json.loads(args.runs.read_text()):
        run_one(run, args.pp, args.steps, args.out)


if __name__ == "__main__":
    main()
