"""Several nodes on one machine: 4 agents x 2 ranks, P = 2, D = 4, pipeline-major (node k holds
pipeline k), timing emulation, examples/train_gpt.py under ``ds-recycle launch --nnodes 4``.

One fault-free run, then one run with: node 3 SIGKILLed (its agent's process group; its ranks die
with it), node 3 re-admitted (its agent started again), node 2 frozen (agent and ranks SIGSTOPped:
only its lease can tell), thawed (it fences itself), and re-admitted. Rows per phase: detection
(signal to the failure published), signal to the survivors on the new plan, measured/predicted
iteration time, throughput against fault-free; and the final parameters against the fault-free run.

    python bench/multinode.py [--steps 90] [--node-lease 2] [--optimizer adam|sgd] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ds_recycle.testing.launch_events import LaunchEvents
from ds_recycle.testing.tiny import TINY_GPT, ds_config

ROOT = Path(__file__).resolve().parents[1]
NODES, PER_NODE = 4, 2
CONFIG = ds_config(
    4,
    1.0,
    {"enabled": True, "emulate_timing": {"F": 25, "B": 25, "W": 25}},
    optimizer={"type": "Adam", "params": {"lr": 0.003, "torch_adam": True}},
)
TOKEN = "bench-multinode-token-0123456789"


class Node:
    """One node's agent process (its own process group), its output read in a thread, its events watched."""

    def __init__(
        self, run: Path, node: int, port: int, steps: int, lease: float, options: list[str], incarnation: int = 0
    ) -> None:
        command = [sys.executable, "-m", "ds_recycle.cli", "launch", "--nnodes", str(NODES), "--node-rank", str(node)]
        command += ["--nproc-per-node", str(PER_NODE), "--rdzv-endpoint", f"127.0.0.1:{port}", "--respawn"]
        command += ["--node-lease", str(lease), "--timeout", "900", "--log-dir", str(run / f"logs{node}.{incarnation}")]
        self.events = LaunchEvents(run / f"events{node}.{incarnation}.jsonl")
        command += ["--events", str(self.events.path)]
        command += [str(ROOT / "examples" / "train_gpt.py"), "--deepspeed_config", str(run / "ds_config.json")]
        command += ["--steps", str(steps), *TINY_GPT.script_args(), "--pipeline-major"]
        command += ["--metrics", str(run / "metrics"), "--dump", str(run / "dump"), *options]
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "DS_RECYCLE_TOKEN": TOKEN}
        self.proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
        )
        self.lines: list[str] = []
        self.log = run / f"agent{node}.{incarnation}.log"
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        with open(self.log, "a") as log:
            for line in self.proc.stdout:
                self.lines.append(line.rstrip())
                log.write(line)
                log.flush()

    def signal(self, sig: int, ranks_too: bool) -> None:
        os.killpg(self.proc.pid, sig)
        for pid in self.events.all_pids() if ranks_too else []:
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGKILL, ranks_too=True)


def records(run: Path) -> list[dict]:
    path = run / "metrics" / "metrics.0.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def iterations_done(run: Path) -> int:
    done = [r["iteration"] for r in records(run) if r["kind"] == "iteration"]
    return max(done, default=0)


def wait(condition, what: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def run_job(run: Path, steps: int, lease: float, faults: bool, options: list[str]) -> dict:
    run.mkdir(parents=True)
    (run / "ds_config.json").write_text(json.dumps(CONFIG))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    nodes = [Node(run, k, port, steps, lease, options) for k in range(NODES)]
    events: dict[str, float] = {}
    try:
        if faults:
            wait(lambda: iterations_done(run) >= steps // 8, "the fault-free phase")
            events["sigkill"] = time.time()
            nodes[3].signal(signal.SIGKILL, ranks_too=False)  # the ranks die with their agent
            wait(lambda: iterations_done(run) >= steps // 8 + 6, "a degraded phase")
            nodes[3] = Node(run, 3, port, steps, lease, options, incarnation=1)
            wait(lambda: sum(r["kind"] == "change" for r in records(run)) >= 2, "node 3's re-admission")
            restored = iterations_done(run) + 6
            wait(lambda: iterations_done(run) >= restored, "a restored phase")
            events["freeze"] = time.time()
            nodes[2].signal(signal.SIGSTOP, ranks_too=True)
            wait(lambda: sum(r["kind"] == "change" for r in records(run)) >= 3, "node 2's failure")
            nodes[2].signal(signal.SIGCONT, ranks_too=True)
            wait(lambda: nodes[2].proc.poll() is not None, "node 2 to fence itself", 60)
            nodes[2] = Node(run, 2, port, steps, lease, options, incarnation=1)
        wait(lambda: all(n.proc.poll() is not None for n in nodes), "the job's end", 900)
    finally:
        for node in nodes:
            node.kill()
    codes = [n.proc.returncode for n in nodes]
    return {"records": records(run), "events": events, "codes": codes}


def phases(result: dict) -> list[tuple[str, list[dict], dict | None, str | None]]:
    """(name, iteration records, the change that started it, the signal behind it) per epoch; the
    n-th change with a failure follows the n-th signal sent."""
    signals = iter([event for event in ("sigkill", "freeze") if event in result["events"]])
    out, current, change, name, cause = [], [], None, "fault-free", None
    for record in result["records"]:
        if record["kind"] != "change":
            current.append(record)
            continue
        out.append((name, current, change, cause))
        current, change = [], record
        if record["failed"]:
            cause = next(signals, None)
            name = f"failed {record['failed']}"
        else:
            cause, name = None, f"joined {record['joined']}"
    out.append((name, current, change, cause))
    return out


def report(fault_free: dict, faulty: dict, run_dir: Path) -> None:
    import torch

    base = statistics.median(r["seconds"] for r in fault_free["records"] if r["kind"] == "iteration")
    print(f"4 agents x 2 ranks, P=2 D=4 pipeline-major, m=4, F=B=W=25 ms emulated; fault-free median {base:.3f} s")
    print(f"{'phase':30s} {'iters':>5s} {'median s':>9s} {'pred s':>7s} {'meas/pred':>9s} {'vs ff':>6s} "
          f"{'detect s':>8s} {'to plan s':>9s}  change")  # fmt: skip
    for name, iters, change, cause in phases(faulty):
        seconds = [r["seconds"] for r in iters[1:]]  # the first iteration of an epoch carries the switch
        if not seconds:
            continue
        median = statistics.median(seconds)
        predicted = (change or {}).get("plan", {}) or {}
        pred = predicted.get("predicted_iteration_time")
        pred_s = None if pred is None else pred / 1000
        detect = to_plan = None
        signal_time = faulty["events"].get(cause) if cause else None
        name = f"{name} ({cause})" if cause else name
        if change is not None and signal_time is not None:
            published = change["time"] - (change["recovery_seconds"] or 0)
            detect, to_plan = published - signal_time, change["time"] - signal_time
        joined = "" if change is None else f"epoch {change['epoch']} from iteration {change['iteration']}"
        print(
            f"{name:30s} {len(iters):5d} {median:9.3f} {pred_s if pred_s is None else round(pred_s, 3)!s:>7s} "
            f"{'-' if pred_s is None else f'{median / pred_s:.3f}':>9s} {base / median:6.3f} "
            f"{'-' if detect is None else f'{detect:.2f}':>8s} "
            f"{'-' if to_plan is None else f'{to_plan:.2f}':>9s}  {joined}"
        )
    worst, where = 0.0, ""
    for path in sorted((run_dir / "faulty" / "dump").glob("rank*.pt")):
        ours = torch.load(path, weights_only=False)
        theirs = torch.load(run_dir / "fault_free" / "dump" / path.name, weights_only=False)
        for name, value in theirs["params"].items():
            difference = (ours["params"][name] - value).abs().max().item()
            if difference > worst:
                worst, where = difference, f"{path.stem} {name}"
    print(f"agents' exit codes {faulty['codes']}; max |parameter - fault-free| over every rank: {worst:.3g} ({where})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=90)
    parser.add_argument("--node-lease", type=float, default=5.0)
    parser.add_argument("--smoke", action="store_true", help="a short fault-free run only (for the test suite)")
    parser.add_argument("--keep", type=Path, default=None, help="run in this (new) directory and keep it")
    parser.add_argument(
        "--optimizer",
        choices=["adam", "sgd"],
        default="adam",
        help="adam: the config's (torch Adam, lr 0.003); sgd: torch SGD with momentum 0.9, lr 0.003",
    )
    args = parser.parse_args()
    options = [] if args.optimizer == "adam" else ["--optimizer", "sgd", "--lr", "0.003"]
    with tempfile.TemporaryDirectory(prefix="bench_multinode_") as tmp:
        run_dir = args.keep or Path(tmp)
        fault_free = run_job(
            run_dir / "fault_free", 6 if args.smoke else args.steps, args.node_lease, faults=False, options=options
        )
        if args.smoke:
            assert fault_free["codes"] == [0] * NODES, fault_free["codes"]
            print(f"smoke: {sum(r['kind'] == 'iteration' for r in fault_free['records'])} iterations on 4 agents")
            return
        faulty = run_job(run_dir / "faulty", args.steps, args.node_lease, faults=True, options=options)
        report(fault_free, faulty, run_dir)


if __name__ == "__main__":
    main()
