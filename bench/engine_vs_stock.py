"""ReCycle's engine against stock DeepSpeed, fault-free, under timing emulation.

Both engines train the same tiny GPT with pp=4 x dp=1 and m=8 micro-batches, one after the
other in this run (the stock one is ``recycle.enabled: false``: DeepSpeed's own schedule and
instructions, padded the same way), with every F, B and W padded to the same duration (stock's fused backward to
B + W) so that this host's few cores stand in for four devices. Prints each engine's median
and best iteration time, the ratios ours/stock, and the planner's prediction of that ratio.
Stock DeepSpeed's blocking p2p makes its iteration times vary from run to run on a shared CPU
host, so both the median and the best iteration are shown.

    .venv/bin/python bench/engine_vs_stock.py [--ms 40] [--steps 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from ds_recycle.planner.fault_free import fault_free_plan
from ds_recycle.planner.list_scheduler import ScheduleOptions
from ds_recycle.planner.plan import CostModel
from ds_recycle.runtime.node.launcher import launch
from ds_recycle.runtime.node.preload import PRELOAD_MODULES
from ds_recycle.testing.tiny import TINY_GPT, ds_config

ROOT = Path(__file__).resolve().parents[1]
STAGES, PIPELINES, MICROBATCHES = 4, 1, 8
MODEL = replace(TINY_GPT, n_layers=4)


def run_engine(name: str, stock: bool, ms: float, steps: int, workdir: Path) -> list[float]:
    config = ds_config(MICROBATCHES, 0.0, {"enabled": not stock, "emulate_timing": {"F": ms, "B": ms, "W": ms}})
    config_path = workdir / f"{name}.json"
    config_path.write_text(json.dumps(config))
    argv = [
        str(ROOT / "examples" / "train_gpt.py"),
        "--deepspeed_config", str(config_path),
        "--pipeline-stages", str(STAGES),
        "--steps", str(steps),
        *MODEL.script_args(), "--optimizer", "sgd",
        "--dump", str(workdir / name),
    ]  # fmt: skip
    # The stock run is a plain DeepSpeed job: its ranks do not join a coordinator (ReCycle refuses
    # to run disabled under ds-recycle launch's membership).
    results = launch(
        argv,
        STAGES * PIPELINES,
        timeout=600,
        log_dir=workdir / f"{name}-logs",
        membership=not stock,
        preload=PRELOAD_MODULES,
    )
    for r in results:
        if not r.ok:
            sys.stderr.write(r.log[-4000:])
            raise SystemExit(f"{name}: rank {r.rank} failed ({r.returncode})")
    per_rank = [torch.load(workdir / name / f"rank{r}.pt")["iter_seconds"] for r in range(STAGES * PIPELINES)]
    return [max(times) for times in zip(*per_rank, strict=True)][2:]  # drop warm-up iterations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ms", type=float, default=40.0, help="emulated duration of each F, B and W")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--smoke", action="store_true", help="a few short iterations (for the test suite)")
    args = parser.parse_args()
    if args.smoke:
        args.ms, args.steps = 5.0, 4
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        stock = run_engine("stock", True, args.ms, args.steps, workdir)
        ours = run_engine("recycle", False, args.ms, args.steps, workdir)
    costs = CostModel.uniform(STAGES, F=args.ms, B=args.ms, W=args.ms)
    planned = fault_free_plan(PIPELINES, STAGES, MICROBATCHES, costs).iteration_time
    fused = fault_free_plan(PIPELINES, STAGES, MICROBATCHES, costs, options=ScheduleOptions(decoupled=False))
    one_f_one_b = (MICROBATCHES + STAGES - 1) * 3 * args.ms
    print(f"pp={STAGES} dp={PIPELINES} m={MICROBATCHES} F=B=W={args.ms:g} ms, {len(ours)} iterations after warm-up")
    print(f"{'':18}{'median ms':>10}{'min ms':>10}  model")
    print(
        f"{'stock DeepSpeed':18}{statistics.median(stock) * 1e3:10.1f}{min(stock) * 1e3:10.1f}  1F1B {one_f_one_b:.0f}"
    )
    print(f"{'ReCycle engine':18}{statistics.median(ours) * 1e3:10.1f}{min(ours) * 1e3:10.1f}  plan {planned:.0f}")
    print(
        f"ratio ours/stock: median {statistics.median(ours) / statistics.median(stock):.3f}, "
        f"min {min(ours) / min(stock):.3f}  (plan/1F1B {planned / one_f_one_b:.3f}; "
        f"fused plan/1F1B {fused.iteration_time / one_f_one_b:.3f})"
    )
    print(f"ours/plan: median {statistics.median(ours) * 1e3 / planned:.3f}")


if __name__ == "__main__":
    main()
