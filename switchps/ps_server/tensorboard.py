"""TensorBoard event files of a run, written by the recorder's flusher without TensorFlow.

``RUN_DIR/tensorboard/`` gets, per update (step = model version): training loss, learning rate,
staleness, samples in the update and the protocol in force (its index in ``PROTOCOLS``, and a text
entry at each change); per flush: samples/s; per worker step of workers 0 to 63 (step = the worker's
step): its step time (a larger run's others are in workers.csv: ten thousand tags help nobody, and
cost a simulation a tenth of its time); per model version that pushes of local steps started from (step =
their ``base_version``), over those pushes in a flush: the inner loss (the mean of a push's local steps'
losses) and the outer loss (its first local step's: the loss at that version's values); per evaluation:
test accuracy and loss. A sharded PS's follower K writes ``tensorboard/shard-K/`` (``shard_scalars``).
`tensorboard --logdir runs/` shows every run.

The events are written in the flusher's own thread, straight to the file (``EventFile``): one event per
update holds all of that update's scalars. tensorboardX's ``SummaryWriter`` sent every scalar as an
event of its own through a multiprocessing queue to two more threads, which cost the PS a quarter of
its CPU per push on the small model (``bench/profile_step.py``). Only its protobuf messages and its
text summary are used here.
"""

from __future__ import annotations

import math
import socket
import struct
import sys
import time
from collections import defaultdict
from pathlib import Path

from switchps.names import PROTOCOLS

_HIDE_TORCH = "torch" not in sys.modules
"""tensorboardX's package imports PyTorch where it is installed (for its SummaryWriter, unused here): hidden
while it loads, so that the PS loads no framework (a torch import costs a process seconds and memory)."""
if _HIDE_TORCH:
    sys.modules["torch"] = None  # type: ignore[assignment]  # ``import torch`` raises ImportError
try:
    from tensorboardX.crc32c import crc32c
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.proto.summary_pb2 import Summary
    from tensorboardX.summary import text
finally:
    if _HIDE_TORCH:
        del sys.modules["torch"]

PROTOCOL_INDEX = {name: i for i, name in enumerate(PROTOCOLS)}
WORKER_TAGS = 64
"""Workers below this index get a step-time tag."""
UPDATE_SCALARS = (("train/loss", "train_loss"), ("train/learning_rate", "lr"),
                  ("train/staleness_mean", "staleness_mean"), ("train/samples", "samples"))
"""(tag, ps.csv column) of the scalars every update gets, besides its protocol's index."""


def _masked_crc(data: bytes) -> bytes:
    """TFRecord's masked CRC-32C of ``data``, as 4 little-endian bytes."""
    x = crc32c(data) & 0xFFFFFFFF
    return struct.pack("<I", (((x >> 15) | (x << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


class EventFile:
    """An event file in TFRecord framing (length, its CRC, the ``Event``, its CRC), as TensorBoard reads it.

    Not thread-safe: the recorder's flusher is its only user. ``flush`` hands the bytes to the OS; it does
    not fsync (a crash may lose the last flush's scalars, which ``ps.csv`` also holds)."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}"
        self._file = (directory / name).open("wb")
        self.write(Event(wall_time=time.time(), file_version="brain.Event:2"))

    def write(self, event: Event) -> None:
        data = event.SerializeToString()
        header = struct.pack("<Q", len(data))
        self._file.write(b"".join((header, _masked_crc(header), data, _masked_crc(data))))

    def summary(self, values: list[Summary.Value], step: int, wall_time: float) -> None:
        self.write(Event(wall_time=wall_time, step=step, summary=Summary(value=values)))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


SHARD_SCALARS = (("shard/bytes_in_mb", "bytes_in", 1e-6), ("shard/bytes_out_mb", "bytes_out", 1e-6),
                 ("shard/mean_apply_ms", "mean_apply_ms", 1.0), ("shard/parts_waiting", "parts_waiting", 1.0),
                 ("shard/replies_held", "replies_held", 1.0))
"""(tag, field of a follower's record, scale) of a follower shard's scalars."""


def shard_scalars(record: dict) -> list[Summary.Value]:
    """A follower shard's figures (its ``shard-K.json`` record), as scalars for its own event file
    (``tensorboard/shard-K/``: TensorBoard shows every shard side by side)."""
    return [Summary.Value(tag=tag, simple_value=float(record[key]) * scale) for tag, key, scale in SHARD_SCALARS
            if record[key] is not None]


class TensorBoard:
    """Turns the recorder's rows into scalars; called only by the recorder's flusher, under its lock."""

    def __init__(self, run_dir: Path) -> None:
        self.file = EventFile(run_dir / "tensorboard")
        self.protocol: str | None = None
        self.last: tuple[float, float] | None = None  # (time_s, samples) at the previous flush
        self.samples = 0.0
        self._t0: float | None = None
        self._latest: dict[str, float] = {}  # per kind of event, the latest wall time given

    def _wall(self, time_s: float | str, kind: str) -> float:
        """An event's wall time: when its record's ``time_s`` (seconds since training started, virtual in a
        simulation) fell, anchored at the first record written, and after the previous event of its ``kind``
        (records of one time are a microsecond apart). Importers that keep a tag's points only while its
        wall time grows (Aim) then keep every one, not one per flush."""
        t = float(time_s)
        if self._t0 is None:
            self._t0 = time.time() - t
        wall = max(self._t0 + t, self._latest.get(kind, -math.inf) + 1e-6)
        self._latest[kind] = wall
        return wall

    def updates(self, rows: list[dict[str, str]]) -> None:
        """One event per update with its scalars (and a text entry when the protocol changes)."""
        for r in rows:
            v, now = int(r["version"]), self._wall(r["time_s"], "update")
            values = [Summary.Value(tag=tag, simple_value=float(r[key])) for tag, key in UPDATE_SCALARS
                      if r[key] != ""]
            values.append(Summary.Value(tag="train/protocol_index",
                                        simple_value=PROTOCOL_INDEX.get(r["protocol"], -1)))
            self.file.summary(values, v, now)
            if r["protocol"] != self.protocol:
                self.protocol = r["protocol"]
                self.file.write(Event(wall_time=now, step=v,
                                      summary=text("protocol", f"{r['protocol']} from version {v}")))
            self.samples += float(r["samples"])
        if rows:
            t = float(rows[-1]["time_s"])
            if self.last is not None and t > self.last[0]:
                rate = (self.samples - self.last[1]) / (t - self.last[0])
                self.file.summary([Summary.Value(tag="train/samples_per_s", simple_value=rate)],
                                  int(rows[-1]["version"]), self._wall(t, "rate"))
            self.last = (t, self.samples)

    def steps(self, rows: list[tuple], columns: tuple[str, ...]) -> None:
        """Each worker step's time, from ``rows`` of ``columns`` (workers.csv's): one event per step number
        holding every worker's scalar for it, so a BSP round's N steps are one event, not N (events
        dominated a 1,024-worker simulation's cost); and the inner and outer losses of pushes of local steps,
        one event per version they started from (the module docstring)."""
        at, worker, step, compute, sleep, base, losses = (columns.index(c) for c in (
            "time_s", "worker", "step", "compute_s", "sleep_s", "base_version", "local_losses"))
        by_step: dict[int, list[Summary.Value]] = defaultdict(list)
        by_version: dict[int, list[list[float]]] = defaultdict(list)
        step_at: dict[int, float] = {}  # each step number's latest record's time_s
        version_at: dict[int, float] = {}  # each base version's
        for r in rows:
            if r[losses]:
                by_version[int(r[base])].append([float(x) for x in r[losses].split()])
                version_at[int(r[base])] = float(r[at])
            if int(r[worker]) >= WORKER_TAGS:
                continue
            by_step[int(r[step])].append(Summary.Value(tag=f"workers/step_s/{r[worker]}",
                                                       simple_value=float(r[compute]) + float(r[sleep])))
            step_at[int(r[step])] = float(r[at])
        for n, values in by_step.items():
            self.file.summary(values, n, self._wall(step_at[n], "step"))
        for v, pushes in by_version.items():
            inner, outer = (sum(xs) / len(xs) for xs in ([sum(p) / len(p) for p in pushes], [p[0] for p in pushes]))
            self.file.summary([Summary.Value(tag="train/inner_loss", simple_value=inner),
                               Summary.Value(tag="train/outer_loss", simple_value=outer)], v,
                              self._wall(version_at[v], "local"))

    def evaluations(self, rows: list[tuple]) -> None:
        for at, version, loss, acc in rows:
            values = [Summary.Value(tag=tag, simple_value=float(x))
                      for tag, x in (("eval/test_accuracy", acc), ("eval/test_loss", loss)) if x != ""]
            if values:
                self.file.summary(values, int(version), self._wall(at, "eval"))

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.file.close()
