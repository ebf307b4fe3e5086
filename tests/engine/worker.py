"""One rank of a multi-process engine test. Started by ds_recycle.runtime.launcher.

For each run in --runs (a JSON list), it builds the GPT pipeline afresh from the same seed,
initializes the requested engine, trains --steps iterations on the deterministic provider, evaluates one
batch, and writes out/<run>/rank<N>.pt with the losses, the eval loss, initial and final parameters, instruction events
and, for ReCycle, the global gradient norms it computed and the cost model it planned with.
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
from ds_recycle.models import build_gpt_pipeline  # noqa: E402
from ds_recycle.testing.tiny import TINY_GPT  # noqa: E402


class TokenWindows(torch.utils.data.Dataset):
    """A map-style dataset: sample i is (tokens[i*seq : (i+1)*seq], the same shifted by one)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.seq_len
        return self.tokens[start : start + self.seq_len], self.tokens[start + 1 : start + self.seq_len + 1]


def run_one(run: dict, pp: int, steps: int, out: Path) -> None:
    tokenizer, tokens = shipped_corpus_tokens()
    cfg = TINY_GPT.config(tokenizer.vocab_size)
    model = build_gpt_pipeline(
        cfg, num_stages=pp, seed=run.get("seed", 0), activation_checkpoint_interval=run.get("checkpoint", 0)
    )
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    params = [p for p in model.parameters() if p.requires_grad]
    if run["optimizer"] == "adam":
        optimizer = torch.optim.Adam(params, lr=1e-2)
    else:
        optimizer = torch.optim.SGD(params, lr=5e-2, momentum=0.9)
    init = deepspeed.initialize if run["engine"] == "stock" else ds_recycle.initialize
    dataset = TokenWindows(tokens, cfg.seq_len) if run.get("data") == "dataset" else None
    engine, _, _, _ = init(model=model, optimizer=optimizer, config=run["config"], training_data=dataset)
    provider = TokenWindowProvider(tokens, cfg.seq_len, engine.train_micro_batch_size_per_gpu(), seed=0)
    data = pipeline_iterator(provider, engine.grid.get_data_parallel_id(), engine.gradient_accumulation_steps())
    if dataset is not None:
        data = None  # the engine loads from training_data itself
    losses, norms, events, costs = [], [], [], []
    for _ in range(steps):
        losses.append(float(engine.train_batch(data)))
        stepper = getattr(engine, "stepper", None)
        norms.append(getattr(stepper, "last_grad_norm", None))
        events.append([tuple(vars(e).values()) for e in getattr(engine, "instruction_events", [])])
        tracker = getattr(engine, "cost_tracker", None)
        costs.append(None if tracker is None else tracker.in_use.to_dict())
    eval_data = pipeline_iterator(
        provider, engine.grid.get_data_parallel_id(), engine.gradient_accumulation_steps(), 99
    )
    eval_loss = float(engine.eval_batch(eval_data))
    rank = dist.get_rank()
    (out / run["name"]).mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "rank": rank,
            "stage": engine.stage_id,
            "pipeline": engine.grid.get_data_parallel_id(),
            "engine": type(engine).__name__,
            "losses": losses,
            "eval_loss": eval_loss,
            "grad_norms": norms,
            "initial": initial,
            "params": {k: v.detach().clone() for k, v in engine.module.state_dict().items()},
            "events": events,
            "costs": costs,
        },
        out / run["name"] / f"rank{rank}.pt",
    )
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pp", type=int, required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--runs", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    for run in json.loads(args.runs.read_text()):
        run_one(run, args.pp, args.steps, args.out)


if __name__ == "__main__":
    main()
