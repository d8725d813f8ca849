"""runtime.pipeline_depth: a worker computes step k+1 while push k is in flight.

The PS's side is logic on the core (which orders say ``pipeline``, live, and what a round takes under
``runtime.pipeline_sync``); the worker's is real runs on loopback, whose records must show the extra
staleness exactly where overlap is allowed and none where it is not."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import FakeClock
from harness import Harness
from switchps.config.run import Pipeline, RunConfig
from switchps.protos import switchps_pb2 as pb
from switchps.ps_server.core.events import StepReport
from switchps.worker.client import Reply
from switchps.worker.main import Worker
from test_launch import rows, run

OVERLAPPED = StepReport(overlapped=True)


@pytest.mark.parametrize("pipeline, asp, bsp", [(Pipeline(0), False, False), (Pipeline(1), True, False),
                                               (Pipeline(1, sync=True), True, True)])
def test_orders_say_pipeline_for_the_protocol_in_force_across_a_live_switch(pipeline, asp, bsp):
    h = Harness(workers=2, protocol={"name": "asp", "batch": 1})
    h.core.pipeline = pipeline
    first = h.push(0, 1.0)
    assert h.releases[first].order.pipeline is asp and h.core.work_order(1).pipeline is asp
    h.switch(name="bsp")
    assert h.core.spec.name == "bsp" and h.core.work_order(0).pipeline is bsp
    a, b = h.push(0, 1.0), h.push(1, 1.0, base=0)  # the first round: what was in flight joins it
    assert h.releases[a].order.pipeline is h.releases[b].order.pipeline is bsp
    h.check_books()


@pytest.mark.parametrize("sync", [False, True])
def test_a_round_takes_an_overlapped_push_one_version_old_only_with_pipeline_sync(sync):
    h = Harness(workers=2, protocol={"batch": 1})
    h.core.pipeline = Pipeline(1, sync)
    h.push(0, 1.0), h.push(1, 1.0)
    assert h.core.version == 1
    late = h.push(0, 2.0, base=0, report=OVERLAPPED)  # computed on v0 while its v0 push was in flight
    if not sync:
        assert h.counts["dropped:late"] == 1 and not h.releases[late].outcome.applied, "BSP stays exact"
        return
    assert not h.released(late), "it waits in the round"
    h.push(1, 4.0, base=0, report=OVERLAPPED)
    assert h.core.version == 2 and h.counts["dropped"] == 0
    assert [m.staleness for m in h.applied[-1].aggregate.members] == [1, 1], "recorded as stale as it is"
    h.push(0, 1.0, base=0, report=OVERLAPPED)  # two versions old: more than the pipeline explains
    h.push(1, 1.0, base=1)  # one version old but not overlapped
    assert h.counts["dropped:late"] == 2
    h.check_books()


@dataclass
class Flight:
    grad: np.ndarray
    into: np.ndarray
    base_version: int
    overlapped: bool


@dataclass
class FakeSession:
    """A PS on a fake clock that replies through a shared segment: each reply's values are its version in
    every element, written into ``segment`` (as the PS writes a segment's values area); ``sync_from``: the
    version from which orders say a round protocol is in force (no ``pipeline``)."""

    clock: FakeClock
    stop_at: int
    sync_from: int
    segment: np.ndarray = field(default_factory=lambda: np.full(3, -1.0, np.float32))
    order: pb.WorkOrder = field(default_factory=lambda: pb.WorkOrder(protocol="asp", sample_budget=2,
                                                                     micro_batch=2, pipeline=True))
    received_at: float = 100.0
    step: int = 0
    payload_area: np.ndarray = field(default_factory=lambda: np.zeros(3, np.float32))
    """The segment's gradient area."""
    flight: Flight | None = None
    pushed: list[Flight] = field(default_factory=list)
    computer: Any = None
    """Checked at each send: a copy to the device from the segment must be done before its next reply."""

    def send(self, grad: np.ndarray, samples: int, params: np.ndarray, *, base_version: int, **stats: Any) -> None:
        assert self.flight is None, "one push in flight at most"
        assert getattr(self.computer, "uploading", None) is not self.segment, "a reply rewrites an upload's source"
        self.flight = Flight(grad, params, base_version, stats["overlapped"])
        self.pushed.append(Flight(grad.copy(), params, base_version, stats["overlapped"]))

    def receive(self, since: float) -> Reply:
        assert self.flight is not None
        self.flight = None
        return self._reply()

    def push(self, grad: np.ndarray, samples: int, params: np.ndarray, *, base_version: int | None = None,
             **stats: Any) -> Reply:
        version = self.order.version if base_version is None else base_version
        self.send(grad, samples, params, base_version=version, **stats)
        return self.receive(self.clock.now())

    def _reply(self) -> Reply:
        version = self.order.version + 1
        self.segment[:] = version
        self.order = pb.WorkOrder(protocol="asp", version=version, sample_budget=2, micro_batch=2,
                                  stop=version >= self.stop_at, pipeline=version < self.sync_from)
        self.step += 1
        return Reply(pb.PushReply(order=self.order, nbytes=self.segment.nbytes), True, self.segment)


@dataclass
class FakeComputer:
    """Computes on the staged values (or the assigned ones: version 0): its payload is their version, written
    into ``payload_to``; checks at each step that nothing in flight is written or read by it. ``copies``: a
    GPU's, which copies staged values to the device (``uploading`` until ``settle``) and runs at that copy."""

    ps: FakeSession
    copies: bool = False
    samples: int = 100
    size: int = 3
    payload_to: np.ndarray | None = None
    staged: np.ndarray | None = None
    uploading: np.ndarray | None = None
    on_device: np.ndarray | None = None
    staged_from: list[np.ndarray] = field(default_factory=list)

    def buffer(self) -> np.ndarray:
        return np.zeros(self.size, np.float32)

    def stage(self, flat: np.ndarray) -> None:
        self.staged_from.append(flat)
        if self.copies:
            self.uploading = flat
            return
        if self.ps.order.pipeline:  # read in place while the next push is in flight
            assert flat is not self.ps.segment, "values staged where the next reply writes"
        self.staged = flat

    def settle(self) -> bool:
        if self.copies and self.uploading is not None:
            self.on_device, self.uploading = self.uploading.copy(), None
        return self.copies

    def close(self) -> None:
        pass

    def compute(self, rows: np.ndarray, micro_batch: int) -> tuple[np.ndarray, float]:
        flight = self.ps.flight
        self.settle() if self.copies else None  # the compute stream waits for the upload
        values = self.on_device if self.copies else self.staged
        values = values if values is not None else np.zeros(self.size, np.float32)
        if flight is not None:
            assert self.payload_to is not flight.grad, "the step writes the payload in flight"
            assert self.payload_to is not self.ps.payload_area, "the step writes the segment in flight"
            assert values is not flight.into and values is not self.ps.segment, "it reads what a reply writes"
        out = self.payload_to if self.payload_to is not None else np.empty(self.size, np.float32)
        out[:] = values
        return out, 0.0


@pytest.mark.parametrize("copies", [False, True], ids=["in_place", "gpu"])
@pytest.mark.parametrize("sync_from", [100, 3])
def test_an_overlapped_step_writes_and_reads_nothing_in_flight_and_pushes_its_values_version(sync_from, copies):
    clock = FakeClock()
    ps = FakeSession(clock, stop_at=6, sync_from=sync_from)
    gc = FakeComputer(ps, copies)
    ps.computer = gc
    worker = Worker(RunConfig(), 0, gc, ps, gc.buffer())
    while not ps.order.stop:
        worker.overlapped() if ps.order.pipeline else worker.step()
    versions = [int(p.grad[0]) for p in ps.pushed]
    assert [p.base_version for p in ps.pushed] == versions, "each push says the version it was computed on"
    if sync_from == 100:  # overlapping throughout: step k+1 runs on the values before reply k
        assert versions == [0, 0, 1, 2, 3, 4] and [p.overlapped for p in ps.pushed] == [False] + [True] * 5
    else:  # orders without pipeline from v3: the step computed meanwhile is pushed, then push and wait
        assert versions == [0, 0, 1, 2, 4, 5] and [p.overlapped for p in ps.pushed] == [False, True, True, True,
                                                                                     False, False]
    if copies:  # a GPU is staged straight from the segment, no host copy of the values
        assert all(flat is ps.segment for flat in gc.staged_from)


def _run(tmp_path: Path, protocol: dict[str, Any], runtime: dict[str, Any], workers: int = 1,
         steps: int = 20, **sections: Any) -> tuple[dict[str, Any], list[dict], list[dict]]:
    """A small torch logreg run on digits (``sections``: more of its config), evaluated only at its end
    (``eval.every_s`` an hour): its summary, ps.csv and workers.csv rows."""
    raw = {"name": "pipe", "cluster": {"workers": workers}, "model": {"name": "logreg", "framework": "torch"},
           "data": {"name": "digits"}, "optimizer": {"name": "sgd", "learning_rate": 0.05},
           "protocol": {"batch": 16, **protocol}, "train": {"steps": steps}, "eval": {"every_s": 3600.0},
           "runtime": runtime, **sections}
    tmp_path.mkdir(exist_ok=True)
    cfg = tmp_path / "pipe.yaml"
    cfg.write_text(json.dumps(raw))
    proc, run_dir = run(tmp_path, str(cfg), timeout=240)
    assert proc.returncode == 0 and run_dir is not None, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_eval_reported"], "the evaluator scores the last version once training ends, however long eval.every_s"
    return summary, rows(run_dir / "ps.csv"), rows(run_dir / "workers.csv")


def _members(update: dict[str, str]) -> int:
    """How many pushes an update of ps.csv took."""
    return len(update["workers"].split(";"))


@pytest.mark.integration
@pytest.mark.parametrize("depth, shared_memory, wire", [(0, True, "float32"), (1, True, "float32"),
                                                      (1, False, "float32"), (1, True, "bfloat16")])
def test_asp_with_pipeline_depth_1_pushes_gradients_of_the_values_before_the_last_reply(tmp_path, depth,
                                                                                        shared_memory, wire):
    steps = 20
    summary, ps, workers = _run(tmp_path, {"name": "asp"}, {"pipeline_depth": depth, "shared_memory": shared_memory,
                                                            "wire_dtype": wire}, steps=steps)
    staleness = [int(r["staleness_max"]) for r in ps]
    bases = [int(r["base_version"]) for r in workers]
    assert summary["pipeline_depth"] == depth and summary["pushes_accepted"] == summary["updates"] == steps
    if depth == 0:
        assert staleness == [0] * steps and bases == list(range(steps)) and summary["overlapped_steps"] == 0
        return
    # one worker: step k+1 is computed on the values before reply k, so each push after the first is one
    # version stale, and says so in its header (what workers.csv records)
    assert staleness == [0] + [1] * (steps - 1), "the extra staleness is recorded"
    assert bases == [0, 0, *range(1, steps - 1)]
    assert summary["overlapped_steps"] == steps - 1
    assert all(float(r["compute_s"]) > 0 and float(r["send_s"]) >= 0 for r in workers)


@pytest.mark.integration
def test_bsp_does_not_overlap_without_pipeline_sync_and_does_with_it(tmp_path):
    exact, ps, _ = _run(tmp_path / "exact", {"name": "bsp"}, {"pipeline_depth": 1}, workers=2, steps=8)
    assert exact["overlapped_steps"] == 0 and exact["pushes_dropped"] == 0
    assert all(r["staleness_max"] == "0" and _members(r) == 2 for r in ps), "BSP exactly as at depth 0"
    delayed, ps, _ = _run(tmp_path / "delayed", {"name": "bsp"}, {"pipeline_depth": 1, "pipeline_sync": True},
                          workers=2, steps=8)
    assert delayed["overlapped_steps"] > 0 and delayed["pushes_dropped"] == 0
    assert [r["staleness_max"] for r in ps] == ["0"] + ["1"] * 7, "one-step-delayed updates"
    assert all(_members(r) == 2 for r in ps), "each round still takes every worker"


@pytest.mark.integration
def test_a_live_switch_from_asp_to_bsp_stops_the_overlap_and_keeps_bsp_exact(tmp_path):
    policy = {"name": "schedule", "every_k": 1, "kwargs": {"unit": "steps", "phases": [{"asp": 8}, {"bsp": 12}]}}
    summary, ps, _ = _run(tmp_path, {"name": "asp"}, {"pipeline_depth": 1}, workers=2, steps=20, policy=policy)
    protocols = [r["protocol"] for r in ps]
    first_bsp = protocols.index("bsp")
    assert "asp" in protocols[:first_bsp] and set(protocols[first_bsp:]) == {"bsp"}
    assert summary["overlapped_steps"] > 0, "it overlapped under ASP"
    after = ps[first_bsp + 1:]  # the first round takes what was in flight at the switch, as at depth 0
    assert after and all(r["staleness_max"] == "0" and _members(r) == 2 for r in after), "BSP exact after it"
    assert summary["pushes_rejected"] == 0


@pytest.mark.integration
def test_ssp_bound_holds_with_overlap(tmp_path):
    """SSP with staleness 1, worker 1 thirty times slower: worker 0 overlaps, yet never pushes more than
    s + 1 ahead of worker 1 (a held reply holds the push computed meanwhile too)."""
    bound = 1
    summary, ps, _ = _run(tmp_path, {"name": "ssp", "staleness": bound}, {"pipeline_depth": 1}, workers=2,
                          steps=24, stragglers={"slowdown": {"factors": {1: 30.0}}})
    counts, gaps = [0, 0], []
    for update in ps:
        for push in update["pushes"].split(";"):
            counts[int(push.split(":")[0])] += 1
        gaps.append(counts[0] - counts[1])
    assert summary["overlapped_steps"] > 0 and max(gaps) == bound + 1, gaps
