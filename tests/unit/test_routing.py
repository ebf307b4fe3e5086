"""Routed p2p between real gloo processes: a pair's messages match in the order they were posted, a
header gives the first activation's shapes, a pair whose two sides disagree on the order fails with
an error that names both messages, and a pair's group kept into the next epoch carries its messages
past the ones a failure abandoned."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds_recycle.engine.routing import CHECK_ENV
from ds_recycle.runtime.node.launcher import launch
from ds_recycle.runtime.node.preload import PRELOAD_MODULES

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).with_name("routing_worker.py")


def run_pair(tmp_path: Path, scenario: str, checked: bool) -> list[dict]:
    out = tmp_path / "out"
    results = launch(
        [str(WORKER), "--scenario", scenario, "--out", str(out)],
        world_size=2,
        timeout=120,
        log_dir=tmp_path / "logs",
        preload=PRELOAD_MODULES,
        env={CHECK_ENV: "1" if checked else "0"},
    )
    for result in results:
        assert result.ok, result.log[-4000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("checked", [False, True])
def test_a_pairs_messages_match_in_posting_order(tmp_path, checked):
    first, last = run_pair(tmp_path, "agreed_order", checked)
    assert first["checked"] is last["checked"] is checked
    # per iteration: gradients of micro-batches 1 and 0, tied gradient, partial norm, loss
    assert first["received"] == [-2.0, -1.0, 200.0, 400.0, 500.0, -2.0, -1.0, 201.0, 401.0, 501.0]
    # activations (value, home, mb) of micro-batches 1 and 0, partial norm, tied weight
    assert last["received"] == [1.0, 0, 1, 0.0, 0, 0, 100.0, 300.0] + [1.0, 0, 1, 0.0, 0, 0, 101.0, 301.0]


def test_the_first_activation_on_a_pair_is_checked(tmp_path):
    _first, last = run_pair(tmp_path, "swapped", checked=False)
    assert last["error"] == (
        "workers (0, 0) and (0, 1) post their messages in different orders: (0, 1) receives activation of "
        "micro-batch (0,1) as message 0 from (0, 0), but (0, 0) sent activation of micro-batch (0,0) as "
        "message 0 to it"
    )


def test_a_checked_channel_checks_every_message(tmp_path):
    _first, last = run_pair(tmp_path, "swapped", checked=True)
    assert last["error"] == (
        "workers (0, 0) and (0, 1) post their messages in different orders: (0, 1) receives gradient of "
        "micro-batch (0,0) as message 2 from (0, 0), but (0, 0) sent gradient of micro-batch (0,1) as "
        "message 2 to it"
    )


def test_connecting_a_peer_that_never_connects_stops_at_the_failure_flag(tmp_path):
    """A pair connects in gloo's worker thread (a one-element all-reduce on its own group), so a
    survivor waiting for a dead peer's connection stops when the failure is flagged (a pair's group
    never times out)."""
    first, last = run_pair(tmp_path, "absent_peer", checked=False)
    waited, outcome = first["received"]
    assert outcome == "a failure was announced during connecting slot 0 to slot 1"
    assert 0.9 < waited < 5.0
    assert last["received"] == []


def test_a_pair_cut_short_is_made_again_and_a_kept_one_carries_the_next_epochs_messages(tmp_path):
    first, last = run_pair(tmp_path, "kept_pair", checked=False)
    # per epoch: its messages, exactly as on a fresh pair, then whether the group of the epoch
    # before carried them (epoch 1: no, made again; epoch 2: yes, kept); last, the pairs left
    # after the first stage entered an epoch without the last (none) or not (one)
    first_epoch = [-2.0, -1.0, 200.0, 400.0, 500.0, -2.0, -1.0, 201.0, 401.0, 501.0]
    last_epoch = [1.0, 0, 1, 0.0, 0, 0, 100.0, 300.0] + [1.0, 0, 1, 0.0, 0, 0, 101.0, 301.0]
    assert first["received"] == first_epoch + [0.0] + first_epoch + [1.0] + [0.0]
    assert last["received"] == last_epoch + [0.0] + last_epoch + [1.0] + [1.0]
