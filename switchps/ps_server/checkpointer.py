"""Taking checkpoints of a running PS without stalling it, and continuing a PS from one.

A checkpoint holds everything a PS needs to go on as if it had paused: the model's values (trainable
and non-trainable), the optimizer's state (slots, iterations, learning-rate scale, momentum in force),
the core's state (version, samples, protocol in force and its round in flight, controller and policy
state, batches, exclusions, SSP clocks, the receipts of pushes received), where each record file
stands, the latest evaluation, and the run config it was made with (which a resume compares).

Concurrency: ``take`` runs on the event loop, between events, so the core's state it reads is that of
exactly ``core.version``. The values and optimizer state are copied on the applier thread, queued
behind the updates up to that version and ahead of any later one (the only time the apply path is
held: one copy of the model). One writer thread serializes and writes the file (``checkpoint``), so
neither the loop nor the applier waits for the disk. At most one checkpoint is in flight; one falling
due meanwhile is deferred to the next event after the write (counted), so a crash loses at most
``every_updates`` updates plus those applied while one checkpoint was being written.
"""

from __future__ import annotations

import logging
import queue
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np

from switchps.config import CheckpointSpec
from switchps.protos import switchps_pb2 as pb
from switchps.ps_server import checkpoint
from switchps.ps_server.model import ModelStore
from switchps.ps_server.optimizers import Optimizer
from switchps.ps_server.records import RunRecorder

log = logging.getLogger("switchps.ps")


class CoreState(Protocol):
    """The core as a checkpoint sees it: its version and its state as plain data."""

    @property
    def version(self) -> int: ...

    def state_dict(self, now: float) -> dict[str, Any]: ...

    def load_state_dict(self, d: dict[str, Any], now: float) -> None: ...

    def restarted(self, now: float) -> None: ...


class Checkpointed(Protocol):
    """What a checkpoint saves of a PS and restores into one: the core's state, the record's position,
    the model store, the layout and the latest evaluation. The service (``ParameterServer``) is one; the
    checkpointer never sees the rest of it, so it can neither call back into the service nor import it."""

    last_eval: pb.EvalReport | None
    layout: pb.Layout | None

    @property
    def core(self) -> CoreState: ...

    @property
    def rec(self) -> RunRecorder: ...

    @property
    def store(self) -> ModelStore: ...


@dataclass
class CheckpointStats:
    written: int = 0
    deferred: int = 0
    """Due while another was being written: taken at a later event instead."""
    failed: int = 0
    held_s: list[float] = field(default_factory=list)
    """Per checkpoint: how long the applier was held copying the model."""
    write_s: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        def stat(f: Callable[[list[float]], float], xs: list[float]) -> float | None:
            return round(f(xs), 4) if xs else None
        return {"written": self.written, "deferred": self.deferred, "failed": self.failed,
                "median_held_s": stat(statistics.median, self.held_s), "max_held_s": stat(max, self.held_s),
                "median_write_s": stat(statistics.median, self.write_s), "max_write_s": stat(max, self.write_s)}


class Checkpointer:
    """Takes a checkpoint when ``spec`` says one is due; see the module docstring for the threads."""

    def __init__(self, directory: Path, spec: CheckpointSpec, now: float, config: dict[str, Any]) -> None:
        """``config``: the run config as plain data, saved in each checkpoint so that a resume can refuse
        a config that changes what the checkpoint was made with (``switchps.resume_rules``)."""
        self.directory, self.spec, self.config = directory, spec, config
        self.stats = CheckpointStats()
        self.last_at, self.last_version = now, -1
        self._in_flight = False  # guarded by ``_idle``: set by ``take``, cleared by the writer
        self._buffers: dict[str, np.ndarray] = {}  # the applier writes them, then the writer reads them
        self._jobs: queue.SimpleQueue[tuple[int, dict[str, Any], Callable[[], None]] | None] = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._writer = threading.Thread(target=self._write_loop, name="switchps-checkpoint", daemon=True)
        self._writer.start()

    def due(self, version: int, now: float) -> bool:
        s = self.spec
        if self.last_version < 0:  # the first as soon as training starts: a crash never finds none
            return True
        if version <= self.last_version:
            return False
        return bool((s.every_updates and version - max(self.last_version, 0) >= s.every_updates)
                    or (s.every_s and now - self.last_at >= s.every_s))

    def take(self, ps: Checkpointed, now: float) -> None:
        """Snapshot ``ps`` at its core's version; the file is written in the background."""
        version = ps.core.version
        with self._idle:
            if self._in_flight:
                self.stats.deferred += 1
                return
            self._in_flight = True
        self.last_at, self.last_version = now, version
        last = ps.last_eval
        state: dict[str, Any] = {
            "core": ps.core.state_dict(now), "records": ps.rec.position(),
            "layout": np.frombuffer(ps.store.layout.SerializeToString(), np.uint8),
            "last_eval": None if last is None else [last.version, last.test_loss, last.test_accuracy],
            "saved_at": time.time(), "config": self.config,
        }

        def capture(opt: Optimizer) -> None:  # on the applier: every update up to ``version`` is applied
            t0 = time.perf_counter()
            state["values"] = self._copy("values", ps.store.values)
            state["optimizer"] = {k: self._copy(k, v) if isinstance(v, np.ndarray) else v
                                  for k, v in opt.state_dict(copy=False).items()}
            state["sums"] = ps.store.sums.state_dict()  # the open aggregates' sums the core's state names
            self.stats.held_s.append(time.perf_counter() - t0)
            state["records"]["rows"]["ps"] = ps.rec.ps_rows()
            self._jobs.put((version, state, ps.rec.flush))

        ps.store.control(capture)

    def _copy(self, key: str, a: np.ndarray) -> np.ndarray:
        """``a`` copied into this checkpointer's buffer for ``key``: one warm buffer per array, reused by
        every checkpoint (at most one is in flight), so the copy never page-faults fresh memory."""
        buf = self._buffers.get(key)
        if buf is None or buf.shape != a.shape or buf.dtype != a.dtype:
            buf = self._buffers[key] = np.empty_like(a)
        np.copyto(buf, a)
        return buf

    def wait(self, timeout: float | None = None) -> bool:
        """Block until no checkpoint is in flight."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._in_flight, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Finish the checkpoint in flight, then stop the writer."""
        self.wait(timeout)
        self._jobs.put(None)
        self._writer.join(timeout)

    def _write_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            version, state, flush_records = job
            t0 = time.perf_counter()
            try:
                flush_records()  # the rows the checkpoint counts are in the files before it can be read
                path = checkpoint.write(self.directory, version, state)
                checkpoint.prune(self.directory, self.spec.keep)
                self.stats.written += 1
                self.stats.write_s.append(time.perf_counter() - t0)
                log.debug("checkpoint %s written in %.3fs", path.name, self.stats.write_s[-1])
            except OSError as e:  # a full disk must not stop training; the previous checkpoint stands
                self.stats.failed += 1
                log.error("checkpoint of version %d failed: %s", version, e)
            with self._idle:
                self._in_flight = False
                self._idle.notify_all()


def restore(ps: Checkpointed, ckpt: checkpoint.Checkpoint, now: float) -> None:
    """Continue ``ps`` (freshly built, not yet serving) from ``ckpt``."""
    s = ckpt.state
    layout = pb.Layout.FromString(s["layout"].tobytes())
    ps.store.restore(layout, s["values"], s["optimizer"], ckpt.version)
    ps.store.sums.load_state_dict(s["sums"])
    ps.core.load_state_dict(s["core"], now)
    ps.core.restarted(now)
    ps.layout = layout
    if s["last_eval"] is not None:
        v, loss, acc = s["last_eval"]
        ps.last_eval = pb.EvalReport(version=v, test_loss=loss, test_accuracy=acc)
