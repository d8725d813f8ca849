"""examples/k8s: the manifests parse, hold the expected objects, and the environment each pod template
gives makes `switchps role` pick that pod's role (the pure logic; no cluster needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from switchps.launch.cluster_env import Role, detect, ps_address, run_dir
from switchps.config.run import parse_config

MANIFEST = Path(__file__).resolve().parent.parent / "examples" / "k8s" / "switchps.yaml"


def docs() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs() if d["kind"] == kind}


def run_config() -> dict[str, Any]:
    raw: dict[str, Any] = yaml.safe_load(by_kind("ConfigMap")["switchps-config"]["data"]["train.yaml"])
    return raw


def test_manifests_have_the_expected_kinds() -> None:
    assert sorted(d["kind"] for d in docs()) == ["ConfigMap", "Job", "Job", "Job", "PersistentVolumeClaim", "Service"]
    assert set(by_kind("Job")) == {"switchps-ps", "switchps-evaluator", "switchps-worker"}
    service = by_kind("Service")["switchps"]
    assert service["spec"]["clusterIP"] == "None"  # headless: each pod gets a DNS name


def test_the_config_map_holds_a_valid_config_with_a_fixed_port() -> None:
    raw = run_config()
    raw["security"] = {"insecure": True}  # the secret file exists only in the pod
    cfg = parse_config(raw)
    assert cfg.cluster.shards[0].endswith(":7070") and cfg.cluster.num_workers == 2


def test_worker_job_runs_one_pod_per_configured_worker() -> None:
    spec = by_kind("Job")["switchps-worker"]["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == run_config()["cluster"]["workers"]


def pods() -> list[tuple[str, int, dict[str, Any]]]:
    """(job name, completion index, pod template) for every pod the Jobs create."""
    return [(name, i, job["spec"]["template"]) for name, job in by_kind("Job").items()
            for i in range(job["spec"]["completions"])]


EXPECTED = {"switchps-ps": "ps", "switchps-evaluator": "evaluator", "switchps-worker": "worker"}


@pytest.mark.parametrize("job, index, template", pods(), ids=lambda v: str(v) if not isinstance(v, dict) else "")
def test_each_pod_env_picks_its_role(job: str, index: int, template: dict[str, Any]) -> None:
    container = template["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    env["JOB_COMPLETION_INDEX"] = str(index)  # Kubernetes sets it in an Indexed Job's pods
    hostname = f"{job}-{index}"  # an Indexed Job's pod host name
    placement = detect(env, hostname)
    assert placement.role == Role(EXPECTED[job], index)  # type: ignore[arg-type]
    assert container["args"][:2] == ["switchps", "role"]
    given = container["args"][container["args"].index("--run-dir") + 1]
    assert run_dir(placement, given, "/runs", "x") == Path("/runs/train")
    # the PS host every pod dials is the PS pod's DNS name under the headless Service
    assert ps_address(placement, run_config()["cluster"]["ps"]) == "switchps-ps-0.switchps:7070"
    assert template["spec"]["subdomain"] == by_kind("Service")["switchps"]["metadata"]["name"]


def test_stateful_set_ordinal_also_gives_the_index() -> None:
    env = {"SWITCHPS_ROLE": "worker", "SWITCHPS_PS_HOST": "switchps-ps-0.switchps"}
    assert detect(env, "switchps-worker-1").role == Role("worker", 1)


@pytest.mark.parametrize("job", sorted(EXPECTED))
def test_pods_mount_the_secret_config_and_run_volume(job: str) -> None:
    spec = by_kind("Job")[job]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
    assert volumes["secret"]["secret"]["secretName"] == "switchps-secret"
    assert volumes["secret"]["secret"]["defaultMode"] == 0o400  # the PS refuses a group/other-readable secret
    assert str(Path(run_config()["security"]["secret_file"]).parent) == mounts["secret"]
    assert volumes["runs"]["persistentVolumeClaim"]["claimName"] in by_kind("PersistentVolumeClaim")
    assert mounts["runs"] == run_config()["output"]["dir"]
    config_arg = spec["containers"][0]["args"][2]
    assert Path(config_arg).parent == Path(mounts["config"]) and volumes["config"]["configMap"]["name"] in by_kind("ConfigMap")
