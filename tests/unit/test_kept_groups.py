"""Stage and pipe groups kept across epochs, on real gloo processes: the groups without the lost
worker are kept (the same objects, registered in the new world with its ranks), a group on which a
failure left a collective that only some members posted is made afresh, and every all-reduce of
the new epoch sums its own members' values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds_recycle.runtime.node.launcher import launch
from ds_recycle.runtime.node.preload import PRELOAD_MODULES

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).with_name("kept_groups_worker.py")
SURVIVORS = range(5)


def test_groups_without_the_lost_worker_are_kept_and_an_abandoned_collective_remakes_its_group(tmp_path):
    out = tmp_path / "out"
    results = launch(
        [str(WORKER), "--out", str(out)],
        world_size=6,
        timeout=150,
        log_dir=tmp_path / "logs",
        preload=PRELOAD_MODULES,
        membership=False,
    )
    for result in results:
        assert result.ok, result.log[-4000:]
    rows = {slot: json.loads((out / f"rank{slot}.json").read_text()) for slot in SURVIVORS}
    # slot 5 = (pipeline 2, stage 1) is lost; stage 0 disagrees: slot 0 posted one more all-reduce
    assert {tuple(row["remade"]) for row in rows.values()} == {("pipe2", "stage0", "stage1")}
    assert rows[0]["states"]["stage0"] == [1, 2] and rows[1]["states"]["stage0"] == [1, 1]
    assert rows[0]["states"]["pipe0"] == [1, 0]
    assert {slot: row["kept"] for slot, row in rows.items()} == {
        0: ["pipe0"],
        1: ["pipe1"],
        2: [],
        3: ["pipe0"],
        4: ["pipe1"],
    }
    # stage 0 = slots 0, 1, 2 (values 1, 2, 3); stage 1 = slots 3, 4; pipelines 0 = {0, 3}, 1 = {1, 4}
    assert [rows[s]["stage"] for s in SURVIVORS] == [6.0, 6.0, 6.0, 9.0, 9.0]
    assert [rows[s]["stage_rank"] for s in SURVIVORS] == [0, 1, 2, 0, 1]
    assert [rows[s].get("pipe") for s in SURVIVORS] == [5.0, 7.0, None, 5.0, 7.0]
