"""Read back what the trackers wrote, with the libraries' own readers (test helper).

- TensorBoard: ``EventAccumulator`` from the tensorboard package.
- W&B offline runs: the ``run-<id>.wandb`` file is a LevelDB-style log of protobuf ``Record``s.
  wandb 0.31 no longer ships its Python reader (the datastore moved into the Go core), so the
  framing is unpacked here (7-byte header per chunk: crc32, length, type; 32 KiB blocks; types
  FULL=1, FIRST=2, MIDDLE=3, LAST=4) and each record is parsed with wandb's own protobuf
  classes (``wandb.proto.wandb_internal_pb2.Record``).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_BLOCK = 32 * 1024
_HEADER = 7


def tensorboard_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] over every event file in ``logdir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, list[tuple[int, float]]] = {}
    for events in sorted(logdir.glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return out


def _chunks(data: bytes) -> list[bytes]:
    if data[:4] != b":W&B":
        raise ValueError("not a W&B transaction log")
    records, pending, pos = [], b"", _HEADER  # the file starts with a 7-byte magic/version header
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # block trailer: padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        if kind == 0 and length == 0:
            pos += left
            continue
        payload = data[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        if kind == 1:
            records.append(payload)
        elif kind == 2:
            pending = payload
        elif kind == 3:
            pending += payload
        elif kind == 4:
            records.append(pending + payload)
            pending = b""
    return records


@dataclass
class WandbRun:
    run_id: str
    project: str
    config: dict[str, Any] = field(default_factory=dict)
    history: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    """(step, {key: value}) per logged row."""
    git_commit: str = ""
    """The commit the run record carries (wandb's ``git_commit`` setting)."""
    artifacts: list[tuple[str, str, list[str]]] = field(default_factory=list)
    """(type, name, the paths in its manifest) per logged artifact."""
    files: list[str] = field(default_factory=list)
    """The run files saved with the run (paths under its files/ directory)."""

    def series(self, key: str) -> list[tuple[int, Any]]:
        return [(step, row[key]) for step, row in self.history if key in row]


def read_wandb_file(path: Path, wait_s: float = 60.0) -> WandbRun:
    """The run in a ``.wandb`` file. wandb's service writes it asynchronously and may still be
    flushing just after ``finish()`` on a busy machine, so a file without its run record yet is read
    again for up to ``wait_s`` seconds."""
    import time

    deadline = time.monotonic() + wait_s
    while True:
        try:
            return _read_wandb_file_once(path)
        except ValueError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _read_wandb_file_once(path: Path) -> WandbRun:
    from wandb.proto import wandb_internal_pb2 as pb

    run: WandbRun | None = None
    history: list[tuple[int, dict[str, Any]]] = []
    artifacts: list[tuple[str, str, list[str]]] = []
    files: list[str] = []
    for raw in _chunks(path.read_bytes()):
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
            run = WandbRun(run_id=record.run.run_id, project=record.run.project, config=config,
                           git_commit=record.run.git.commit)
        elif kind == "history":
            row = {}
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            history.append((int(record.history.step.num), row))
        elif kind == "artifact":
            art = record.artifact
            artifacts.append((art.type, art.name, sorted(entry.path for entry in art.manifest.contents)))
        elif kind == "files":
            files.extend(f.path for f in record.files.files)
    if run is None:
        raise ValueError(f"{path}: no run record")
    run.history, run.artifacts, run.files = history, artifacts, files
    return run


def wandb_runs(root: Path) -> list[WandbRun]:
    """Every offline run under ``root`` (``<root>/wandb/offline-run-*/run-*.wandb``), oldest first."""
    return [read_wandb_file(p) for p in sorted(root.glob("wandb/offline-run-*/run-*.wandb"))]
