"""`switchps role`'s pure logic: SLURM host lists and task counts, and environment -> role, PS host,
worker index and run directory for SLURM, Kubernetes and TF_CONFIG; a bad environment is a config error
naming the variable."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from switchps.launch.cluster_env import Role, detect, ps_address, resumes, roles, run_dir
from switchps.launch.hostlist import expand, node_of_rank, tasks_per_node
from switchps.problems import ConfigError
from switchps.launch.role_plan import plan

pytest_plugins = ["slurm_local"]  # slurm_config: an installed SLURM, or a skip (a failure under CI)

HOSTLISTS = {
    "node[01-03,07]": ["node01", "node02", "node03", "node07"],
    "a[1-2],b3": ["a1", "a2", "b3"],
    "gpu-[1-2]-ib": ["gpu-1-ib", "gpu-2-ib"],
    "r[1-2]n[01-02]": ["r1n01", "r1n02", "r2n01", "r2n02"],
    "x[8-11]": ["x8", "x9", "x10", "x11"],
    "n[009-011]": ["n009", "n010", "n011"],
    "login1": ["login1"],
    "n[1-3],m,c[5]": ["n1", "n2", "n3", "m", "c5"],
}
SCONTROL_REJECTS = {"gpu-[1-2]-ib"}  # SLURM 22.05 (Debian 12) refuses a suffix after the bracket


@pytest.mark.parametrize("hostlist", HOSTLISTS)
def test_hostlist_expands(hostlist: str) -> None:
    assert expand(hostlist) == HOSTLISTS[hostlist]


@pytest.mark.parametrize("hostlist", sorted(set(HOSTLISTS) - SCONTROL_REJECTS))
def test_hostlist_matches_scontrol(hostlist: str, slurm_config: dict[str, str]) -> None:
    out = subprocess.run(["scontrol", "show", "hostnames", hostlist], capture_output=True, text=True, timeout=30,
                         env=slurm_config)
    assert out.returncode == 0, out.stderr
    assert expand(hostlist) == out.stdout.split()


@pytest.mark.parametrize("bad", ["", "n[1-3", "n1-3]", "n[3-1]", "n[a-b]", "n[[1]]", "a,,b", "n[1-99999999]"])
def test_bad_hostlist_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="host list"):
        expand(bad)


@pytest.mark.parametrize("spec, counts", [("2(x3),1", [2, 2, 2, 1]), ("5", [5]), ("1,3", [1, 3]),
                                          ("4(x2)", [4, 4])])
def test_tasks_per_node(spec: str, counts: list[int]) -> None:
    assert tasks_per_node(spec) == counts


@pytest.mark.parametrize("bad", ["", "2(x)", "x3", "2(3)", "-1"])
def test_bad_tasks_per_node_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="tasks per node"):
        tasks_per_node(bad)


def test_node_of_rank_places_blocks() -> None:
    nodes, counts = ["a", "b", "c"], [2, 2, 1]
    assert [node_of_rank(r, nodes, counts) for r in range(5)] == ["a", "a", "b", "b", "c"]
    with pytest.raises(ValueError, match="outside the 5 tasks"):
        node_of_rank(5, nodes, counts)


def test_roles_ps_then_evaluator_then_workers() -> None:
    assert roles(4) == [Role("ps"), Role("evaluator"), Role("worker", 0), Role("worker", 1)]
    assert roles(5, shards=2)[:3] == [Role("ps", 0), Role("ps", 1), Role("evaluator")]
    assert roles(5, shards=2)[3:] == [Role("worker", 0), Role("worker", 1)]
    with pytest.raises(ValueError, match="at least 3"):
        roles(2)


def slurm(rank: int, ntasks: int, nodes: str, per_node: str, **extra: str) -> dict[str, str]:
    return {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(ntasks), "SLURM_STEP_NODELIST": nodes,
            "SLURM_STEP_TASKS_PER_NODE": per_node, "SLURM_LOCALID": "0", "SLURM_JOB_ID": "42", **extra}


@pytest.mark.parametrize("rank, role, host", [(0, Role("ps"), "node01"), (1, Role("evaluator"), "node01"),
                                              (2, Role("worker", 0), "node02"), (6, Role("worker", 4), "node07")])
def test_slurm_rank_gives_role_and_ps_host(rank: int, role: Role, host: str) -> None:
    p = detect(slurm(rank, 7, "node[01-03,07]", "2(x3),1"), "ignored")
    assert (p.role, p.host, p.ps_host, p.source) == (role, host, "node01", "slurm")


def test_slurm_job_nodelist_and_tasks_per_node_are_fallbacks() -> None:
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "c[5-6]", "SLURM_TASKS_PER_NODE": "2(x2)"}
    p = detect(env, "c6")
    assert (p.role, p.ps_host, p.host) == (Role("worker", 1), "c5", "c6")


def test_slurm_records_gpus_and_restarts() -> None:
    p = detect(slurm(2, 3, "g1", "3", SLURM_STEP_GPUS="0,1", SLURM_RESTART_COUNT="2"), "g1")
    assert (p.gpus, p.restarts) == ("0,1", 2)
    assert detect(slurm(2, 3, "g1", "3", CUDA_VISIBLE_DEVICES="3"), "g1").gpus == "3"


@pytest.mark.parametrize("env, names", [
    (slurm(0, 4, "n[1-3]", "2(x3)"), "SLURM_NTASKS"),
    (slurm(0, 4, "n[1-2]", "2(x3)"), "SLURM environment"),
    (slurm(5, 4, "n[1-2]", "2(x2)"), "SLURM_PROCID"),
    (slurm(0, 2, "n1", "2"), "SLURM environment"),
    (slurm(0, 4, "n[1-2", "2(x2)"), "SLURM environment"),
    ({"SLURM_PROCID": "x", "SLURM_NTASKS": "4"}, "SLURM_PROCID"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, "SLURM_STEP_NODELIST"),
    (slurm(0, 4, "n[1-2]", "2(x2)", SLURM_DISTRIBUTION="cyclic"), "SLURM_DISTRIBUTION"),
    ({"SWITCHPS_ROLE": "boss", "SWITCHPS_PS_HOST": "p"}, "SWITCHPS_ROLE"),
    ({"SWITCHPS_ROLE": "worker"}, "SWITCHPS_PS_HOST"),
    ({"TF_CONFIG": "[1]"}, "TF_CONFIG"),
    ({"TF_CONFIG": json.dumps({"task": {"type": "chief", "index": 0}})}, "TF_CONFIG"),
    ({}, "no cluster environment"),
])
def test_bad_env_is_a_config_error_naming_the_variable(env: dict[str, str], names: str) -> None:
    with pytest.raises(ConfigError) as e:
        detect(env, "worker-x")
    assert any(names in p for p in e.value.problems), e.value.problems


@pytest.mark.parametrize("env, hostname, role", [
    ({"SWITCHPS_ROLE": "worker", "JOB_COMPLETION_INDEX": "3"}, "switchps-worker-3-abcde", Role("worker", 3)),
    ({"SWITCHPS_ROLE": "worker"}, "switchps-worker-7", Role("worker", 7)),
    ({"SWITCHPS_ROLE": "ps", "JOB_COMPLETION_INDEX": "0"}, "switchps-ps-0", Role("ps")),
    ({"SWITCHPS_ROLE": "evaluator"}, "switchps-evaluator-0", Role("evaluator")),
])
def test_k8s_pod_index_gives_role(env: dict[str, str], hostname: str, role: Role) -> None:
    p = detect({**env, "SWITCHPS_PS_HOST": "switchps-ps-0.switchps"}, hostname)
    assert (p.role, p.ps_host, p.source) == (role, "switchps-ps-0.switchps", "k8s")


def test_k8s_without_an_index_is_refused() -> None:
    with pytest.raises(ConfigError, match="ORDINAL"):
        detect({"SWITCHPS_ROLE": "worker", "SWITCHPS_PS_HOST": "p"}, "mypod")


def test_tf_config_names_the_role() -> None:
    tf = {"cluster": {"ps": ["h:1"], "worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 1}}
    p = detect({"TF_CONFIG": json.dumps(tf)}, "b")
    assert (p.role, p.ps_host, p.source) == (Role("worker", 1), None, "tf_config")


def test_slurm_wins_over_k8s_and_tf_config() -> None:
    env = {**slurm(1, 3, "n1", "3"), "SWITCHPS_ROLE": "ps", "TF_CONFIG": "{}"}
    assert detect(env, "n1").role == Role("evaluator")


def test_ps_address_takes_the_configured_port() -> None:
    p = detect(slurm(2, 3, "n[1-2]", "1,2"), "n2")
    assert ps_address(p, "0.0.0.0:7070") == "n1:7070"
    with pytest.raises(ConfigError, match="cluster.ps.*port 0"):
        ps_address(p, "127.0.0.1:0")


def test_run_dir_from_the_slurm_job_id(tmp_path: Path) -> None:
    p = detect(slurm(0, 3, "n1", "3"), "n1")
    assert run_dir(p, None, "runs", "train") == Path("runs/train-slurm42")
    assert run_dir(p, str(tmp_path), "runs", "train") == tmp_path
    k8s = detect({"SWITCHPS_ROLE": "ps", "SWITCHPS_PS_HOST": "p"}, "ps-0")
    with pytest.raises(ConfigError, match="--run-dir"):
        run_dir(k8s, None, "runs", "train")


def test_ps_resumes_only_a_requeued_run(tmp_path: Path) -> None:
    first, requeued = detect(slurm(0, 3, "n1", "3"), "n1"), detect(slurm(0, 3, "n1", "3", SLURM_RESTART_COUNT="1"), "n1")
    worker = detect(slurm(2, 3, "n1", "3", SLURM_RESTART_COUNT="1"), "n1")
    assert not resumes(requeued, tmp_path)  # nothing there yet
    (tmp_path / "config.yaml").write_text("name: x\n")
    assert resumes(requeued, tmp_path) and not resumes(first, tmp_path) and not resumes(worker, tmp_path)


CONFIG = Path(__file__).resolve().parent.parent / "examples" / "slurm" / "train.yaml"


def test_plan_gives_each_rank_its_role_command(tmp_path: Path) -> None:
    argv = {r: plan(str(CONFIG), [], str(tmp_path), slurm(r, 4, "n[1-2]", "2(x2)"), "n1").argv for r in range(4)}
    assert argv[0][0] == "ps" and argv[0][-2:] == ["--run-dir", str(tmp_path)]
    assert "cluster.bind=0.0.0.0:7070" in argv[0]
    assert argv[1][0] == "evaluator" and argv[3][0] == "worker" and argv[3][-2:] == ["--index", "1"]
    assert all("cluster.ps=n1:7070" in a for a in argv.values())


def test_plan_resumes_the_ps_after_a_requeue(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("name: x\n")
    p = plan(str(CONFIG), [], str(tmp_path), slurm(0, 4, "n1", "4", SLURM_RESTART_COUNT="1"), "n1")
    assert p.resume and p.argv[-2:] == ["--resume", str(tmp_path)]


def test_plan_refuses_port_zero(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cluster.ps"):
        plan(str(CONFIG), ["cluster.ps=127.0.0.1:0"], str(tmp_path), slurm(0, 4, "n1", "4"), "n1")


def test_plan_gives_the_first_ranks_to_the_ps_shards_each_on_its_node_and_port(tmp_path: Path) -> None:
    shards = "cluster.ps=[0.0.0.0:7070,0.0.0.0:7071,0.0.0.0:7072]"
    argv = {r: plan(str(CONFIG), [shards], str(tmp_path), slurm(r, 6, "n[1-3]", "2(x3)"), "n1").argv
            for r in range(6)}
    assert argv[0][0] == "ps" and "--shard" not in argv[0] and "cluster.bind=0.0.0.0:7070" in argv[0]
    assert argv[1][-2:] == ["--shard", "1"] and "cluster.bind=0.0.0.0:7071" in argv[1]
    assert argv[2][-2:] == ["--shard", "2"] and "cluster.bind=0.0.0.0:7072" in argv[2]
    assert argv[3][0] == "evaluator" and argv[5][0] == "worker" and argv[5][-2:] == ["--index", "1"]
    assert all("cluster.ps=[n1:7070,n1:7071,n2:7072]" in a for a in argv.values()), "shard k on rank k's node"



def test_a_pod_of_a_sharded_ps_keeps_the_shard_addresses_the_config_names(tmp_path: Path) -> None:
    shards = "cluster.ps=[switchps-ps-0.switchps:7070,switchps-ps-1.switchps:7070]"
    env = {"SWITCHPS_ROLE": "ps", "JOB_COMPLETION_INDEX": "1", "SWITCHPS_PS_HOST": "switchps-ps-0.switchps"}
    p = plan(str(CONFIG), [shards], str(tmp_path), env, "switchps-ps-1")
    assert p.argv[-2:] == ["--shard", "1"]
    assert [a for a in p.argv if a.startswith("cluster.ps=")] == [shards], "the config's, not one derived"
