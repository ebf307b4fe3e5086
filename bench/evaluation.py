"""Evaluation on a degraded job against a fault-free one: ``engine.eval_batch`` wall time.

Under timing emulation (every F padded to --ms milliseconds), one ``ds-recycle launch`` job of
pp=4 x dp=2, m=8 per failure set: every rank trains one iteration, evaluates --evals batches
fault-free, then the failure set's workers SIGKILL themselves while the others are inside their
next evaluation (which is recovered and run again), and the survivors evaluate --evals batches on
the forward-only plan without them. Each row: the median wall time of a fault-free and of a
degraded evaluation (the slowest rank's ``engine.evaluator.current.seconds``), their ratio, the ratio the
forward-only streams predict (each F takes one unit once its input has arrived), and the largest
relative difference of a degraded eval loss from the fault-free one.

    .venv/bin/python bench/evaluation.py [--ms 20] [--evals 5] [--smoke]

The same file is the rank script (``--rank``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

PP, DP, M = 4, 2, 8
FAILURE_SETS = [[(0, 1)], [(1, 3)], [(0, 0), (1, 2)]]
"""Workers (pipeline, stage) lost: a middle stage, a last stage, and a first and a middle stage."""


def rank_main(args: argparse.Namespace) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch

    from ds_recycle.data import TokenWindowProvider, shipped_corpus_tokens
    from ds_recycle.testing.rank import build_engine, start_rank
    from ds_recycle.testing.tiny import TINY_GPT

    start_rank()
    config = json.loads(args.config)
    engine = build_engine(args.pp, "sgd", config)
    engine.train_batch()
    _, tokens = shipped_corpus_tokens()
    provider = TokenWindowProvider(tokens, TINY_GPT.seq_len, config["train_micro_batch_size_per_gpu"], seed=1)

    def evaluate() -> dict:
        loss = float(engine.eval_batch(lambda home, mb: provider.get(0, home, mb)))
        evaluation = engine.evaluator.current
        return {"loss": loss, "seconds": evaluation.seconds, "attempts": evaluation.attempts}

    slot, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    record = {"fault_free": [evaluate() for _ in range(args.evals)]}
    (args.out / f"ready{slot}").write_text("")
    if slot in args.victims:
        while not all((args.out / f"ready{s}").exists() for s in range(world)):
            time.sleep(0.01)
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    record["interrupted"] = evaluate()
    record["degraded"] = [evaluate() for _ in range(args.evals)]
    record["failed"] = [list(w) for w in engine.grid.failed]
    torch.save(record, args.out / f"{slot}.pt")


def predicted_ratio(pp: int, dp: int, m: int, failed: list[tuple[int, int]]) -> float:
    """Makespan of the forward-only streams (unit F, sends free) against fault-free."""
    from ds_recycle.planner.cache import PlanCache
    from ds_recycle.planner.fault_free import fault_free_plan
    from ds_recycle.planner.request import PlanRequest

    return _makespan(PlanCache().get_or_plan(PlanRequest(dp, pp, m, failed))) / _makespan(fault_free_plan(dp, pp, m))


def _makespan(plan) -> float:
    from ds_recycle.planner.actions import ForwardPass
    from ds_recycle.planner.evaluation import lower_forward_only

    streams = {w: [a for a in s.actions if isinstance(a, ForwardPass)] for w, s in lower_forward_only(plan).items()}
    done: dict[tuple[int, int, int], float] = {}
    free = {w: 0.0 for w in streams}
    position = {w: 0 for w in streams}
    while any(position[w] < len(ops) for w, ops in streams.items()):
        for worker, ops in streams.items():
            while position[worker] < len(ops):
                op = ops[position[worker]]
                ready = 0.0 if worker[1] == 0 else done.get((op.home, op.mb, worker[1] - 1))
                if ready is None:
                    break
                free[worker] = max(free[worker], ready) + 1.0
                done[(op.home, op.mb, worker[1])] = free[worker]
                position[worker] += 1
    return max(free.values())


def run_job(tmp: Path, pp: int, dp: int, m: int, ms: float, evals: int, failed: list[tuple[int, int]]) -> dict:
    import torch

    from ds_recycle.runtime.node.launcher import LaunchConfig, Launcher
    from ds_recycle.runtime.node.preload import PRELOAD_MODULES
    from ds_recycle.testing.jobs import slot
    from ds_recycle.testing.tiny import ds_config

    config = ds_config(m, 0.0, {"enabled": True, "emulate_timing": {"F": ms, "B": ms, "W": ms}})
    victims = [slot(dp, p, s) for p, s in failed]
    argv = [__file__, "--rank", "--pp", str(pp), "--config", json.dumps(config), "--out", str(tmp)]
    argv += ["--evals", str(evals), "--victims", *map(str, victims)]
    (tmp / "logs").mkdir(parents=True)
    lines: list[str] = []
    config = LaunchConfig(argv=argv, nproc=pp * dp, timeout=600, log_dir=tmp / "logs", preload=PRELOAD_MODULES)
    launcher = Launcher(config, echo=lines.append)
    if launcher.run() != 0:
        failed_logs = [f"rank {r.slot} ({r.returncode}):\n{r.log[-4000:]}" for r in launcher.results() if not r.ok]
        raise SystemExit("the job failed:\n" + "\n".join(lines[-30:] + failed_logs))
    records = [torch.load(path, weights_only=False) for path in sorted(tmp.glob("[0-9]*.pt"))]

    def median(key: str) -> float:
        return statistics.median(max(r[key][i]["seconds"] for r in records) for i in range(evals))

    reference = records[0]["fault_free"][0]["loss"]
    losses = [e["loss"] for r in records for e in r["degraded"] + [r["interrupted"]]]
    assert all(r["interrupted"]["attempts"] == 2 for r in records), "the failure did not interrupt the evaluation"
    return {
        "failed": failed,
        "fault_free_s": median("fault_free"),
        "degraded_s": median("degraded"),
        "predicted": predicted_ratio(pp, dp, m, failed),
        "loss_rel_diff": max(abs(x - reference) / abs(reference) for x in losses),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--pp", type=int, default=PP)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--victims", type=int, nargs="*", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--ms", type=float, default=20.0, help="emulated F, B and W (milliseconds)")
    parser.add_argument("--evals", type=int, default=5, help="evaluations per phase")
    parser.add_argument("--smoke", action="store_true", help="pp=2 x dp=2, m=4, one failure set, 1 evaluation")
    args = parser.parse_args()
    if args.rank:
        rank_main(args)
        return
    pp, dp, m, sets, evals = PP, DP, M, FAILURE_SETS, args.evals
    if args.smoke:
        pp, dp, m, sets, evals = 2, 2, 4, [[(1, 1)]], 1
    print(f"eval_batch wall time, pp={pp} x dp={dp}, m={m}, F padded to {args.ms:g} ms, median of {evals}")
    print(f"{'lost':<18} {'fault-free s':>12} {'degraded s':>10} {'ratio':>6} {'predicted':>9} {'loss rel diff':>13}")
    for failed in sets:
        with tempfile.TemporaryDirectory(prefix="eval_bench_") as tmp:
            row = run_job(Path(tmp), pp, dp, m, args.ms, evals, failed)
        ratio = row["degraded_s"] / row["fault_free_s"]
        print(
            f"{str(failed):<18} {row['fault_free_s']:>12.3f} {row['degraded_s']:>10.3f} {ratio:>6.2f} "
            f"{row['predicted']:>9.2f} {row['loss_rel_diff']:>13.1e}",
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
