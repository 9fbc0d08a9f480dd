"""Reading a W&B offline run's ``run-<id>.wandb`` file: the records wandb itself wrote.

wandb 0.31 writes the file from its Go core and ships no Python reader; the format is
wandb's own (its former ``wandb.sdk.internal.datastore``): a 7-byte header (``:W&B``, the
magic 0xBEE1, version 0), then LevelDB-log blocks of 32 KiB whose records (CRC-32C,
length, type: full / first / middle / last) carry ``wandb.proto.wandb_internal_pb2.Record``
messages, decoded here with wandb's own protobuf classes.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path):
    """Every ``Record`` in the file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1, data[:7]
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        room = BLOCK - pos % BLOCK
        if room < HEADER:  # the block's tail is padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if length == 0 and kind == 0:
            pos += room
            continue
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            rec = pb.Record()
            rec.ParseFromString(pending)
            yield rec


def history(path: Path) -> dict[int, dict[str, float]]:
    """The run's logged rows by step: ``{step: {key: value}}``."""
    out: dict[int, dict[str, float]] = {}
    for rec in records(path):
        if rec.WhichOneof("record_type") != "history":
            continue
        row = {(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
               for item in rec.history.item}
        step = rec.history.step.num if rec.history.HasField("step") else row.get("_step")
        out[int(step)] = {k: v for k, v in row.items() if not k.startswith("_")}
    return out


def config(path: Path) -> dict[str, object]:
    """The run's config as its config records set it (later updates win)."""
    out: dict[str, object] = {}
    for rec in records(path):
        if rec.WhichOneof("record_type") == "config":
            for item in rec.config.update:
                out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif rec.WhichOneof("record_type") == "run":
            for item in rec.run.config.update:
                out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out
