"""The data path, measured: the project files that a BSP push, an ASP push and a policy switch pass through
on the PS, traced on a loopback cluster, against the "Files touched" table of docs/ARCHITECTURE.md (the one
place they are written, with the definitions); and that no file is entered twice.

What counts is the PS side: from the gRPC handler receiving the push to the update applied, recorded and
replied. The client's files (``worker/client.py``, the worker's use of ``protos/codec.py``) do not: they
run on the test's threads and gRPC's, which are not recorded (the test's own thread, which runs only the
client, carries no profiler at all: no ``sys.setprofile``).

Isolation rule. A profiler (``threading.setprofile``, installed before the cluster starts, so the PS's
event-loop and applier threads carry it) records a call only while one operation's window is open, and
only if the outermost project frame on its thread's stack is
- the traced RPC's handler (``ParameterServer.push``/``push_small``) entered while the window is open:
  this leaves out other RPCs, the core's timer and other loop callbacks, and the held pushes the traced
  push releases (their replies are their own operations);
- the applier's loop (``ModelStore._apply_loop``): the window opens only once the applier is idle, so
  everything it runs while the window is open was queued by the traced push.
Nothing else (the recorder's flusher, gRPC's and the client's threads) is recorded. The window closes once
the client has the whole reply (so the handler has finished) and the applier is idle again. Each traced
push is a cluster's second update, so nothing first-time (a lazily made semaphore) is in it.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import numpy as np
import pytest

import switchps
from cluster import LiveCluster, start_cluster
from conftest import wait_until
from switchps.ps_server.store import ModelStore
from switchps.ps_server.rpc.service import ParameterServer

pytest_plugins = ["cluster"]

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "ARCHITECTURE.md"
PROJECT = os.path.realpath(Path(switchps.__file__).parent)
SIZE = 1_100_000  # 4.4 MB: over ModelStore.inline_bytes (4 MiB), so the applier thread runs the updates
HANDLERS = frozenset({ParameterServer.push.__code__, ParameterServer.push_small.__code__})
APPLIER = ModelStore._apply_loop.__code__
OPERATIONS = ("BSP push", "ASP push", "policy switch")


@dataclass
class Trace:
    """What one operation ran: project files (relative to ``switchps/``), re-entries as
    ``caller.py:function → callee.py:function``, and which roots (``handler``, ``applier``) ran any."""

    files: set[str] = field(default_factory=set)
    reentries: set[str] = field(default_factory=set)
    edges: set[str] = field(default_factory=set)  # every call from one file into another, written alike
    roots: set[str] = field(default_factory=set)


class Tracer:
    """A profile function for every thread started while installed; records into the open window's
    ``Trace`` by the rule in the module docstring."""

    def __init__(self) -> None:
        self.trace: Trace | None = None
        self.enabled = True
        self._before: set[FrameType] = set()  # handler frames entered while no window was open
        self._paths: dict[str, str | None] = {}

    def path(self, code: CodeType) -> str | None:
        """The project file of ``code`` relative to ``switchps/``, or None (not a project file)."""
        name = code.co_filename
        if name not in self._paths:
            real = os.path.realpath(name)
            self._paths[name] = os.path.relpath(real, PROJECT) if real.startswith(PROJECT + os.sep) else None
        return self._paths[name]

    def __call__(self, frame: FrameType, event: str, arg: object) -> None:
        if event != "call" or not self.enabled:
            return
        trace = self.trace
        if trace is None:
            if frame.f_code in HANDLERS:
                self._before.add(frame)
            return
        stack: list[tuple[FrameType, str]] = []  # project frames, innermost first
        f: FrameType | None = frame
        while f is not None:
            p = self.path(f.f_code)
            if p is not None:
                stack.append((f, p))
            f = f.f_back
        if not stack or stack[0][0] is not frame:
            return
        root = stack[-1][0]
        if root.f_code is APPLIER:
            trace.roots.add("applier")
        elif root.f_code in HANDLERS and root not in self._before:
            trace.roots.add("handler")
        else:
            return
        trace.files.add(stack[0][1])
        if len(stack) > 1 and stack[1][1] != stack[0][1]:
            edge = f"{_where(stack[1])} → {_where(stack[0])}"
            trace.edges.add(edge)
            if any(p == stack[0][1] for _, p in stack[2:]):
                trace.reentries.add(edge)

    @contextlib.contextmanager
    def window(self) -> Iterator[Trace]:
        trace = self.trace = Trace()
        try:
            yield trace
        finally:
            self.trace = None


def _where(entry: tuple[FrameType, str]) -> str:
    return f"{entry[1]}:{entry[0].f_code.co_qualname}"


def _grad() -> np.ndarray:
    return np.full(SIZE, 0.01, np.float32)


def _round(c: LiveCluster, tracer: Tracer | None = None) -> Trace | None:
    """One BSP round of two workers: worker 0's push is held, worker 1's completes the round (traced if
    ``tracer``)."""
    w0, w1 = c.workers
    accepted, version = c.rec.counts["accepted"], c.core.version
    held = w0.push_async(_grad(), 1)
    wait_until(lambda: c.rec.counts["accepted"] == accepted + 1, what="worker 0's push is held")
    assert c.store.wait_idle(10), "worker 0's join is applied"
    with tracer.window() if tracer else contextlib.nullcontext() as trace:
        w1.push(_grad(), 1)
        assert c.store.wait_idle(10)
    held.result()
    assert c.core.version == version + 1
    return trace


def trace_bsp(tmp: Path, tracer: Tracer) -> Trace:
    c = _start(tmp)
    try:
        _round(c)
        trace = _round(c, tracer)
        assert trace is not None and c.core.spec.name == "bsp"
        return trace
    finally:
        _stop(c)


def trace_asp(tmp: Path, tracer: Tracer) -> Trace:
    c = _start(tmp, protocol={"name": "asp"})
    try:
        w0 = c.workers[0]
        w0.push(_grad(), 1)
        assert c.store.wait_idle(10)
        with tracer.window() as trace:
            assert w0.push(_grad(), 1).reply.applied
            assert c.store.wait_idle(10)
        assert c.core.version == 2
        return trace
    finally:
        _stop(c)


def trace_switch(tmp: Path, tracer: Tracer) -> Trace:
    """The offline schedule switches BSP to ASP after half of 4 steps: the push completing round 2."""
    c = _start(tmp, train={"steps": 4},
               policy={"name": "schedule", "kwargs": {"phases": [{"bsp": 0.5}, {"asp": 0.5}]}})
    try:
        _round(c)
        assert c.core.spec.name == "bsp"
        trace = _round(c, tracer)
        assert trace is not None and c.core.spec.name == "asp" and len(c.core.switching.switches) == 1
        return trace
    finally:
        _stop(c)


def _start(tmp: Path, **kw: Any) -> LiveCluster:
    """Two workers; the first checkpoint is taken at the start, the next not within the test."""
    tmp.mkdir(parents=True)
    return start_cluster(tmp, workers=2, size=SIZE, checkpoint={"every_s": 86_400.0}, **kw)


def _stop(c: LiveCluster) -> None:
    for w in c.workers:
        w.client.close()
    c.server.stop(grace=None)


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Trace]:
    """Each operation traced once, on a cluster of its own started while the profiler is installed."""
    tracer, previous = Tracer(), threading.getprofile()
    runs: dict[str, Callable[[Path, Tracer], Trace]] = {
        "BSP push": trace_bsp, "ASP push": trace_asp, "policy switch": trace_switch}
    threading.setprofile(tracer)
    try:
        return {op: run(tmp_path_factory.mktemp("data_path") / op.replace(" ", "_"), tracer)
                for op, run in runs.items()}
    finally:
        threading.setprofile(previous)
        tracer.enabled = False  # the cluster's idle threads keep the hook; it does nothing now
        tracer._before.clear()


@dataclass
class Row:
    count: int
    files: set[str]
    reentered: set[str]


def read_table() -> dict[str, Row]:
    """The "Files touched" table: operation → the count it states, its files, its re-entries."""
    section = DOC.read_text().split("\n## Files touched\n", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()
            if line.startswith("|")][2:]  # past the header and its rule
    return {op: Row(int(count), set(re.findall(r"`([^`]+)`", files)), set(re.findall(r"`([^`]+)`", again)))
            for op, count, files, again in rows}


def _report(measured: dict[str, Trace]) -> str:
    """The measured table rows (to paste into the doc), then each operation's calls between files."""
    rows = []
    for op in OPERATIONS:
        t = measured[op]
        files = ", ".join(f"`{f}`" for f in sorted(t.files))
        again = ", ".join(f"`{e}`" for e in sorted(t.reentries)) or "none"
        rows.append(f"| {op} | {len(t.files)} | {files} | {again} |")
    calls = [f"{op}:\n" + "\n".join(f"  {e}" for e in sorted(measured[op].edges)) for op in OPERATIONS]
    return "measured (the rows for the doc):\n" + "\n".join(rows) + "\n\ncalls between files:\n" + "\n".join(calls)


def test_the_doc_table_is_the_measured_one(measured: dict[str, Trace]) -> None:
    table = read_table()
    assert sorted(table) == sorted(OPERATIONS), f"one row per operation\n{_report(measured)}"
    for op in OPERATIONS:
        t, row = measured[op], table[op]
        assert t.roots == {"handler", "applier"}, f"{op}: the trace saw its handler and the applier"
        assert row.count == len(row.files), f"{op}: the table's count is its list's length"
        assert (t.files, t.reentries) == (row.files, row.reentered), f"{op}\n{_report(measured)}"


def test_no_file_is_entered_twice(measured: dict[str, Trace]) -> None:
    found = [f"{op}: {edge}" for op in OPERATIONS for edge in sorted(measured[op].reentries)]
    assert not found, "calls back into a file already on the thread's stack (caller → callee):\n" + "\n".join(found)

