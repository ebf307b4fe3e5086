"""Read an offline W&B transaction log (``run-<id>.wandb``) without the network or wandb's CLI.

Layout (wandb 0.31): a 7-byte header (``:W&B``, magic 0xBEE1 little-endian, version 0), then
LevelDB-log framing in 32 KiB blocks: each chunk is ``crc32c-masked u32, length u16, type u8``
(1 full, 2 first, 3 middle, 4 last) followed by its data; a block's tail shorter than a chunk header
is zero padding. The reassembled payloads are ``wandb_internal_pb2.Record`` messages. A file whose
writer was killed may end inside a record: reading stops before it.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator
from pathlib import Path

HEADER = struct.Struct("<4sHB")
CHUNK = struct.Struct("<IHB")
BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str | Path) -> Iterator:
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    ident, magic, version = HEADER.unpack_from(data, 0)
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, hex(magic), version)
    offset, pending = HEADER.size, b""
    while offset + CHUNK.size <= len(data):
        left_in_block = BLOCK - offset % BLOCK
        if left_in_block < CHUNK.size:
            offset += left_in_block
            continue
        _crc, length, kind = CHUNK.unpack_from(data, offset)
        offset += CHUNK.size
        if kind == 0 and length == 0:  # zero padding at the end of the file
            break
        if offset + length > len(data):  # a writer killed mid-record: its last record is cut off
            break
        payload, offset = data[offset : offset + length], offset + length
        if kind == FULL:
            pending = payload
        elif kind == FIRST:
            pending = payload
            continue
        elif kind == MIDDLE:
            pending += payload
            continue
        elif kind == LAST:
            pending += payload
        else:
            raise ValueError(f"bad chunk type {kind} at {offset}")
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending)
        pending = b""
        yield record


def history(path: str | Path) -> list[dict]:
    """The logged rows in order, as ``{key: value}`` (with W&B's ``_step`` etc.)."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
            )
    return rows


def kinds(path: str | Path) -> list[str]:
    return [record.WhichOneof("record_type") for record in records(path)]


def run_files(wandb_dir: str | Path, run_id: str, finished: bool = False, timeout: float = 30.0) -> list[Path]:
    """Every offline directory of ``run_id`` (a resumed offline run opens a new one), oldest first.
    ``finished``: wait until each file holds its ``exit`` record (``run.finish()`` returns before
    wandb-core has written the file out)."""
    paths = sorted(Path(wandb_dir).glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))
    deadline = time.monotonic() + timeout
    for path in paths if finished else []:
        while "exit" not in kinds(path):
            assert time.monotonic() < deadline, f"{path} has no exit record after {timeout} s"
            time.sleep(0.05)
    return paths


def summary(path: str | Path) -> dict:
    """The run summary as the last ``summary`` records left it."""
    out: dict = {}
    for record in records(path):
        if record.WhichOneof("record_type") == "summary":
            for item in record.summary.update:
                out["/".join(item.nested_key) or item.key] = json.loads(item.value_json)
    return out


def run_record(path: str | Path):
    return next(r.run for r in records(path) if r.WhichOneof("record_type") == "run")


def config(path: str | Path) -> dict:
    """The run config: the init record's, then every later update."""
    out: dict = {}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        updates = record.run.config.update if kind == "run" else record.config.update if kind == "config" else []
        for item in updates:
            out["/".join(item.nested_key) or item.key] = json.loads(item.value_json)
    return out
