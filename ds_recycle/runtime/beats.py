"""Heartbeats from a rank to its node's agent: one small file per slot in a node-local directory.

A rank beats ten times a second. Were each beat a store write, the store would serve ten writes per
rank and second (80 per node of 8 GPUs) in steady state for liveness alone, and hold a socket per
rank for it. Instead each rank replaces its own file (``<directory>/<slot>``, written whole and
renamed into place, so a reader never sees half of it) and its node's agent reads the node's files
at every lease renewal and relays them in the lease (``lease/<node>``): one store write per node
and renewal. The directory is made by ``ds-recycle launch`` and named in ``DS_RECYCLE_BEATS``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from ds_recycle.runtime.protocol import Beat


def beat_path(directory: str | os.PathLike, slot: int) -> Path:
    return Path(directory) / str(slot)


def write_beat(directory: str | os.PathLike, slot: int, beat: Beat) -> None:
    """Replace ``slot``'s beat file with ``beat`` (atomically: written aside, renamed into place)."""
    path = beat_path(directory, slot)
    aside = path.with_name(f".{slot}.{os.getpid()}")
    aside.write_text(json.dumps(beat.to_list()))
    os.replace(aside, path)


def read_beats(directory: str | os.PathLike, slots: Iterable[int]) -> dict[int, Beat]:
    """The last beat of each of ``slots`` that has one (a slot that never beat has no file)."""
    beats = {}
    for slot in slots:
        try:
            beats[slot] = Beat.from_list(json.loads(beat_path(directory, slot).read_text()))
        except (OSError, ValueError, TypeError):
            continue
    return beats
