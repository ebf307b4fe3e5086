"""Train a tiny GPT with DeepSpeed pipeline + data parallelism and ReCycle, on CPU.

    deepspeed --num_gpus 4 examples/train_gpt.py --deepspeed_config ds_configs/gpt_recycle.json

The corpus ships with the package (ds_recycle/corpus.txt); nothing is downloaded. ``--stock``
runs DeepSpeed's own PipelineEngine instead, for comparison. ``--dump DIR`` writes each rank's
losses, parameters and instruction events (used by the tests and benchmarks).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ds_recycle  # noqa: E402
from ds_recycle.data import TokenWindowProvider, pipeline_iterator, shipped_corpus_tokens  # noqa: E402
from ds_recycle.models import GPTConfig, build_gpt_pipeline  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pipeline-stages", type=int, default=2, help="pipeline depth P (world = P x D)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--optimizer", choices=["config", "adam", "sgd"], default="config")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--stock", action="store_true", help="use deepspeed.initialize (stock PipelineEngine)")
    parser.add_argument("--dump", type=Path, help="write rank<N>.pt with losses, parameters and events here")
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    if args.deepspeed_config is None:
        parser.error("--deepspeed_config is required (e.g. ds_configs/gpt_recycle.json)")
    return args


def make_optimizer(args, model):
    params = [p for p in model.parameters() if p.requires_grad]
    if args.optimizer == "adam":
        return torch.optim.Adam(params, lr=args.lr)
    if args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=args.lr, momentum=0.9)
    return None


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # several CPU ranks share this host's cores; more threads only contend
    deepspeed.init_distributed(dist_backend="gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % args.pipeline_stages:
        raise SystemExit(f"world size {world} is not a multiple of --pipeline-stages {args.pipeline_stages}")

    tokenizer, tokens = shipped_corpus_tokens()
    cfg = GPTConfig(tokenizer.vocab_size, args.seq_len, args.d_model, args.heads, args.layers)
    torch.manual_seed(args.seed)
    model = build_gpt_pipeline(cfg, num_stages=args.pipeline_stages, seed=args.seed)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    initialize = deepspeed.initialize if args.stock else ds_recycle.initialize
    engine, _, _, _ = initialize(
        model=model,
        optimizer=make_optimizer(args, model),
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=args.deepspeed_config,
    )

    provider = TokenWindowProvider(tokens, cfg.seq_len, engine.train_micro_batch_size_per_gpu(), args.seed)
    data = pipeline_iterator(provider, engine.grid.get_data_parallel_id(), engine.gradient_accumulation_steps())
    losses, times = [], []
    for step in range(args.steps):
        started = time.perf_counter()
        loss = engine.train_batch(data)
        times.append(time.perf_counter() - started)
        losses.append(float(loss))
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            samples_per_s = engine.train_batch_size() / times[-1]
            print(f"step {step:4d} loss {losses[-1]:.4f} iter {times[-1] * 1e3:.1f} ms {samples_per_s:.1f} samples/s")

    if rank == 0:
        summary = {
            "engine": type(engine).__name__,
            "first_loss": losses[0],
            "last_loss": losses[-1],
            "median_iter_ms": sorted(times)[len(times) // 2] * 1e3,
            "samples_per_s": engine.train_batch_size() / sorted(times)[len(times) // 2],
        }
        print("summary " + json.dumps(summary))
    if args.dump is not None:
        args.dump.mkdir(parents=True, exist_ok=True)
        events = [tuple(vars(e).values()) for e in getattr(engine, "instruction_events", [])]
        torch.save(
            {
                "rank": rank,
                "stage": engine.stage_id,
                "pipeline": engine.grid.get_data_parallel_id(),
                "losses": losses,
                "iter_seconds": times,
                "params": {k: v.detach().clone() for k, v in engine.module.state_dict().items()},
                "initial": initial,
                "events": events,
            },
            args.dump / f"rank{rank}.pt",
        )
    dist.barrier()


if __name__ == "__main__":
    main()
