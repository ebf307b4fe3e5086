"""Train a tiny GPT with DeepSpeed pipeline + data parallelism and ReCycle, on CPU.

    ds-recycle launch --nproc 6 --respawn examples/train_gpt.py --deepspeed_config ds_configs/gpt_recycle.json
    deepspeed --num_gpus 4 examples/train_gpt.py --deepspeed_config ds_configs/gpt_recycle.json

Under ``ds-recycle launch`` the job survives ranks that die, hang or get a SIGTERM (they leave),
and a respawned rank re-joins: the same script, unchanged, runs in first-start and re-joining
processes, because ``engine.global_steps`` says where the job is. The data comes from
``training_data``, so any pipeline can load any pipeline's micro-batches.

The corpus ships with the package (ds_recycle/corpus.txt); nothing is downloaded. ``--stock``
runs DeepSpeed's own PipelineEngine instead, for comparison. ``--dump DIR`` writes each finishing
rank's losses, parameters and instruction events; ``--metrics DIR`` writes the iterations and
membership changes the engine reports (from the lowest live rank) as JSON lines.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ds_recycle  # noqa: E402
from ds_recycle.data import TokenWindowProvider, pipeline_iterator, shipped_corpus_tokens  # noqa: E402
from ds_recycle.models import GPTConfig, build_gpt_pipeline  # noqa: E402
from ds_recycle.runtime.shared.placement import pipeline_major_topology  # noqa: E402


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
    parser.add_argument(
        "--pipeline-major",
        action="store_true",
        help="number ranks pipeline by pipeline (a node holds whole pipelines: what several nodes want)",
    )
    parser.add_argument("--dump", type=Path, help="write rank<N>.pt with losses, parameters and events here")
    parser.add_argument("--metrics", type=Path, help="write metrics.<rank>.jsonl (iterations, membership changes) here")
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


class JsonLinesMonitor:
    """An engine monitor (ds_recycle.runtime.shared.events.Monitor) that appends JSON lines to a file."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a")

    def _write(self, kind: str, record: dict) -> None:
        self.file.write(json.dumps({"kind": kind, "time": time.time(), **record}) + "\n")
        self.file.flush()

    def on_iteration(self, stats) -> None:
        self._write("iteration", {**asdict(stats), "samples_per_s": stats.samples_per_s})

    def on_membership_change(self, change) -> None:
        plan = change.plan
        ratios = {} if plan is None else {"ratio_to_fault_free": plan.ratio_to_fault_free}
        self._write("change", {**asdict(change), **ratios})

    def close(self) -> None:
        self.file.close()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # several CPU ranks share this host's cores; more threads only contend
    ds_recycle.init_distributed()  # deepspeed.init_distributed, or the ds-recycle launch world
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % args.pipeline_stages:
        raise SystemExit(f"world size {world} is not a multiple of --pipeline-stages {args.pipeline_stages}")

    tokenizer, tokens = shipped_corpus_tokens()
    cfg = GPTConfig(tokenizer.vocab_size, args.seq_len, args.d_model, args.heads, args.layers)
    torch.manual_seed(args.seed)
    topology = None
    if args.pipeline_major:
        topology = pipeline_major_topology(args.pipeline_stages, world // args.pipeline_stages)
    model = build_gpt_pipeline(cfg, num_stages=args.pipeline_stages, seed=args.seed, topology=topology)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with open(args.deepspeed_config) as f:
        ds_config = json.load(f)
    micro_batch_size = ds_config["train_micro_batch_size_per_gpu"]
    recycle = not args.stock and ds_config.get("recycle", {}).get("enabled", False)
    provider = TokenWindowProvider(tokens, cfg.seq_len, micro_batch_size, args.seed)
    kwargs = {"training_data": provider} if recycle else {}
    initialize = deepspeed.initialize if args.stock else ds_recycle.initialize
    engine, _, _, _ = initialize(
        model=model,
        optimizer=make_optimizer(args, model),
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=args.deepspeed_config,
        **kwargs,
    )
    if args.metrics is not None and hasattr(engine, "monitors"):
        engine.monitors.append(JsonLinesMonitor(args.metrics / f"metrics.{rank}.jsonl"))
    data = None  # ReCycle loads micro-batch (h, k) of iteration i from training_data
    if not recycle:  # DeepSpeed's schedule reads its own pipeline's micro-batches from an iterator
        data = pipeline_iterator(provider, engine.grid.get_data_parallel_id(), engine.gradient_accumulation_steps())
    leader = getattr(engine, "is_lowest_live_rank", lambda: rank == 0)
    losses, times = {}, []
    while engine.global_steps < args.steps:  # a re-joined process starts where the job is
        started = time.perf_counter()
        loss = engine.train_batch(data)
        times.append(time.perf_counter() - started)
        step = engine.global_steps - 1  # after a recovery, the iteration it finished last
        losses[step] = float(loss)
        if leader() and (step % 10 == 0 or step == args.steps - 1):
            samples_per_s = engine.train_batch_size() / times[-1]
            print(f"step {step:4d} loss {losses[step]:.4f} iter {times[-1] * 1e3:.1f} ms {samples_per_s:.1f} samples/s")

    if leader():
        summary = {
            "engine": type(engine).__name__,
            "first_loss": losses[min(losses)],
            "last_loss": losses[max(losses)],
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
                "losses": [losses[i] for i in sorted(losses)],
                "loss_by_iteration": losses,
                "iter_seconds": times,
                "params": {k: v.detach().clone() for k, v in engine.module.state_dict().items()},
                "initial": initial,
                "events": events,
                "cost_changes": [dataclasses.asdict(c) for c in getattr(getattr(engine, "costs", None), "changes", [])],
            },
            args.dump / f"rank{rank}.pt",
        )
    for monitor in getattr(engine, "monitors", []):
        monitor.close()
    if args.stock or getattr(engine, "runtime", None) is None:
        dist.barrier()


if __name__ == "__main__":
    main()
