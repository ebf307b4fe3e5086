"""The main job: training that survives a GPU failure, on CPU.

    python examples/failure_demo.py [--out demo_out] [--steps 60] [--kill-at 15]

It trains the tiny GPT (2 stages x 3 pipelines, 6 ranks) through ``ds-recycle launch --respawn``,
SIGKILLs worker (pipeline 1, stage 1) in the middle of an iteration, and lets the launcher respawn
it: the survivors roll the interrupted iteration back, re-route its micro-batches to the other
pipelines' stage 1, and the respawned process re-joins from a live replica a few seconds later
(``--preload``: the ranks are forked from a process that imported torch and DeepSpeed once).
Then it runs the same job without a failure and compares: every loss, every parameter, and the
throughput before, during and after the failure. It writes ``OUT/demo.png`` (loss and throughput
over iterations, the failure and the re-join marked) and ``OUT/summary.json``.

Device time is emulated (``recycle.emulate_timing``: every F, B and W of a micro-batch lasts at
least 25 ms), so that 6 ranks on a few CPU cores behave like 6 devices and the throughput shows
the plans, not the host's contention. The exit code is 0 when the job survived and ended with the
fault-free parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from ds_recycle.testing.launch_events import LaunchEvents
from ds_recycle.testing.tiny import ds_config

ROOT = Path(__file__).resolve().parents[1]
PIPELINES, STAGES = 3, 2
VICTIM = (1, 1)
"""(pipeline, stage) of the worker that is killed."""
CONFIG = ds_config(
    4,
    1.0,
    {"enabled": True, "emulate_timing": {"F": 25, "B": 25, "W": 25}},
    micro_batch_size=8,
    optimizer={"type": "Adam", "params": {"lr": 0.003, "torch_adam": True}},
)
MAX_RELATIVE_DIFF = 1e-4
"""Whole-model ||with failure - fault-free|| / ||fault-free||. A failure changes only the order in
which a stage's gradients are summed (fp32 rounding); under Adam a parameter whose exact gradient
is 0 (the attention key bias: softmax ignores a shift) turns that rounding noise into lr-sized
steps, so single elements can differ by ~lr/10 while the model as a whole agrees to ~1e-6."""


class Run:
    """One ``ds-recycle launch`` of the job, watched from outside through its event stream."""

    def __init__(self, name: str, out: Path, steps: int, respawn: bool) -> None:
        self.name, self.dir, self.steps = name, out / name, steps
        self.dir.mkdir(parents=True, exist_ok=True)
        config = self.dir / "ds_config.json"
        config.write_text(json.dumps(CONFIG))
        launcher = [sys.executable, "-m", "ds_recycle.cli", "launch", "--nproc", str(PIPELINES * STAGES)]
        launcher += ["--respawn"] if respawn else []
        launcher += ["--preload"]  # ranks forked from one process that imported torch and DeepSpeed
        self.events = LaunchEvents(self.dir / "events.jsonl")
        launcher += ["--timeout", "600", "--log-dir", str(self.dir / "logs"), "--events", str(self.events.path)]
        script = [str(ROOT / "examples" / "train_gpt.py"), "--deepspeed_config", str(config)]
        script += ["--pipeline-stages", str(STAGES), "--steps", str(steps), "--layers", "4", "--d-model", "64"]
        script += ["--metrics", str(self.dir / "metrics"), "--dump", str(self.dir / "dump")]
        env = {**os.environ, "DS_ACCELERATOR": "cpu"}
        self.proc = subprocess.Popen(
            launcher + script, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.echo = respawn
        threading.Thread(target=self._read, daemon=True).start()

    @property
    def pids(self) -> dict[int, int]:
        """Each rank's current process."""
        return self.events.pids()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if self.echo and "[ds-recycle launch]" in line:
                print("  " + line.rstrip(), flush=True)

    def records(self, kind: str) -> list[dict]:
        """What the lowest live rank reported so far, ``iteration`` or ``change`` records."""
        found = []
        for path in sorted((self.dir / "metrics").glob("metrics.*.jsonl")):
            for line in path.read_text().splitlines():
                if line.endswith("}"):
                    record = json.loads(line)
                    if record["kind"] == kind:
                        found.append(record)
        return sorted(found, key=lambda r: r["time"])

    def done(self) -> int:
        records = self.records("iteration")
        return max((r["iteration"] for r in records), default=0)

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=900)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise SystemExit(f"{self.name}: the launcher did not end") from None

    def final(self) -> dict[int, dict]:
        return {
            int(p.stem[len("rank") :]): torch.load(p, weights_only=False)
            for p in sorted((self.dir / "dump").glob("rank*.pt"))
        }


def per_iteration(run: Run) -> dict[int, dict]:
    """The last report of each iteration (a rolled-back iteration is reported again when re-run)."""
    return {r["iteration"] - 1: r for r in run.records("iteration")}


def describe(change: dict, killed_at: float | None) -> str:
    who = "; ".join(
        f"{kind} {[tuple(w) for w in change[kind]]}" for kind in ("failed", "left", "joined") if change[kind]
    )
    line = f"epoch {change['epoch']} from iteration {change['iteration']}: {who}"
    if change["failed"] and killed_at is not None:
        line += f"; running on the new plan {(change['time'] - killed_at) * 1e3:.0f} ms after the SIGKILL"
        line += f" (detected and decided in {change['detection_seconds'] * 1e3:.0f} ms"
        line += ", interrupted iteration rolled back)" if change["rolled_back"] else ")"
    else:
        line += f"; switched in {change['switch_seconds'] * 1e3:.0f} ms"
    plan = change["plan"]
    return line + (
        f"; plan predicts {plan['predicted_iteration_time']:.0f} ms = {change['ratio_to_fault_free']:.2f}x "
        f"fault-free, {plan['predicted_iteration_time'] / plan['lower_bound']:.2f}x lower bound, "
        f"{plan['rerouted_microbatches']} micro-batch stage-ops re-routed"
    )


def run_with_failure(out: Path, steps: int, kill_at: int) -> tuple[Run, float, dict]:
    print(f"== {PIPELINES} pipelines x {STAGES} stages, {steps} iterations; SIGKILL worker {VICTIM} at ~{kill_at}")
    run = Run("with_failure", out, steps, respawn=True)
    victim = VICTIM[1] * PIPELINES + VICTIM[0]
    printed, killed_at, rejoined = 0, None, None
    while run.proc.poll() is None:
        if killed_at is None and run.done() >= kill_at:
            times = [r["seconds"] for r in run.records("iteration")[-3:]]
            time.sleep(random.Random(0).uniform(0.3, 0.6) * statistics.median(times))  # mid-iteration
            os.kill(run.pids[victim], signal.SIGKILL)
            killed_at = time.time()
            print(f"  SIGKILL -> rank {victim} (worker {VICTIM}) during iteration {run.done()}", flush=True)
        changes = run.records("change")
        for change in changes[printed:]:
            print("  ReCycle " + describe(change, killed_at), flush=True)
            if change["joined"]:
                rejoined = change
        printed = len(changes)
        time.sleep(0.05)
    code = run.wait()
    for change in run.records("change")[printed:]:
        print("  ReCycle " + describe(change, killed_at), flush=True)
        rejoined = change if change["joined"] else rejoined
    if code != 0 or killed_at is None:
        raise SystemExit(f"the job with a failure ended with exit code {code}; logs in {run.dir / 'logs'}")
    return run, killed_at, rejoined or {}


def compare(failed: Run, fault_free: Run, killed_at: float, rejoined: dict) -> dict:
    a, b = per_iteration(failed), per_iteration(fault_free)
    loss_diff = max(abs(a[i]["loss"] - b[i]["loss"]) for i in b)
    ours, reference = failed.final(), fault_free.final()
    squared_diff = squared_norm = 0.0
    worst = (0.0, "")
    for slot, want in reference.items():
        for name, value in want["params"].items():
            diff = ours[slot]["params"][name].double() - value.double()
            squared_diff += diff.square().sum().item()
            squared_norm += value.double().square().sum().item()
            worst = max(worst, (diff.abs().max().item(), f"{name} of rank {slot}"))
    relative = (squared_diff / squared_norm) ** 0.5
    failure = min(i for i, r in a.items() if r["time"] >= killed_at)
    back = rejoined.get("iteration", len(a))

    def median_rate(records: dict[int, dict], lo: int, hi: int) -> float:
        rates = [r["samples_per_s"] for i, r in records.items() if lo <= i < hi]
        return statistics.median(rates) if rates else float("nan")

    reference_rate = median_rate(b, 2, len(b))
    phases = {
        "before the failure": median_rate(a, 2, failure),
        "degraded (one worker gone)": median_rate(a, failure + 1, back),
        "after the re-join": median_rate(a, back + 1, len(a)),
    }
    print("== compared with the same job without a failure")
    print(f"  every loss:        max |difference| {loss_diff:.2e} over {len(b)} iterations")
    print(f"  every parameter:   ||difference|| / ||parameters|| = {relative:.2e} (at most {MAX_RELATIVE_DIFF:g})")
    print(f"                     largest element difference {worst[0]:.2e}, in {worst[1]}")
    print(f"  throughput, fault-free run: {reference_rate:.0f} samples/s")
    for phase, rate in phases.items():
        print(f"  throughput, {phase:27} {rate:.0f} samples/s = {rate / reference_rate:.2f}x fault-free")
    return {
        "loss_max_abs_diff": loss_diff,
        "param_relative_diff": relative,
        "param_max_abs_diff": worst[0],
        "params_equal": relative <= MAX_RELATIVE_DIFF and loss_diff <= MAX_RELATIVE_DIFF,
        "failure_iteration": failure,
        "rejoin_iteration": back,
        "fault_free_samples_per_s": reference_rate,
        "samples_per_s": phases,
        "series": {"with_failure": a, "fault_free": b},
    }


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, rate_ax) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for name, style in (("fault_free", "--"), ("with_failure", "-")):
        series = summary["series"][name]
        iterations = sorted(series)
        label = name.replace("_", " ")
        loss_ax.plot(iterations, [series[i]["loss"] for i in iterations], style, label=label)
        rate_ax.plot(iterations, [series[i]["samples_per_s"] for i in iterations], style, label=label)
    for ax in (loss_ax, rate_ax):
        ax.axvline(summary["failure_iteration"], color="red", linestyle=":", label="SIGKILL worker (1, 1)")
        ax.axvline(summary["rejoin_iteration"], color="green", linestyle=":", label="re-joined")
    loss_ax.set_ylabel("loss")
    rate_ax.set_ylabel("samples/s")
    rate_ax.set_xlabel("iteration")
    loss_ax.legend()
    loss_ax.set_title("ReCycle: 3 pipelines x 2 stages, a worker killed and re-joined")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("demo_out"))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kill-at", type=int, default=15, help="iteration at which the worker is killed")
    args = parser.parse_args()
    if not 3 <= args.kill_at <= args.steps - 20:
        parser.error(f"--kill-at must be in 3..{args.steps - 20} (steps - 20) so that the re-join fits in the job")
    failed, killed_at, rejoined = run_with_failure(args.out, args.steps, args.kill_at)
    print("== the same job without a failure")
    fault_free = Run("fault_free", args.out, args.steps, respawn=False)
    if fault_free.wait() != 0:
        raise SystemExit(f"the fault-free job failed; logs in {fault_free.dir / 'logs'}")
    summary = compare(failed, fault_free, killed_at, rejoined)
    plot(summary, args.out / "demo.png")
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"== wrote {args.out / 'demo.png'} and {args.out / 'summary.json'}")
    if not summary["params_equal"]:
        raise SystemExit("the job with a failure differs from the fault-free run beyond fp32 reordering")


if __name__ == "__main__":
    main()
