"""Taking checkpoints of a running PS without stalling it, and continuing a PS from one.

A checkpoint holds everything a PS needs to go on as if it had paused: the model's values (trainable
and non-trainable), the optimizers' states (the run's: slots, iterations, learning-rate scale, momentum in force;
each outer optimizer of local steps', which an older checkpoint lacks: none made yet),
the core's state (version, samples, protocol in force and its round in flight, controller and policy
state, batches, exclusions, SSP clocks, the receipts of pushes received), where each record file
stands, the latest evaluation, and the run config it was made with (which a resume compares).

Every driver's checkpoint state is composed and restored here, from the ``Parts`` it has (the core, and
any of the sums, the record, the model and what its clients told it): ``compose`` and ``restore`` for a
driver without threads (the test harness, a simulator), ``Checkpointer`` for the gRPC driver.

Concurrency: ``take`` runs on the event loop, between events, so the core's state it reads is that of
exactly ``core.version``. The values and optimizer state are copied by the store's writer (the applier
thread; a small model's, the loop: ``store.py``), queued behind the updates up to that version and ahead
of any later one (the only time the apply path is held: one copy of the model). One writer thread
serializes and writes the file (``checkpoint``), so neither the loop nor the applier waits for the disk.
At most one checkpoint is in flight; one falling due meanwhile is deferred to the next event after the
write (counted), so a crash loses at most ``every_updates`` updates plus those applied while one
checkpoint was being written.
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

from switchps.config.run import CheckpointSpec
from switchps.protos import switchps_pb2 as pb
from switchps.ps_server import checkpoint
from switchps.optim.optimizers import Optimizer
from switchps.ps_server.outer import OuterOptimizers
from switchps.ps_server.sums import Sums

log = logging.getLogger("switchps.ps")
MANIFEST_WAIT_S = 120.0
"""How long shard 0's checkpoint waits for the followers' parts; without them it is not written."""


class CoreState(Protocol):
    """The core as a checkpoint sees it: its version and its state as plain data."""

    @property
    def version(self) -> int: ...

    def state_dict(self, now: float) -> dict[str, Any]: ...

    def load_state_dict(self, d: dict[str, Any], now: float) -> None: ...

    def restarted(self, now: float) -> None: ...


class Record(Protocol):
    """The run record (``RunRecorder``) as a checkpoint sees it: where it stands, and a flush."""

    def position(self) -> dict[str, Any]: ...

    def ps_rows(self) -> int: ...

    def flush(self) -> None: ...


class Model(Protocol):
    """The model (``ModelStore``): values, optimizer and layout, written where ``control`` runs its function."""

    @property
    def layout(self) -> pb.Layout: ...

    @property
    def values(self) -> np.ndarray: ...

    @property
    def optimizer(self) -> Optimizer: ...

    @property
    def outer(self) -> OuterOptimizers: ...

    def control(self, change: Callable[[Optimizer], None]) -> None: ...

    def restore(self, layout: pb.Layout, values: np.ndarray, optimizer_state: dict, version: int,
                outer_state: dict | None = None) -> None: ...


class Followers(Protocol):
    """A sharded PS's other shards (``shards.Leader``): each saves its part where shard 0 takes its
    checkpoint, and shard 0's file lists their digests (its manifest, the commit point)."""

    def checkpoint(self, version: int) -> None: ...

    def manifest(self, version: int, timeout_s: float) -> dict[str, str]: ...


class Clients(Protocol):
    """What the gRPC driver learnt from its clients: the layout they registered, their latest evaluation."""

    layout: pb.Layout | None
    last_eval: pb.EvalReport | None


@dataclass(frozen=True)
class Parts:
    """What a checkpoint saves of a driver and restores into one: the core, and those of the other parts
    the driver has. The gRPC driver has them all; the test harness has the sums (and a record if it keeps
    one); a simulator gives what it has. Nothing here can call back into a driver or import one."""

    core: CoreState
    sums: Sums | None = None
    """The open aggregates' sums, which the core's state names; written by the model's applier if any."""
    record: Record | None = None
    model: Model | None = None
    clients: Clients | None = None
    followers: Followers | None = None


Copy = Callable[[str, np.ndarray], np.ndarray]
"""Copies an array under a name (the checkpointer's reused buffers)."""


def between_events(parts: Parts, now: float) -> dict[str, Any]:
    """The state read between two events of the driver: the core's at its version, the record's position,
    the layout and the latest evaluation."""
    state: dict[str, Any] = {"core": parts.core.state_dict(now)}
    if parts.record is not None:
        state["records"] = parts.record.position()
    if parts.model is not None:
        state["layout"] = np.frombuffer(parts.model.layout.SerializeToString(), np.uint8)
    if parts.clients is not None:
        last = parts.clients.last_eval
        state["last_eval"] = None if last is None else [last.version, last.test_loss, last.test_accuracy]
    return state


def where_applied(parts: Parts, state: dict[str, Any], copy: Copy = lambda _, a: a.copy()) -> None:
    """Add to ``state`` what the model's writer holds, read where every update up to the core's version is
    applied (on the gRPC driver's applier): values, optimizer state, open sums, and the ``ps.csv`` rows."""
    if parts.model is not None:
        state["values"] = copy("values", parts.model.values)
        state["optimizer"] = _copied(parts.model.optimizer.state_dict(copy=False), copy)
        state["outer"] = {spec: _copied(d, copy, f"{spec}/")  # each local-steps outer optimizer's
                          for spec, d in parts.model.outer.state_dict(copy=False).items()}
    if parts.sums is not None:
        state["sums"] = parts.sums.state_dict()
    if parts.record is not None:
        state["records"]["rows"]["ps"] = parts.record.ps_rows()


def _copied(optimizer_state: dict, copy: Copy, prefix: str = "") -> dict:
    """An optimizer's ``state_dict(copy=False)`` with its arrays copied (under ``prefix`` + their names)."""
    return {k: copy(prefix + k, v) if isinstance(v, np.ndarray) else v for k, v in optimizer_state.items()}


def compose(parts: Parts, now: float) -> dict[str, Any]:
    """The whole state at once, for a driver whose model nothing else is writing (no applier thread)."""
    state = between_events(parts, now)
    where_applied(parts, state)
    return state


def restore(parts: Parts, state: dict[str, Any], version: int, now: float, crash: bool = True) -> None:
    """Continue ``parts`` (freshly built, not yet driven) from the checkpoint ``state`` of ``version``; after a
    ``crash``, the core relaxes what it made uncertain (``restarted``). A record continues from
    ``record_position(state)``, which it is built with."""
    if parts.model is not None:
        layout = pb.Layout.FromString(state["layout"].tobytes())
        parts.model.restore(layout, state["values"], state["optimizer"], version, state.get("outer"))
        if parts.clients is not None:
            parts.clients.layout = layout
    if parts.sums is not None:
        parts.sums.load_state_dict(state["sums"])
    parts.core.load_state_dict(state["core"], now)
    if crash:
        parts.core.restarted(now)
    if parts.clients is not None and state["last_eval"] is not None:
        v, loss, acc = state["last_eval"]
        parts.clients.last_eval = pb.EvalReport(version=v, test_loss=loss, test_accuracy=acc)


def record_position(state: dict[str, Any]) -> dict[str, Any] | None:
    """Where the record stood in the checkpoint ``state`` (``RunRecorder``'s ``resume``)."""
    return state.get("records")


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

    def __init__(self, directory: Path, spec: CheckpointSpec, now: float, config: dict[str, Any],
                 parts: Parts) -> None:
        """``config``: the run config as plain data, saved in each checkpoint so that a resume can refuse
        a config that changes what the checkpoint was made with (``switchps.ps_server.resume_rules``). ``parts``:
        what each checkpoint saves."""
        self.directory, self.spec, self.config, self.parts = directory, spec, config, parts
        self.stats = CheckpointStats()
        self.last_at, self.last_version = now, -1
        self._in_flight = False  # guarded by ``_idle``: set by ``take``, cleared by the writer
        self._buffers: dict[str, np.ndarray] = {}  # the applier writes them, then the writer reads them
        self._jobs: queue.SimpleQueue[tuple[int, dict[str, Any]] | None] = queue.SimpleQueue()
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

    def take(self, now: float) -> None:
        """Snapshot the parts at the core's version; the file is written in the background."""
        parts = self.parts
        version = parts.core.version
        with self._idle:
            if self._in_flight:
                self.stats.deferred += 1
                return
            self._in_flight = True
        self.last_at, self.last_version = now, version
        state = {**between_events(parts, now), "saved_at": time.time(), "config": self.config}
        if parts.followers is not None:
            parts.followers.checkpoint(version)

        def capture() -> None:  # every update up to ``version`` is applied, none after
            t0 = time.perf_counter()
            where_applied(parts, state, self._copy)
            self.stats.held_s.append(time.perf_counter() - t0)
            self._jobs.put((version, state))

        if parts.model is None:
            capture()
        else:
            parts.model.control(lambda _: capture())

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
            version, state = job
            t0 = time.perf_counter()
            try:
                if self.parts.record is not None:  # the rows it counts are in the files before it can be read
                    self.parts.record.flush()
                if self.parts.followers is not None:  # the commit point waits for every shard's part
                    state["shards"] = self.parts.followers.manifest(version, MANIFEST_WAIT_S)
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

