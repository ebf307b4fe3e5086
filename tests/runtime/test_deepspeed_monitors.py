"""ReCycle's events reach the monitors of the DeepSpeed config (here ``csv_monitor``) from the
lowest live rank: rank 0 writes the iteration series; when it is SIGKILLed, rank 1 leads, writes
the membership change (one failed worker, the live workers per stage) and the series go on."""

from __future__ import annotations

import csv
import json
import os
import signal
import threading
import time

import pytest

from ds_recycle.runtime.node.launcher import LaunchConfig, Launcher
from ds_recycle.runtime.node.preload import PRELOAD_MODULES
from ds_recycle.testing.launch_events import LaunchEvents
from ds_recycle.testing.tiny import ds_config

pytestmark = pytest.mark.multiprocess

STEPS = 8
SCRIPT = """
import json, os, sys, time
os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch
import ds_recycle
from ds_recycle.data import TokenWindowProvider, shipped_corpus_tokens
from ds_recycle.models import build_gpt_pipeline
from ds_recycle.testing.tiny import TINY_GPT

out, config = sys.argv[1], json.loads(sys.argv[2])
torch.set_num_threads(1)
ds_recycle.init_distributed()
tokenizer, tokens = shipped_corpus_tokens()
cfg = TINY_GPT.config(tokenizer.vocab_size)
model = build_gpt_pipeline(cfg, num_stages=2, seed=0)
provider = TokenWindowProvider(tokens, cfg.seq_len, config["train_micro_batch_size_per_gpu"], seed=0)
engine, *_ = ds_recycle.initialize(
    model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config, training_data=provider
)
while engine.global_steps < STEPS:
    engine.train_batch()
    with open(os.path.join(out, f"progress{os.environ['RANK']}"), "w") as f:
        f.write(str(engine.global_steps))
    time.sleep(0.2)
""".replace("STEPS", str(STEPS))


def test_recycle_events_reach_deepspeeds_csv_monitor_across_the_leaders_death(tmp_path):
    csv_dir = tmp_path / "csv"
    monitor = {"enabled": True, "output_path": str(csv_dir), "job_name": "job"}
    config = ds_config(2, 0.0, {"enabled": True, "emulate_timing": {"F": 5, "B": 5, "W": 5}}, csv_monitor=monitor)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    lines: list[str] = []
    events = LaunchEvents(tmp_path / "events.jsonl")
    argv = [str(script), str(tmp_path), json.dumps(config)]
    launcher = Launcher(
        LaunchConfig(argv=argv, nproc=4, timeout=180, log_dir=tmp_path, events=events.path, preload=PRELOAD_MODULES),
        echo=lines.append,
    )
    killer = threading.Thread(target=_kill_rank_0_at_iteration_3, args=(tmp_path, events), daemon=True)
    killer.start()
    code = launcher.run()
    killer.join(timeout=5)
    assert code == 0, "rank 0 is no member at the end; every member exited 0"
    assert [r.returncode for r in launcher.results()] == [-9, 0, 0, 0], lines
    series = csv_dir / "job"
    rank0, rank1 = _writers(series / "Recycle_iteration_time_s.csv")
    assert rank0 and rank1, "rank 0 writes the series until its death, then rank 1"
    # The iteration rank 0 died after may have two rows: rank 0 finished it and wrote its row while
    # the survivors were still at its boundary, kept it there, and rank 1 reports it as it leads.
    once = rank0 + (rank1[1:] if rank1[0][0] == rank0[-1][0] else rank1)
    steps = [step for step, _ in once]
    assert len(steps) == STEPS and steps == sorted(set(steps)), f"one row per iteration: {rank0} then {rank1}"
    [failed] = _column(series / "Recycle_event_failed.csv")
    assert failed == 1.0
    assert _column(series / "Recycle_live_workers_stage_0.csv") == [1.0]
    assert _column(series / "Recycle_live_workers_stage_1.csv") == [2.0]


def _kill_rank_0_at_iteration_3(tmp_path, events: LaunchEvents) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        pids = events.pids()
        progress = tmp_path / "progress0"
        if 0 in pids and progress.exists() and progress.read_text().strip() in {"3", "4"}:
            os.kill(pids[0], signal.SIGKILL)
            return
        time.sleep(0.01)


def _writers(path) -> list[list[tuple[int, float]]]:
    """A DeepSpeed CSV series as (step, value) rows, one list per writer (each starts with a header)."""
    writers: list[list[tuple[int, float]]] = []
    with open(path) as f:
        for row in csv.reader(f):
            if row[0] == "step":
                writers.append([])
            else:
                writers[-1].append((int(float(row[0])), float(row[1])))
    return writers


def _column(path) -> list[float]:
    """The values of a DeepSpeed CSV series (a new writer, here the new leader, repeats the header)."""
    with open(path) as f:
        return [float(row[1]) for row in csv.reader(f) if row[0] != "step"]
