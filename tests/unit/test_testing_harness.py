"""ds_recycle.testing, the harness of the tests, benchmarks and examples: it stays light to import,
the library never imports it, and its pieces read what the launcher and the drivers write."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ds_recycle.testing.faults import Trap
from ds_recycle.testing.launch_events import LaunchEvents
from ds_recycle.testing.tiny import TINY_GPT, ds_config

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ds_recycle"


def test_the_harness_imports_neither_torch_nor_deepspeed():
    code = (
        "import sys, ds_recycle.testing, ds_recycle.testing.tiny, ds_recycle.testing.faults, "
        "ds_recycle.testing.launch_events, ds_recycle.testing.rank; "
        "sys.exit(sorted({'torch', 'deepspeed'} & set(sys.modules)) != [])"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=60).returncode == 0


def test_the_library_does_not_import_the_harness():
    for path in PACKAGE.rglob("*.py"):
        if PACKAGE / "testing" in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            assert not any(n.startswith("ds_recycle.testing") for n in names), path


def test_every_config_sets_gradient_clipping():
    assert ds_config(4, 0.0)["gradient_clipping"] == 0.0
    config = ds_config(8, 1.0, {"enabled": True}, micro_batch_size=4, optimizer={"type": "Adam"})
    assert config["gradient_clipping"] == 1.0 and config["recycle"] == {"enabled": True}
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) == (4, 8)
    assert config["optimizer"] == {"type": "Adam"} and "recycle" not in ds_config(4, 0.0)
    with pytest.raises(TypeError):
        ds_config(4)  # the clip is never implicit


def test_tiny_gpt_sizes_reach_train_gpt_arguments():
    args = TINY_GPT.script_args()
    assert dict(zip(args[::2], args[1::2], strict=True)) == {
        "--layers": "2",
        "--d-model": "32",
        "--heads": "4",
        "--seq-len": "16",
    }


def test_launch_events_reads_only_complete_lines(tmp_path):
    path = tmp_path / "events.jsonl"
    events = LaunchEvents(path)
    assert events.poll() == [] and events.pids() == {}
    started = {"event": "started", "time": 1.0, "slot": 0, "pid": 11, "incarnation": 0, "generation": 0}
    line = json.dumps(started) + "\n"
    path.write_text(line + line[:10])
    assert events.count("started") == 1 and events.pids() == {0: 11}
    with open(path, "a") as f:
        f.write(line[10:].replace('"pid": 11', '"pid": 12'))
        f.write(json.dumps({"event": "exited", "time": 2.0, "slot": 0, "pid": 12, "code": None, "signal": "SIGKILL"}))
        f.write("\n")
    assert events.pids() == {0: 12} and events.all_pids() == [11, 12]
    assert events.count("exited", slot=0, signal="SIGKILL") == 1 and events.count("exited", code=0) == 0
    assert events.ended() is None
    with pytest.raises(TimeoutError, match="the launcher ended"):
        events.wait_for("ended", alive=lambda: False)


def test_traps_from_the_command_line_and_from_files(tmp_path):
    assert Trap.parse("3:allreduce:7") == (3, Trap("allreduce", 7))
    assert Trap.parse("2:building:4:until-failure") == (2, Trap("building", 4, until_failure=True))
    with pytest.raises(ValueError, match="until-failure"):
        Trap.parse("2:building:4:until-fail")
    assert not Trap("F", 7).release_on_leave
    assert Trap("recovery", 7).armed("recovery", 9) and not Trap("F", 7).armed("F", 8)
    path = tmp_path / "trap3"
    assert Trap.read(path) is None
    path.write_text("B:5:t1")
    assert Trap.read(path) == Trap("B", 5, "t1", release_on_leave=True)
    path.write_text("W:5:t2:stay")
    assert Trap.read(path) == Trap("W", 5, "t2", release_on_leave=False)
    with pytest.raises(ValueError, match="one of"):
        Trap("X", 1)
