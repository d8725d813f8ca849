"""What a run shows while and after it trains: TensorBoard event files, written without TensorFlow."""

from __future__ import annotations

import re
import socket
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tensorboardX.proto.event_pb2 import Event

from switchps.ps_server.tensorboard import PROTOCOL_INDEX

pytest_plugins = ["cluster"]  # cluster_factory: a PS on loopback

G = np.float32


def read_events(directory: Path) -> list[Event]:
    """Every event in a TensorBoard directory (TFRecord framing: length, crc, data, crc)."""
    events = []
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (n,) = struct.unpack_from("<Q", data, pos)
            events.append(Event.FromString(data[pos + 12:pos + 12 + n]))
            pos += 12 + n + 4
    return events


def scalars(events: list[Event]) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for e in events:
        for v in e.summary.value:
            if v.HasField("simple_value"):
                out.setdefault(v.tag, []).append((e.step, v.simple_value))
    return out


def test_a_run_writes_tensorboard_scalars_per_update_step_and_evaluation(cluster_factory):
    c = cluster_factory(workers=2, size=2, train={"steps": 6}, protocol={"batch": 1},
                        policy={"name": "schedule", "kwargs": {"phases": [{"bsp": 0.5}, {"asp": 0.5}]}})
    for _ in range(3):
        [r.result() for r in [w.push_async(np.ones(2, G), 1) for w in c.workers]]
    while not c.core.done:
        c.workers[0].push(np.ones(2, G), 1)
    c.workers[1].client.report_eval(6, 0.5, 0.75, final=True)
    c.store.wait_idle(10)
    c.rec.close({})
    events = read_events(c.run_dir / "tensorboard")
    s = scalars(events)
    assert [step for step, _ in s["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert {"train/learning_rate", "train/staleness_mean", "train/samples", "train/protocol_index",
            "eval/test_accuracy", "eval/test_loss"} <= s.keys()
    bsp, asp = PROTOCOL_INDEX["bsp"], PROTOCOL_INDEX["asp"]
    assert [v for _, v in s["train/protocol_index"]] == [bsp] * 3 + [asp] * 3, "the protocol in force, per update"
    assert s["eval/test_accuracy"] == [(6, 0.75)]
    assert any(tag.startswith("workers/step_s/") for tag in s)
    texts = [v.tag for e in events for v in e.summary.value if not v.HasField("simple_value")]
    assert sum(t.startswith("protocol") for t in texts) == 2, "a text entry when training starts and at the switch"


def test_tensorflow_reads_the_event_files_and_their_checksums(tmp_path):
    """TensorFlow's own reader checks every record's CRC: the light writer frames records as TensorBoard does."""
    import tensorflow as tf

    from switchps.ps_server.tensorboard import TensorBoard

    tb = TensorBoard(tmp_path)
    tb.updates([{"version": "7", "train_loss": "2.5", "lr": "0.05", "staleness_mean": "", "samples": "32",
                 "protocol": "asp", "time_s": "0.1"}])
    tb.evaluations([("0.2", 7, "0.5", "0.75")])
    tb.close()
    [path] = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    assert sum(1 for _ in tf.data.TFRecordDataset(str(path))) == 4, "version header, update, its text, evaluation"
    events = [Event.FromString(r.numpy()) for r in tf.data.TFRecordDataset(str(path))]
    assert events[0].file_version == "brain.Event:2"
    update = {v.tag: v.simple_value for v in events[1].summary.value}
    assert events[1].step == 7 and update == {"train/loss": 2.5, "train/learning_rate": np.float32(0.05),
                                              "train/samples": 32.0, "train/protocol_index": PROTOCOL_INDEX["asp"]}
    data = bytearray(path.read_bytes())
    data[-5] ^= 1  # one bit of the last record's payload
    path.write_bytes(bytes(data))
    with pytest.raises(tf.errors.DataLossError):
        sum(1 for _ in tf.data.TFRecordDataset(str(path)))


def test_the_ps_writes_tensorboard_without_importing_tensorflow():
    code = ("import sys; import switchps.ps_server.rpc.main, switchps.ps_server.tensorboard; "
            "assert 'tensorflow' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_resources_are_sampled_per_process_summarised_per_role_and_plotted(tmp_path):
    from switchps import resources

    path = tmp_path / "resources.csv"
    samplers = [resources.ResourceSampler(role, path, every_s=0.05) for role in ("ps", "worker-0")]
    import time

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and sum(1 for _ in path.open()) < 7:
        time.sleep(0.05)
    for s in samplers:
        s.stop()
    assert path.read_text().count(resources.HEADER) == 1, "one header, by the sampler that made the file"
    summary = resources.summary(path)
    assert summary is not None and set(summary) == {"ps", "worker-0"}
    assert all(r["rss_mb_peak"] >= r["rss_mb_mean"] > 10 and r["samples"] >= 1 for r in summary.values())
    assert all(r["hosts"] == [socket.gethostname()] for r in summary.values())
    assert resources.in_summary(path) == {"resources": summary, "hosts": 1}
    fig = resources.figure(path)
    assert fig is not None and [len(ax.lines) for ax in fig.axes] == [2, 2], "a line per role, CPU and RSS"


def test_hosts_are_the_distinct_hosts_in_whole_rows_and_older_rows_without_one_still_count_as_resources(tmp_path):
    from switchps import resources

    path = tmp_path / "resources.csv"
    path.write_text(",".join(resources.COLUMNS) + "\n"
                    "1.0,ps,7,50.0,100.0,0,0,node-a\n"
                    "1.0,worker-0,8,90.0,300.0,0,0,node-b\n"
                    "2.0,worker-0,9,80.0,310.0,0,0,node-c\n"  # restarted on another host
                    "1.0,evaluator,10,10.0,200.0,0,0\n"  # written before hosts were recorded
                    + resources.HEADER +  # a second header (two processes once both made the file): skipped
                    "3.0,worker-1,11,70.0,300.0,0,0,node-")  # torn: no newline yet
    out = resources.in_summary(path)
    assert {role: r["hosts"] for role, r in out["resources"].items()} == {
        "ps": ["node-a"], "worker-0": ["node-b", "node-c"], "evaluator": []}
    assert out["hosts"] == 3
    path.write_text(",".join(resources.COLUMNS[:-1]) + "\n1.0,ps,7,50.0,100.0,0,0\n")
    assert resources.in_summary(path)["hosts"] is None, "no row names a host: not known"
    assert resources.in_summary(tmp_path / "none.csv") == {"resources": None, "hosts": None}


def test_status_reads_a_live_ps_and_its_run_directory(cluster_factory):
    from switchps.runs.record import console
    from switchps.runs.status import status_table

    c = cluster_factory(workers=2, size=2, protocol={"name": "asp"})
    c.workers[0].push(np.ones(2, G), 1)
    c.store.wait_idle(10)
    c.rec.flush()
    (c.run_dir / "config.yaml").write_text(f"cluster: {{ps: '{c.address}'}}\n")
    con = console()
    with con.capture() as out:
        con.print(status_table(str(c.run_dir)))
    text = out.get()
    assert re.search(r"version\s+│\s+1\s", text) and re.search(r"protocol\s+│\s+asp\s", text)
    assert "asp" in text and "worker 0 step" in text and "excluded workers" in text
    with con.capture() as out:
        con.print(status_table("127.0.0.1:1"))
    assert "not reachable" in out.get()


def test_each_event_carries_its_records_time_not_the_flushs(tmp_path):
    """Importers that keep one point of a tag per wall time (Aim's) see every update of one flush: each event
    is stamped with its record's time_s (virtual in a simulation), anchored at the first record."""
    from switchps.ps_server.tensorboard import TensorBoard

    tb = TensorBoard(tmp_path)
    tb.updates([{"version": str(v), "train_loss": "1", "lr": "0.1", "staleness_mean": "", "samples": "8",
                 "protocol": "bsp", "time_s": str(10.0 + 0.5 * v)} for v in (1, 2, 3)])
    tb.updates([{"version": "4", "train_loss": "1", "lr": "0.1", "staleness_mean": "", "samples": "8",
                 "protocol": "bsp", "time_s": "11.5"}])  # at the same time as version 3
    columns = ("time_s", "worker", "step", "compute_s", "sleep_s", "base_version", "local_losses")
    tb.steps([("10.4", "0", "1", "0.1", "0", "0", ""), ("10.9", "0", "2", "0.1", "0", "1", "")], columns)
    tb.evaluations([("11.6", 3, "0.5", "0.75")])
    tb.close()
    at = {(v.tag, e.step): e.wall_time for e in read_events(tmp_path / "tensorboard") for v in e.summary.value}
    t0 = at["train/loss", 1] - 10.5
    assert [at["train/loss", v] - t0 for v in (1, 2, 3)] == pytest.approx([10.5, 11.0, 11.5])
    assert 0 < at["train/loss", 4] - at["train/loss", 3] < 1e-5, "after version 3, a microsecond on"
    assert [at["workers/step_s/0", s] - t0 for s in (1, 2)] == pytest.approx([10.4, 10.9])
    assert at["eval/test_accuracy", 3] - t0 == pytest.approx(11.6)
