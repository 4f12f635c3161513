"""Read TensorBoard event files back as TensorBoard does (record framing, purges), with tensorboardX's protos."""

from __future__ import annotations

import struct
from pathlib import Path

from tensorboardX.proto.event_pb2 import Event, SessionLog


def events(path: Path) -> list[Event]:
    """Every record of one event file (TFRecord framing: length, its crc, data, its crc)."""
    data, out, at = path.read_bytes(), [], 0
    while at < len(data):
        (length,) = struct.unpack_from("<Q", data, at)
        out.append(Event.FromString(data[at + 12 : at + 12 + length]))
        at += 12 + length + 4
    return out


def event_files(run_dir: Path) -> list[Path]:
    return sorted(run_dir.glob("events.out.tfevents.*"))


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value), ...] over the run's event files in order; a session start at step S drops what
    earlier files logged at steps >= S, as TensorBoard's purge does."""
    tags: dict[str, list[tuple[int, float]]] = {}
    for path in event_files(run_dir):
        for event in events(path):
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                tags = {tag: [(s, v) for s, v in points if s < event.step] for tag, points in tags.items()}
            for value in event.summary.value:
                tags.setdefault(value.tag, []).append((event.step, value.simple_value))
    return tags


def wandb_records(path: Path) -> list:
    """The records of a W&B run file (`run-ID.wandb`: a 7-byte header, then LevelDB-log blocks of
    32 KiB whose chunks are crc32 (4 bytes), length (2), type (1: full, 2: first, 3: middle, 4: last))."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, block, out, pending, at = path.read_bytes(), 32768, [], b"", 7
    while at + 7 <= len(data):
        left = block - at % block
        _, length, kind = struct.unpack_from("<IHB", data, at)
        if left < 7 or (kind == 0 and length == 0):  # block padding
            at += left
            continue
        pending += data[at + 7 : at + 7 + length]
        at += 7 + length
        if kind in (1, 4):
            out.append(Record.FromString(pending))
            pending = b""
    return out


def wandb_history(path: Path) -> list[dict[str, str]]:
    """Each `log` call of a W&B run file as {key: JSON value}."""
    return [{item.key or "/".join(item.nested_key): item.value_json for item in r.history.item}
            for r in wandb_records(path) if r.WhichOneof("record_type") == "history"]


def wandb_run(path: Path):
    """The run record (its id, project and config) of a W&B run file."""
    return next(r.run for r in wandb_records(path) if r.WhichOneof("record_type") == "run")
