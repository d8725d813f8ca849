"""The run record on a driver's clock, and in a driver's checkpoint: the test harness records on its fake
clock, with no flusher thread and no sleeps, and checkpoints through the same composer as the gRPC PS."""

from __future__ import annotations

import csv
import json
import threading
from pathlib import Path

from harness import Harness
from test_observability import read_events, scalars
from switchps.ps_server.checkpointer import compose, record_position
from switchps.ps_server.core.events import StepReport
from switchps.ps_server.records import FLUSHER, RunRecorder


def column(path: Path, name: str) -> list[str]:
    with path.open(newline="") as f:
        return [row[name] for row in csv.DictReader(f)]


def recorded(tmp_path: Path) -> Harness:
    """ASP on two workers, training from time 100: pushes at 100.25 and 101.5, a switch at 103, an
    evaluation at 104.75."""
    h = Harness(workers=2, protocol={"name": "asp"}, run_dir=tmp_path)
    h.now = 100.25
    h.push(0, 1.0, step=0, session=1)
    h.now = 101.5
    h.push(1, 1.0, step=0, session=1)
    h.now = 103.0
    h.switch(name="bsp")
    h.now = 104.75
    assert h.rec is not None
    h.rec.evaluation(2, 0.5, 0.9)
    return h


def test_a_recorder_on_a_fake_clock_stamps_every_row_with_exactly_its_times(tmp_path):
    before = set(threading.enumerate())  # other tests' recorders may still be flushing
    h = recorded(tmp_path)
    assert h.rec is not None
    started = set(threading.enumerate()) - before
    assert not any(t.name == FLUSHER for t in started), "the driver flushes: no flusher thread"
    h.rec.flush()
    assert column(tmp_path / "ps.csv", "time_s") == ["0.25", "1.5"]
    assert column(tmp_path / "workers.csv", "time_s") == ["0.25", "1.5"]
    assert column(tmp_path / "eval.csv", "time_s") == ["4.75"]
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["time_s"], e["event"]) for e in events] == [
        (0.0, "worker_joined"), (0.0, "worker_joined"), (0.0, "training_started"), (3.0, "switch")]
    h.now = 110.0
    h.rec.event("later")
    h.rec.close({})
    assert json.loads((tmp_path / "events.jsonl").read_text().splitlines()[-1]) == {"time_s": 10.0,
                                                                                      "event": "later"}


def test_the_harness_checkpoints_its_record_through_the_shared_composer(tmp_path):
    h = recorded(tmp_path)
    state = compose(h.parts(), h.now)
    assert list(state) == ["core", "records", "sums"], "a driver without a model saves no model"
    assert state["records"]["rows"] == {"workers": 2, "eval": 1, "trace": 0, "ps": 2}
    assert state["records"]["counts"] == {"accepted": 2}
    assert h.rec is not None
    h.rec.close({})
    again = RunRecorder(tmp_path, flush_every_s=None, resume=record_position(state), clock=lambda: 0.0)
    assert (again.ps.count, again.workers.count, again.counts["accepted"]) == (2, 2, 2)
    again.close({})


def test_local_steps_and_their_losses_are_recorded_per_update_and_per_push_and_shown_in_tensorboard(tmp_path):
    h = Harness(workers=2, protocol={"name": "local_sgd", "batch": 2, "local_steps": 2}, run_dir=tmp_path)
    h.push(0, 4.0, samples=4, report=StepReport(local_steps=2, local_loss_sums=(6.0, 2.0)))  # losses 3, 1
    h.push(1, 4.0, samples=4, report=StepReport(local_steps=2, local_loss_sums=(2.0, 2.0)))  # 1, 1
    h.switch(name="bsp")
    h.push(0, 1.0, samples=2)  # a gradient
    h.push(1, 1.0, samples=2)
    assert h.rec is not None
    h.rec.close({})
    assert column(tmp_path / "ps.csv", "local_steps") == ["4", "0"]
    assert column(tmp_path / "workers.csv", "local_steps") == ["2", "2", "0", "0"]
    assert column(tmp_path / "workers.csv", "local_losses") == ["3 1", "1 1", "", ""]
    s = scalars(read_events(tmp_path / "tensorboard"))
    assert s["train/inner_loss"] == [(0, 1.5)], "the mean of each push's mean local loss, at the version pulled"
    assert s["train/outer_loss"] == [(0, 2.0)], "the first local step's: the loss at that version's values"


def test_member_seconds_follow_the_members_per_update_and_survive_a_checkpoint(tmp_path):
    """An elastic run's worker utilization divides by Σ members × time: 4 members for 10 s, 6 for 5 s, 3 to
    the end at 20 s gives 4·10 + 6·5 + 3·5 = 85 (a fixed-size run's would be N × 20)."""
    from switchps.ps_server.core.actions import Apply
    from switchps.ps_server.core.events import Aggregate, Push

    now = [0.0]
    rec = RunRecorder(tmp_path, flush_every_s=None, clock=lambda: now[0])
    rec.start(0.0)
    assert rec.member_seconds(20.0, 4) == 80.0, "no update yet: the starting count"
    for t, members in ((5.0, 4), (10.0, 6), (15.0, 3)):
        now[0] = t
        agg = Aggregate(t, [Push(1, 0, 0, 8, 0.0, t)], 8)
        rec.update(Apply(int(t), agg, 1.0, "bsp", None, 0.0, members=members), 0.1)
    assert rec.member_seconds(20.0, 4) == 4 * 10 + 6 * 5 + 3 * 5
    again = RunRecorder(tmp_path / "again", flush_every_s=None, resume={"rows": {}, **rec.position()},
                        clock=lambda: now[0])
    assert again.member_seconds(20.0, 4) == 85.0
    rec.close({})
    again.close({})
