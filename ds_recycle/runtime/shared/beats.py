"""Heartbeats from a rank to its node's agent: one small file per slot in a node-local directory.

A rank beats ten times a second. Were each beat a store write, the store would serve ten writes per
rank and second (80 per node of 8 GPUs) in steady state for liveness alone, and hold a socket per
rank for it. Instead each rank replaces its own file (``<directory>/<slot>``, written whole and
renamed into place, so a reader never sees half of it) and its node's agent reads the node's files
at every lease renewal and relays them in the lease (``lease/<node>``): one store write per node
and renewal. The directory is made by ``ds-recycle launch`` (:func:`make_beat_directory`) and named in
``DS_RECYCLE_BEATS``; the agent removes it when it ends. An agent killed outright leaves it behind,
named for its PID, and the next agent started on the machine removes it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

from ds_recycle.runtime.shared.records import Beat

DIRECTORY_PREFIX = "ds_recycle_beats_"
ORPHAN_AFTER_SECONDS = 60.0
"""A killed agent's directory is removed once no beat was written to it for this long."""
_DIRECTORY_NAME = re.compile(rf"{DIRECTORY_PREFIX}node\d+_pid(\d+)_\w+")


def make_beat_directory(node_rank: int, root: str | None = None) -> str:
    """A new beat directory for this agent (in ``root``, the system's temporary directory by
    default), after removing those that killed agents left there."""
    remove_orphaned_beat_directories(root)
    return tempfile.mkdtemp(prefix=f"{DIRECTORY_PREFIX}node{node_rank}_pid{os.getpid()}_", dir=root)


def remove_orphaned_beat_directories(root: str | None = None, orphan_after: float = ORPHAN_AFTER_SECONDS) -> list[Path]:
    """Remove this user's beat directories in ``root`` whose agent no longer runs and to which no
    beat was written for ``orphan_after`` seconds (both: a PID from another PID namespace that
    shares the directory reads as not running); returns them."""
    removed = []
    for path in Path(root or tempfile.gettempdir()).glob(f"{DIRECTORY_PREFIX}node*"):
        named = _DIRECTORY_NAME.fullmatch(path.name)
        if named is None:
            continue
        try:
            status = path.stat()
        except OSError:
            continue
        if status.st_uid != os.getuid() or not stat.S_ISDIR(status.st_mode):
            continue
        if _running(int(named.group(1))) or time.time() - status.st_mtime < orphan_after:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
