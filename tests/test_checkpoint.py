"""Checkpoint files and the core's saved state, without sockets, threads or sleeps."""

from __future__ import annotations

import numpy as np
import pytest

from harness import Harness
from switchps.ps_server import checkpoint
from switchps.ps_server.checkpoint import CheckpointError
from switchps.ps_server.checkpointer import compose, restore
from switchps.ps_server.core.events import StepReport


def state(v: float) -> dict:
    return {"values": np.full(5, v, np.float32), "nested": {"ids": np.arange(3), "name": "bsp", "x": [1.5, None]},
            "empty": np.zeros(0, np.float32)}


def test_a_checkpoint_reads_back_exactly(tmp_path):
    path = checkpoint.write(tmp_path, 7, state(0.25))
    ck = checkpoint.read(path)
    assert ck.version == 7 and ck.state["nested"]["name"] == "bsp" and ck.state["nested"]["x"] == [1.5, None]
    np.testing.assert_array_equal(ck.state["values"], np.full(5, 0.25, np.float32))
    assert ck.state["values"].dtype == np.float32 and ck.state["nested"]["ids"].tolist() == [0, 1, 2]
    assert ck.state["empty"].shape == (0,)


def test_a_torn_or_altered_checkpoint_is_skipped_for_the_previous_one(tmp_path):
    checkpoint.write(tmp_path, 1, state(1.0))
    newest = checkpoint.write(tmp_path, 2, state(2.0))
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])  # a write torn by a crash of the disk, not by us
    with pytest.raises(CheckpointError, match="checksum"):
        checkpoint.read(newest)
    ck = checkpoint.latest(tmp_path)
    assert ck is not None and ck.version == 1
    newest.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])  # one bit flipped
    assert checkpoint.latest(tmp_path).version == 1
    newest.write_bytes(b"")
    assert checkpoint.latest(tmp_path).version == 1


def test_an_interrupted_write_leaves_only_a_temporary_file_which_is_never_read(tmp_path):
    checkpoint.write(tmp_path, 1, state(1.0))
    (tmp_path / ".v0000000002.ckpt.999999.tmp").write_bytes(b"SWPSCKP1 half")  # kill -9 mid-write
    assert checkpoint.latest(tmp_path).version == 1
    checkpoint.prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v0000000001.ckpt"]


def test_prune_keeps_the_newest(tmp_path):
    for v in (3, 10, 4, 12):
        checkpoint.write(tmp_path, v, state(v))
    checkpoint.prune(tmp_path, keep=2)
    assert [p.name for p in checkpoint.files(tmp_path)] == ["v0000000012.ckpt", "v0000000010.ckpt"]
    assert checkpoint.latest(tmp_path, version=10).version == 10
    assert checkpoint.latest(tmp_path, version=3) is None


def saved_and_loaded(h: Harness, tmp_path, crash: bool = True) -> Harness:
    """A fresh core continued from ``h``'s state written to and read from a checkpoint file, later (after a
    ``crash``: by a new process, which relaxes what the crash made uncertain)."""
    checkpoint.write(tmp_path, h.core.version, compose(h.parts(), h.now))
    back = Harness(workers=len(h.core.members.registered), start=False)
    back.now = h.now + 50.0  # the restart took a while
    ck = checkpoint.latest(tmp_path)
    assert ck is not None
    restore(back.parts(), ck.state, ck.version, back.now, crash)
    back.params = h.params.copy()  # the harness's model is not in its checkpoint
    back._ids = 1000
    return back


def push(h: Harness, worker: int, value: float, step: int, session: int = 1, base: int | None = None) -> int:
    return h.push(worker, value, base=base, step=step, session=session)


def test_a_bsp_round_in_flight_survives_a_checkpoint_and_a_retry_takes_its_place(tmp_path):
    h = Harness(workers=3)
    push(h, 0, 1.0, step=0)
    push(h, 1, 2.0, step=0)  # the round holds workers 0 and 1 when the PS dies
    back = saved_and_loaded(h, tmp_path)
    assert back.core.version == 0 and back.core.started_at == back.now - (h.now - h.core.started_at)
    retry = push(back, 0, 1.0, step=0)  # worker 0's reply was lost: it sends the same push again
    assert not back.applied and back.events("push_retried") == [{"worker": 0, "step": 0, "version": 0}]
    assert back.freed, "the retry's copy of the gradient is let go"
    last = push(back, 2, 3.0, step=0)
    assert len(back.applied) == 1 and back.applied[0].aggregate.samples == 3
    np.testing.assert_allclose(back.params, [-2.0, -2.0])  # (1 + 2 + 3) / 3: worker 0 counted once
    assert back.releases[retry].outcome.applied and back.releases[last].outcome.applied


def test_a_retry_of_an_applied_push_is_dropped_and_a_push_on_a_lost_version_too(tmp_path):
    h = Harness(workers=2, protocol={"name": "asp"})
    push(h, 0, 1.0, step=0)
    push(h, 1, 1.0, step=0)
    back = saved_and_loaded(h, tmp_path)
    dup = push(back, 0, 1.0, step=0)  # applied before the checkpoint: the model has it already
    assert back.releases[dup].outcome.note == "dropped: repeated" and back.core.version == 2
    back.core.check_push(1, 1, 5, StepReport(step=3), back.now, session=1)  # computed on version 5, lost in the crash: not invalid...
    lost = push(back, 1, 1.0, step=3, base=5)
    assert back.releases[lost].outcome.note == "dropped: lost_version" and back.core.version == 2  # ...dropped
    fresh = push(back, 0, 1.0, step=1)
    assert back.releases[fresh].outcome.applied and back.core.version == 3
    new_session = push(back, 1, 1.0, step=0, session=2)  # a restarted worker process numbers from 0 again
    assert back.releases[new_session].outcome.applied
    assert back.counts["dropped:repeated"] == 1 and back.counts["dropped:lost_version"] == 1


def test_the_core_state_round_trips_exactly(tmp_path):
    h = Harness(workers=3, protocol={"name": "ssp", "staleness": 1})
    for step in range(3):
        push(h, 0, 0.5, step=step)
    back = saved_and_loaded(h, tmp_path, crash=False)
    assert _same(back.core.state_dict(back.now), h.core.state_dict(h.now))


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b

