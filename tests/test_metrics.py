"""The PS's Prometheus series: read from a core on a fake clock (no sockets), scraped over HTTP from a live PS
on loopback, and from every shard of a real sharded `switchps run` while it trains; docs/metrics.md lists them."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
import urllib.request
from collections import Counter
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from conftest import wait_until
from harness import Harness
from switchps.address import free_port
from switchps.policies.base import Decision
from switchps.ps_server import metrics
from switchps.ps_server.core.events import StepReport
from switchps.ps_server.rpc.service import PUSH_STREAMS
from test_launch import SWITCHPS, rows

pytest_plugins = ["cluster"]  # cluster_factory: a PS on loopback
DOCS = Path(__file__).parent.parent / "docs" / "metrics.md"
Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]


def parsed(text: str) -> Samples:
    """Sample name -> its labels (sorted pairs) -> value."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def series_names(text: str) -> set[str]:
    """The switchps series' names as PromQL names them (a counter's with its ``_total``)."""
    return {f.name + "_total" * (f.type == "counter") for f in text_string_to_metric_families(text)
            if f.name.startswith("switchps_")}


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def by_worker(samples: Samples, name: str) -> dict[int, float]:
    return {int(dict(labels)["worker"]): v for labels, v in samples[name].items()}


def one(samples: Samples, name: str) -> float:
    [value] = samples[name].values()
    return value


def _fed(h: Harness) -> tuple[metrics.Tally, Counter[str]]:
    """A tally fed as the service feeds it, over a BSP round of 3 workers on ``h``'s core, worker 2 excluded
    afterwards; and traffic."""
    tally = metrics.Tally(clock=lambda: h.now)
    for w, samples in ((0, 8), (1, 4), (2, 4)):
        h.push(w, 1.0, samples)
        tally.pushed(w, samples, 0.25 * (w + 1), h.core.version, h.now)
    [update] = h.applied
    h.now += 2.0
    tally.applied(update, 0.1)
    h.run(h.core.decide(Decision("slow", exclude=frozenset({2})), "manual", h.now))
    return tally, Counter({"in": 300, "in_shared": 100, "out": 500})


def test_series_are_read_from_the_core_and_tally_when_scraped():
    h = Harness(workers=3, protocol={"name": "bsp", "batch": 8})
    tally, traffic = _fed(h)
    series = metrics.RunSeries(h.core, tally, traffic, Counter({"push:version": 2, "register:worker": 1}))
    reg = metrics.registry(series)
    h.now += 5.0
    first = parsed(generate_latest(reg).decode())
    assert one(first, "switchps_model_version") == 1 and one(first, "switchps_updates_total") == 1
    assert first["switchps_protocol"] == {(("name", "bsp"),): 1.0}
    assert one(first, "switchps_workers_in_force") == 2, "worker 2 is excluded: the rule counts 2"
    assert one(first, "switchps_learning_rate") == 0.1 and one(first, "switchps_update_pushes") == 3
    assert one(first, "switchps_seconds_since_update") == pytest.approx(5.0)
    assert by_worker(first, "switchps_worker_samples_total") == {0: 8, 1: 4, 2: 4}
    assert by_worker(first, "switchps_worker_pushes_total") == {0: 1, 1: 1, 2: 1}
    assert by_worker(first, "switchps_worker_step_seconds") == {0: 0.25, 1: 0.5, 2: 0.75}
    assert by_worker(first, "switchps_worker_seconds_since_push") == {0: 7.0, 1: 7.0, 2: 7.0}
    states = {(int(dict(k)["worker"]), dict(k)["state"]) for k, v in first["switchps_worker_state"].items() if v}
    assert states == {(0, "active"), (1, "active"), (2, "excluded")}
    assert first["switchps_received_bytes_total"] == {(("transport", "grpc"),): 200, (("transport", "shared"),): 100}
    assert first["switchps_refusals_total"][(("reason", "version"), ("rpc", "push"))] == 2
    assert first["switchps_pushes_total"][(("outcome", "rejected"),)] == 2, "push refusals are rejected pushes"
    h.now += 10.0  # no update: only the clock moved, and the scrape sees it
    assert one(parsed(generate_latest(reg).decode()), "switchps_seconds_since_update") == pytest.approx(15.0)


def test_before_training_starts_nothing_is_late_and_then_the_wait_counts_from_the_start():
    h = Harness(workers=2, start=False)
    tally = metrics.Tally(clock=lambda: h.now)
    reg = metrics.registry(metrics.RunSeries(h.core, tally, Counter(), Counter()))
    assert "switchps_seconds_since_update" not in parsed(generate_latest(reg).decode())
    for w in range(2):
        h.run(h.core.register(w, 100, h.now))
    h.run(h.core.initialized_at(h.now))
    h.now += 3.0
    assert one(parsed(generate_latest(reg).decode()), "switchps_seconds_since_update") == pytest.approx(3.0)


def test_a_resumed_ps_counts_the_wait_from_its_own_start_not_the_runs():
    h = Harness(workers=2)  # training started at 100
    h.now += 3600.0  # the PS resumes an hour later, its core restored
    reg = metrics.registry(metrics.RunSeries(h.core, metrics.Tally(clock=lambda: h.now), Counter(), Counter()))
    h.now += 2.0
    assert one(parsed(generate_latest(reg).decode()), "switchps_seconds_since_update") == pytest.approx(2.0)


def test_each_shard_serves_on_its_own_port():
    assert [metrics.port_of(9100, k) for k in range(3)] == [9100, 9101, 9102]
    assert [metrics.port_of(0, k) for k in range(3)] == [0, 0, 0], "port 0: each its own, picked by the OS"


def test_docs_list_every_series_the_ps_and_a_shard_serve():
    h = Harness(workers=3, protocol={"name": "bsp", "batch": 8})
    tally, traffic = _fed(h)
    served = series_names(generate_latest(metrics.registry(
        metrics.RunSeries(h.core, tally, traffic, Counter({"push:version": 1})), PUSH_STREAMS)).decode())
    shard = series_names(generate_latest(metrics.registry(
        metrics.ShardSeries(lambda: 3, traffic, Counter()))).decode())
    documented = set(re.findall(r"^\| `(switchps_\w+)`", DOCS.read_text(), re.M))
    assert shard <= served and served == documented


def test_a_live_ps_serves_its_series_over_http(cluster_factory):
    c = cluster_factory(workers=2, size=16, protocol={"name": "bsp", "batch": 4})
    server = metrics.serve(metrics.registry(c.ps.series(), PUSH_STREAMS), 0)
    try:
        for _ in range(3):
            pending = [w.push_async(np.ones(16, np.float32), 4 - w.index) for w in c.workers]
            for p in pending:
                p.join(30)
        wait_until(lambda: c.ps.tally.updates == 3, what="three updates applied")
        with pytest.raises(grpc.RpcError):
            c.workers[0].push(np.ones(16, np.float32), 4, base_version=99)  # refused: a version never made
        s = parsed(scrape(server.server_port))
    finally:
        metrics.stop(server)
    c.ps.rec.flush()
    pushed = Counter()
    for row in rows(c.run_dir / "workers.csv"):
        pushed[int(row["worker"])] += int(row["samples"])
    assert by_worker(s, "switchps_worker_samples_total") == {0: 12, 1: 9} == pushed
    assert by_worker(s, "switchps_worker_pushes_total") == {0: 3, 1: 3}
    assert one(s, "switchps_model_version") == 3 and one(s, "switchps_workers_in_force") == 2
    assert one(s, "switchps_learning_rate") == 1.0 and one(s, "switchps_update_pushes") == 2
    assert 0 <= one(s, "switchps_seconds_since_update") < 30
    nbytes = 16 * 4 * 6  # six pushes of 16 float32 each
    assert sum(s["switchps_received_bytes_total"].values()) == nbytes + 16 * 4, "and the initial values"
    assert sum(s["switchps_sent_bytes_total"].values()) >= nbytes, "each push's reply, and the first pulls"
    assert s["switchps_refusals_total"][(("reason", "version"), ("rpc", "push"))] == 1
    assert s["switchps_pushes_total"] == {(("outcome", "applied"),): 6, (("outcome", "dropped"),): 0,
                                          (("outcome", "rejected"),): 1}


def test_the_grafana_dashboard_charts_every_documented_series_and_no_other():
    dashboard = json.loads((Path(__file__).parent.parent / "switchps/examples/grafana/switchps.json").read_text())
    charted = {name for p in dashboard["panels"] for t in p["targets"]
               for name in re.findall(r"switchps_\w+", t["expr"])}
    assert charted == set(re.findall(r"^\| `(switchps_\w+)`", DOCS.read_text(), re.M))
    [alert] = [p for p in dashboard["panels"] if p["type"] == "stat" and "since the last update" in p["title"]]
    assert alert["fieldConfig"]["defaults"]["thresholds"]["steps"][-1] == {"color": "red", "value": 300}


def _two_free_ports() -> int:
    """A port P, with P + 1, both free at the moment of asking (racy, as ``free_port``)."""
    while True:
        port = free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue


def _scrape_or_none(port: int) -> Samples | None:
    try:
        return parsed(scrape(port))
    except OSError:
        return None


@pytest.mark.integration
def test_every_shard_of_a_real_run_serves_its_series_while_it_trains(tmp_path):
    """`switchps run` of a PS in two shards and two torch workers, with ``runtime.metrics_port``: shard 0's
    series on the port, shard 1's on the next, scraped over HTTP while it trains; the port is closed after."""
    port = _two_free_ports()
    cfg = {"name": "metrics", "cluster": {"workers": 2, "ps": ["127.0.0.1:0"] * 2},
           "model": {"framework": "torch", "name": "mlp", "kwargs": {"hidden": [32]}}, "data": {"name": "digits"},
           "optimizer": {"name": "sgd", "learning_rate": 0.05}, "protocol": {"name": "bsp", "batch": 16},
           "train": {"steps": 400}, "checkpoint": {"every_s": None},
           "runtime": {"shard_max_mb": 0.004, "metrics_port": port}}
    (tmp_path / "metrics.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([SWITCHPS, "run", "metrics.yaml", "--quiet", "--set", f"output.dir={tmp_path}"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        training = shard = None
        while proc.poll() is None and (training is None or shard is None):
            s = _scrape_or_none(port)
            if s is not None and one(s, "switchps_model_version") > 0 and proc.poll() is None:
                training = s
            s1 = _scrape_or_none(port + 1)
            if s1 is not None and sum(s1["switchps_received_bytes_total"].values()) > 0:
                shard = s1
            time.sleep(0.05)
        last = _scrape_or_none(port)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert training is not None and shard is not None, "both shards were scraped while the run trained"
    assert training["switchps_protocol"] == {(("name", "bsp"),): 1.0}
    assert one(training, "switchps_workers_in_force") == 2 and 0 <= one(training, "switchps_seconds_since_update") < 60
    assert set(by_worker(training, "switchps_worker_samples_total")) == {0, 1}
    assert sum(training["switchps_received_bytes_total"].values()) > 0
    assert sum(training["switchps_sent_bytes_total"].values()) > 0
    assert one(shard, "switchps_model_version") >= 0 and "switchps_worker_state" not in shard, "a part's series"
    [run_dir] = [d for d in tmp_path.iterdir() if (d / "summary.json").exists()]
    pushed = Counter()
    for row in rows(run_dir / "workers.csv"):
        pushed[int(row["worker"])] += int(row["samples"])
    final = last or training
    assert all(0 < n <= pushed[w] for w, n in by_worker(final, "switchps_worker_samples_total").items()), \
        "the samples the PS counted are those the record shows, up to the last scrape"
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["port"] for e in events if e["event"] == "metrics_serving"] == [port]
    assert _scrape_or_none(port) is None and _scrape_or_none(port + 1) is None, "the ports are closed after the run"
