"""The placement rules of `switchps run --backend ray`, without a cluster: the CPUs of roles left at the
default, whether a group can fit a cluster's nodes, and the settings named when it cannot."""

from __future__ import annotations

import pytest

from switchps.config.ray_cluster import RaySpec
from switchps.config.ray_placement import bundles, listed, misfit, unplaceable

ROLES = ["ps", "evaluator", *(f"worker-{i}" for i in range(4))]
TWO_CPUS = [{"CPU": 2.0, "memory": 8e9, "node:127.0.0.1": 1.0}]


def spec(**sections) -> RaySpec:
    return RaySpec.model_validate(sections)


def test_a_local_ray_shares_its_cpus_among_the_roles_left_at_the_default():
    assert bundles(spec(), ROLES, local_cpus=2.0) == {r: {"CPU": 0.3333} for r in ROLES}, "6 roles on 2 CPUs"
    assert bundles(spec(), ROLES, local_cpus=16.0)["worker-0"] == {"CPU": 1.0}, "1 each where that fits"
    assert bundles(spec(), ROLES)["ps"] == {"CPU": 1.0}, "a cluster joined: 1 each"
    mixed = bundles(spec(ps={"num_cpus": 1}, worker={"num_gpus": 1}), ROLES, local_cpus=2.0)
    assert mixed["ps"] == {"CPU": 1.0}, "a setting is kept"
    assert mixed["worker-3"] == {"CPU": 0.2, "GPU": 1.0} and mixed["evaluator"] == {"CPU": 0.2}, "the rest share 1"
    assert unplaceable(spec(), ROLES, TWO_CPUS, local_cpus=2.0) is None


@pytest.mark.parametrize("sections, nodes, problem", [
    ({}, TWO_CPUS, "the roles ask {'CPU': 6.0} in all; the nodes have {'CPU': 2.0}"),
    ({"ps": {"resources": {"node_a": 1}}}, TWO_CPUS * 6, "no node holds ps's {'CPU': 1.0, 'node_a': 1.0}"),
    ({"strategy": "strict_pack"}, [{"CPU": 4.0}] * 2, "no node holds all roles (strict_pack)'s {'CPU': 6.0}"),
    ({"strategy": "strict_spread"}, [{"CPU": 4.0}] * 5, "on its own node: 6 roles, 5 node(s)"),
])
def test_a_group_the_nodes_cannot_hold_is_named(sections, nodes, problem):
    why = misfit(bundles(spec(**sections), ROLES), nodes, spec(**sections).strategy)
    assert why is not None and problem in why, why
    assert misfit(bundles(spec(**sections), ROLES), [{"CPU": 8.0, "node_a": 1.0}] * 6, spec(**sections).strategy) \
        is None, "the same group on room enough"


def test_the_error_names_the_num_cpus_settings_that_would_fit():
    joined = unplaceable(spec(ps={"num_cpus": 0.5}, evaluator={"num_cpus": 0.5}), ROLES, TWO_CPUS)
    assert joined is not None and joined.endswith(
        "they would fit with cluster.ray.worker.num_cpus: 0.25 (the PS's and the evaluator's as they are); "
        "or with num_cpus: 0.3333 for every role (cluster.ray.ps, .evaluator and .worker)")
    local = unplaceable(spec(worker={"num_cpus": 1}), ROLES, TWO_CPUS, local_cpus=2.0)
    assert local is not None and "they would fit with every cluster.ray.*.num_cpus left unset" in local
    pinned = unplaceable(spec(ps={"resources": {"node_a": 1}}), ROLES, TWO_CPUS)
    assert pinned is not None and "would fit" not in pinned, "no CPU setting offers node_a"


def test_the_roles_asked_for_are_listed_a_run_of_equal_bundles_once():
    group = bundles(spec(ps={"num_cpus": 2}), ["ps", "ps-1", "evaluator", *(f"worker-{i}" for i in range(64))])
    assert listed(group) == "ps..1 {'CPU': 2.0}, evaluator {'CPU': 1.0}, worker-0..63 {'CPU': 1.0}"
    assert RaySpec.model_validate({"worker": {}}).worker.num_cpus is None, "unset: a CPU, or a local share"
    with pytest.raises(ValueError, match="reserves nothing"):
        RaySpec.model_validate({"worker": {"num_cpus": 0}})
