"""Readers of what the trackers wrote, for tests: an offline W&B run's history (its `.wandb` record log, read
without wandb's service or any network) and TensorBoard's raw events with its purge markers applied."""
from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024  # the .wandb file: a LevelDB-style log of protobuf Records in 32 KiB blocks
HEADER = 7  # a record's header: crc32 (4), length (2), type (1: full, 2: first, 3: middle, 4: last)


def _wandb_records(path: Path):
    data = Path(path).read_bytes()[7:]  # file header: ":W&B", magic (2), version (1)
    pos, parts = 0, b""
    while pos + HEADER <= len(data):
        left = BLOCK - (pos + 7) % BLOCK  # blocks count from the file's start
        if left < HEADER:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:
            continue
        parts += chunk
        if kind in (1, 4):
            yield parts
            parts = b""


def wandb_history(path: Path) -> list[dict]:
    """Every history row of an offline run file, in order: {key: value} (values JSON-decoded)."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for raw in _wandb_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append({(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def tensorboard_scalars(log_dir: Path, tag: str) -> dict[int, float]:
    """{step: value} of one scalar as TensorBoard shows it: event files in order, each purge marker (a
    SessionLog.START at step p, written by SummaryWriter(purge_step=p)) dropping the events at steps >= p."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.compat.proto.event_pb2 import SessionLog

    out: dict[int, float] = {}
    for f in sorted(Path(log_dir).glob("events.out.tfevents.*"), key=lambda p: int(p.name.split(".")[3])):
        for event in EventFileLoader(str(f)).Load():
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                out = {s: v for s, v in out.items() if s < event.step}
            for value in event.summary.value:
                if value.tag == tag:
                    if event.step in out:
                        raise AssertionError(f"{tag} step {event.step} twice in {log_dir}")
                    kind = value.WhichOneof("value")
                    out[event.step] = (value.simple_value if kind == "simple_value" else
                                       float(value.tensor.float_val[0]) if kind == "tensor" else None)
    return out
