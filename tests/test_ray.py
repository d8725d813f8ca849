"""`switchps run --backend ray` on a real multi-node Ray cluster (``ray.cluster_utils.Cluster``: every
node a set of local processes with its own custom resources): placement, a lost worker node, a killed
PS actor. One cluster serves the module; each run is a `switchps run` process joining it. Roles write
in node-local stages (``cluster.ray.staging_dir``, outside the driver's run directory), as they would
without a shared filesystem; the run directory the tests read is the driver's."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install \"switchps[ray]\")")
from ray.cluster_utils import Cluster  # noqa: E402

from switchps.launch.ray_backend import NAMESPACE, actor_name  # noqa: E402
from test_launch import SWITCHPS, check_run_dir, rows  # noqa: E402

pytestmark = pytest.mark.integration
RUN_TIMEOUT_S = 150


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, Any]]:
    """A head node labelled ``node_a`` (the PS, or two PS shards, and the evaluator) and two nodes offering
    ``workers``."""
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "resources": {"node_a": 3}})
    nodes = {"a": c.head_node}
    try:
        for name in ("b", "c"):
            nodes[name] = c.add_node(num_cpus=4, resources={"workers": 2, f"node_{name}": 1})
        c.wait_for_nodes()
        ray.init(address=c.address, namespace=NAMESPACE, log_to_driver=False)
        yield {"cluster": c, "nodes": nodes}
    finally:
        ray.shutdown()
        c.shutdown()


def write_config(tmp_path: Path, steps: int, **sections: Any) -> Path:
    cfg = {"name": "ray", "cluster": {"workers": 2, "ray": {
               "strategy": "spread", "max_restarts": 2, "staging_dir": str(tmp_path / "nodes"),
               "sync_every_s": 0.5,
               "ps": {"num_cpus": 1, "resources": {"node_a": 1}},
               "evaluator": {"num_cpus": 1, "resources": {"node_a": 1}},
               "worker": {"num_cpus": 1, "resources": {"workers": 1}}}},
           "model": {"name": "logreg"}, "data": {"name": "digits"},
           "protocol": {"name": "asp", "batch": 16}, "train": {"steps": steps},
           "device": {"samples_per_s": 200}, "output": {"dir": str(tmp_path)}, **sections}
    path = tmp_path / "ray.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def start_run(processes, tmp_path: Path, cluster: dict, config: Path, **env: str) -> subprocess.Popen:
    return processes([SWITCHPS, "run", str(config), "--quiet", "--backend", "ray", "--address",
                      cluster["cluster"].address], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                     cwd=tmp_path, env={**os.environ, **env})


def run_dir_of(tmp_path: Path) -> Path:
    (run_dir,) = [d for d in tmp_path.iterdir() if (d / "config.yaml").exists()]
    return run_dir


def ray_events(run_dir: Path) -> list[dict]:
    """The driver's events in the run's event log."""
    path = run_dir / "events.jsonl"
    events = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return [e for e in events if e["event"].startswith("ray_")]


def wait_for_updates(launcher: subprocess.Popen, tmp_path: Path, n: int) -> Path:
    """The run directory, once its ps.csv records more than ``n`` updates (the run still going)."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        assert launcher.poll() is None, launcher.communicate()[1][-3000:]
        for ps_csv in tmp_path.glob("*/ps.csv"):
            if len(ps_csv.read_text().splitlines()) > n + 1:
                return ps_csv.parent
        time.sleep(0.05)
    raise AssertionError(f"the run never recorded {n} updates")


def finished(launcher: subprocess.Popen, tmp_path: Path, lost: tuple[str, ...] = ()) -> tuple[Path, dict]:
    """The driver's run directory, checked as a local run's is; every stage is gone but those of roles
    whose node was lost (on a real cluster, on that node's disk)."""
    _, err = launcher.communicate(timeout=RUN_TIMEOUT_S)
    assert launcher.returncode == 0, err[-3000:]
    run_dir = run_dir_of(tmp_path)
    summary = check_run_dir(run_dir)
    left = {p.relative_to(tmp_path / "nodes").parts[2].partition(".")[0]
            for p in (tmp_path / "nodes").rglob("*") if p.is_file()}
    assert left <= set(lost), f"stages removed once collected: {left} left"
    return run_dir, summary


def applied_once(run_dir: Path, summary: dict) -> None:
    """One ps.csv row per version, 1..N in order, and no push applied twice."""
    assert [int(r["version"]) for r in rows(run_dir / "ps.csv")] == list(range(1, summary["updates"] + 1))
    pushes = [p for r in rows(run_dir / "ps.csv") for p in r["pushes"].split(";")]
    assert len(pushes) == len(set(pushes)), "no push applied twice"


def test_roles_land_on_the_nodes_the_config_asks_for_and_the_run_completes(tmp_path, cluster, processes):
    secret = "0123456789abcdef" * 4  # the driver's run secret (it would make one)
    launcher = start_run(processes, tmp_path, cluster, write_config(tmp_path, steps=40), SWITCHPS_RUN_SECRET=secret)
    run_dir, summary = finished(launcher, tmp_path)
    assert summary["final_version"] == summary["updates"] == 40
    placed = {e["role"]: e["node_id"] for e in ray_events(run_dir) if e["event"] == "ray_placed"}
    nodes = {k: n.node_id for k, n in cluster["nodes"].items()}
    assert placed["ps"] == placed["evaluator"] == nodes["a"], "node_a: only the head node offers it"
    assert {placed["worker-0"], placed["worker-1"]} == {nodes["b"], nodes["c"]}, "spread over the workers nodes"
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["security"]["secret_env"] == "SWITCHPS_RUN_SECRET"
    assert summary["rejections"] == {}, "every role authenticated with the secret it was handed"
    written = [f for f in run_dir.rglob("*") if f.is_file() and secret.encode() in f.read_bytes()]
    assert not (run_dir / "secret").exists() and written == [], "the secret is in no file of the run"
    logs = {p.name for p in (run_dir / "logs").iterdir()}
    assert logs == {"ps.log", "evaluator.log", "worker-0.log", "worker-1.log"}, "every role's log collected"
    assert set(summary["resources"]) == {"ps", "evaluator", "worker-0", "worker-1"}, "every role's rows"
    assert (run_dir / "resources.csv").read_text().count("unix_time,") == 1, "one header"


def test_a_worker_node_removed_mid_run_its_worker_restarts_elsewhere_and_the_run_completes(
        tmp_path, cluster, processes):
    launcher = start_run(processes, tmp_path, cluster, write_config(tmp_path, steps=400))
    run_dir = wait_for_updates(launcher, tmp_path, 30)
    staged = {p.parent.name.partition(".")[0] for p in (tmp_path / "nodes").rglob("config.yaml")}
    assert staged == {"ps", "evaluator", "worker-0", "worker-1"}, "each role runs in its node-local stage"
    placed = {e["role"]: e["node_id"] for e in ray_events(run_dir) if e["event"] == "ray_placed"}
    (lost,) = [k for k, n in cluster["nodes"].items() if n.node_id == placed["worker-0"]]
    cluster["cluster"].remove_node(cluster["nodes"][lost])
    try:
        run_dir, summary = finished(launcher, tmp_path, lost=("worker-0",))
    finally:  # the next test finds the cluster as it was
        cluster["nodes"][lost] = cluster["cluster"].add_node(num_cpus=4,
                                                             resources={"workers": 2, f"node_{lost}": 1})
    assert summary["final_version"] == summary["updates"] == 400
    applied_once(run_dir, summary)
    (restarted,) = [e for e in ray_events(run_dir) if e["event"] == "ray_restarted"]
    assert restarted["role"] == "worker-0" and restarted["node_id"] not in (placed["worker-0"], None)
    assert summary["pushes_rejected"] == 0


def test_a_killed_ps_actor_is_restarted_by_ray_and_resumes_from_its_checkpoint(tmp_path, cluster, processes):
    config = write_config(tmp_path, steps=400, checkpoint={"every_updates": 20, "every_s": None})
    launcher = start_run(processes, tmp_path, cluster, config)
    run_dir = wait_for_updates(launcher, tmp_path, 60)
    ray.kill(ray.get_actor(actor_name(run_dir, "ps", 0), namespace=NAMESPACE), no_restart=False)
    run_dir, summary = finished(launcher, tmp_path)
    assert summary["resumes"] == 1 and summary["final_version"] == summary["updates"] == 400
    applied_once(run_dir, summary)
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    (resumed,) = [e for e in events if e["event"] == "resumed"]
    assert 0 <= resumed["lost_updates"] <= 2 * 20 + 5, "at most what the checkpoint interval allows"
    (restarted,) = [e for e in ray_events(run_dir) if e["event"] == "ray_restarted"]
    assert restarted["role"] == "ps" and restarted["reconstructed"]


def test_a_sharded_ps_places_every_shard_as_a_role_and_collects_each_shards_record(tmp_path, cluster, processes):
    config = write_config(tmp_path, steps=60, runtime={"shard_max_mb": 0.004},
                          model={"name": "mlp", "kwargs": {"hidden": [32]}}, checkpoint={"every_updates": 20})
    raw = yaml.safe_load(config.read_text())
    raw["cluster"]["ps"] = ["127.0.0.1:0", "127.0.0.1:0"]
    config.write_text(yaml.safe_dump(raw))
    run_dir, summary = finished(start_run(processes, tmp_path, cluster, config), tmp_path)
    assert summary["final_version"] == summary["updates"] == 60
    placed = {e["role"]: e["node_id"] for e in ray_events(run_dir) if e["event"] == "ray_placed"}
    assert placed["ps"] == placed["ps-1"] == cluster["nodes"]["a"].node_id, "cluster.ray.ps is every shard's bundle"
    shard = json.loads((run_dir / "shard-1.json").read_text())  # written on its node, collected by the driver
    assert shard["final_version"] == 60 and shard["parts_applied"] == summary["pushes_accepted"]
    assert list((run_dir / "checkpoints" / "shard-1").glob("v*.ckpt")), "its saved parts collected too"


def test_switchps_scale_starts_a_worker_in_its_reserved_bundle_and_the_run_counts_it(tmp_path, cluster, processes):
    config = write_config(tmp_path, steps=1200, data={"name": "digits", "sampling": "replacement"})
    raw = yaml.safe_load(config.read_text())
    raw["cluster"]["workers"] = {"min": 1, "max": 3, "start": 2}
    config.write_text(yaml.safe_dump(raw))
    launcher = start_run(processes, tmp_path, cluster, config)
    run_dir = wait_for_updates(launcher, tmp_path, 20)
    scaled = subprocess.run([SWITCHPS, "scale", str(run_dir), "+1"], capture_output=True, text=True, timeout=60)
    assert scaled.returncode == 0 and "for 3 workers (it runs 2)" in scaled.stdout, scaled.stderr
    run_dir, summary = finished(launcher, tmp_path)
    members = [int(r["members"]) for r in rows(run_dir / "ps.csv")]
    assert members[0] == 2 and members[-1] == 3, "the run grew from 2 to 3 members"
    placed = {e["role"] for e in ray_events(run_dir) if e["event"] == "ray_placed"}
    assert "worker-2" in placed, "the newcomer was placed in the bundle reserved for it"
    applied_once(run_dir, summary)


def small_config(tmp_path: Path, **ray_spec: Any) -> Path:
    """Two workers, the PS and the evaluator at the default placement but for ``ray_spec``."""
    tmp_path.mkdir(exist_ok=True)
    return write_config(tmp_path, steps=30, cluster={"workers": 2, "ray": {
        "staging_dir": str(tmp_path / "nodes"), "sync_every_s": 0.5, **ray_spec}})


def test_roles_a_small_cluster_cannot_hold_are_named_with_the_num_cpus_that_would_fit(tmp_path, processes):
    small = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})  # one node, 2 CPUs, joined
    try:
        run = processes([SWITCHPS, "run", str(small_config(tmp_path, worker={"num_cpus": 1}, placement_timeout_s=1)),
                         "--quiet", "--backend", "ray", "--address", small.address],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
        _, err = run.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        small.shutdown()
    said = " ".join(err.split())  # as printed, wrapped
    assert run.returncode == 1, err[-3000:]
    assert ("the roles ask {'CPU': 4.0} in all; the nodes have {'CPU': 2.0}; they would fit with "
            "num_cpus: 0.5 for every role (cluster.ray.ps, .evaluator and .worker)") in said, said
    assert "waiting up to 1 s" in said, "said before the wait: a cluster joined may gain nodes"
    assert "Ray could not place the roles (pack: ps {'CPU': 1.0}, evaluator {'CPU': 1.0}, worker-0..1" in said
    assert not [d for d in tmp_path.iterdir() if (d / "config.yaml").exists()], "no run started"


def test_a_local_ray_on_two_cpus_shares_them_among_the_default_roles_and_refuses_at_once_what_cannot_fit(
        tmp_path, processes):
    two_cpus = {**os.environ, "RAY_OVERRIDE_RESOURCES": json.dumps({"CPU": 2})}  # the local Ray a run starts
    explicit = processes([SWITCHPS, "run", str(small_config(tmp_path / "explicit", worker={"num_cpus": 1})),
                          "--quiet", "--backend", "ray"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=tmp_path / "explicit", env=two_cpus)
    said = " ".join(explicit.communicate(timeout=RUN_TIMEOUT_S)[1].split())
    assert explicit.returncode == 1 and "the local Ray this command started" in said, said
    assert "they would fit with every cluster.ray.*.num_cpus left unset" in said and "waiting" not in said
    launcher = processes([SWITCHPS, "run", str(small_config(tmp_path)), "--quiet", "--backend", "ray"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=two_cpus)
    run_dir, summary = finished(launcher, tmp_path)  # 4 roles at 1 CPU each would not fit: 0.5 each
    assert summary["final_version"] == summary["updates"] == 30
    placed = {e["role"] for e in ray_events(run_dir) if e["event"] == "ray_placed"}
    assert placed == {"ps", "evaluator", "worker-0", "worker-1"}
