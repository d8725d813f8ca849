"""Whether a run's placement group can fit a Ray cluster's nodes, and the CPUs of roles left at the default.

``switchps.launch.ray_backend`` asks Ray for the nodes and reserves the group; this module only reasons about
them (no Ray calls), so its rules are tested without a cluster. A role whose ``num_cpus`` is unset
reserves 1 CPU; on a local Ray that `switchps run` started itself (one node, all the cluster will ever
have), such roles share what the others leave where 1 each would not fit: on a 2-CPU machine the PS, the
evaluator and 4 workers reserve 0.3333 CPU each (Ray's CPU is a reservation, not a limit). A group the
nodes certainly cannot hold is named with the ``cluster.ray.*.num_cpus`` settings that would fit.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable

from switchps.config.ray_cluster import RayRoleSpec, RaySpec

GRAIN = 10_000
"""Ray counts a resource in units of 1/10,000."""
SLACK = 1e-9


def kind(role: str) -> str:
    """A role's section of ``cluster.ray``: ``ps`` for every PS shard (``ps``, ``ps-1``, ...),
    ``evaluator``, ``worker`` for each ``worker-i``."""
    return "ps" if role.startswith("ps") else "evaluator" if role == "evaluator" else "worker"


def role_spec(spec: RaySpec, role: str) -> RayRoleSpec:
    return {"ps": spec.ps, "evaluator": spec.evaluator, "worker": spec.worker}[kind(role)]


def default_cpus(spec: RaySpec, roles: list[str], local_cpus: float | None) -> float:
    """The CPUs of each role whose ``num_cpus`` is unset: 1, or on a local Ray of ``local_cpus`` CPUs
    (``None``: not a local Ray) an equal share of what the other roles leave, where 1 each would not
    fit (rounded down to Ray's unit; 1 if nothing is left, which ``misfit`` then reports)."""
    specs = [role_spec(spec, r) for r in roles]
    unset = sum(s.num_cpus is None for s in specs)
    if local_cpus is None or not unset:
        return 1.0
    share = math.floor((local_cpus - sum(s.num_cpus or 0.0 for s in specs)) / unset * GRAIN) / GRAIN
    return min(1.0, share) if share > 0 else 1.0


def bundles(spec: RaySpec, roles: list[str], local_cpus: float | None = None) -> dict[str, dict[str, float]]:
    """Each role's placement-group bundle, in ``roles``' order (the resources its actor reserves)."""
    cpus = default_cpus(spec, roles, local_cpus)
    out = {}
    for role in roles:
        s = role_spec(spec, role)
        b = {"CPU": cpus if s.num_cpus is None else s.num_cpus, "GPU": s.num_gpus, "memory": float(s.memory or 0),
             **s.resources}
        out[role] = {k: v for k, v in b.items() if v}
    return out


def listed(group: dict[str, dict[str, float]]) -> str:
    """The bundles by role, a run of equal ones of one kind once (``worker-0..63 {'CPU': 1.0}``)."""
    runs: list[tuple[list[str], dict[str, float]]] = []
    for role, b in group.items():
        if runs and runs[-1][1] == b and kind(runs[-1][0][-1]) == kind(role):
            runs[-1][0].append(role)
        else:
            runs.append(([role], b))
    return ", ".join(f"{names[0]}{'..' + names[-1].rpartition('-')[2] if len(names) > 1 else ''} {b}"
                     for names, b in runs)


def total(amounts: Iterable[dict[str, float]]) -> dict[str, float]:
    out: Counter[str] = Counter()
    for a in amounts:
        out.update(a)
    return dict(out)


def holds(node: dict[str, float], need: dict[str, float]) -> bool:
    return all(node.get(k, 0.0) >= v - SLACK for k, v in need.items())


def misfit(group: dict[str, dict[str, float]], nodes: list[dict[str, float]], strategy: str) -> str | None:
    """Why ``group`` (role -> bundle) can never be placed on ``nodes`` (each node's total resources)
    under ``strategy`` (``cluster.ray.strategy``), or None. Only what every placement needs is checked
    (each bundle within one node, all of them for strict_pack; a node each for strict_spread; no more
    in all than the nodes have), so None promises nothing: Ray's own wait decides."""
    if strategy == "strict_spread" and len(group) > len(nodes):
        return f"strict_spread puts each role on its own node: {len(group)} roles, {len(nodes)} node(s)"
    wholes = {"all roles (strict_pack)": total(group.values())} if strategy == "strict_pack" else group
    for who, need in wholes.items():
        if not any(holds(n, need) for n in nodes):
            return f"no node holds {who}'s {need}"
    need, have = total(group.values()), total(nodes)
    short = {k: v for k, v in need.items() if have.get(k, 0.0) < v - SLACK}
    if short:
        return f"the roles ask {short} in all; the nodes have {({k: have.get(k, 0.0) for k in short})}"
    return None


def fitting_cpus(spec: RaySpec, roles: list[str], nodes: list[dict[str, float]],
                 local_cpus: float | None = None) -> str:
    """The ``cluster.ray.*.num_cpus`` settings with which the group would fit ``nodes`` (per ``misfit``),
    as a clause; "" where CPUs alone cannot (a custom resource no node offers, too few nodes)."""
    cpus = [n.get("CPU", 0.0) for n in nodes]
    room = max(cpus, default=0.0) if spec.strategy == "strict_pack" else sum(cpus)
    workers = [r for r in roles if kind(r) == "worker"]
    asked = bundles(spec, roles, local_cpus)
    others = sum(asked[r].get("CPU", 0.0) for r in roles if kind(r) != "worker")
    candidates: list[tuple[str, dict[str, float | None]]] = []
    if local_cpus is not None:
        candidates.append(("every cluster.ray.*.num_cpus left unset (a local Ray's CPUs are then shared)",
                           {"ps": None, "evaluator": None, "worker": None}))
    if workers:
        w = math.floor((room - others) / len(workers) * GRAIN) / GRAIN
        if w > 0:
            candidates.append((f"cluster.ray.worker.num_cpus: {w:g} (the PS's and the evaluator's as they are)",
                               {"worker": w}))
    c = math.floor(room / len(roles) * GRAIN) / GRAIN
    if c > 0:
        candidates.append((f"num_cpus: {c:g} for every role (cluster.ray.ps, .evaluator and .worker)",
                           {"ps": c, "evaluator": c, "worker": c}))
    return "; or with ".join(text for text, change in candidates if fits(spec, roles, nodes, change, local_cpus))


def fits(spec: RaySpec, roles: list[str], nodes: list[dict[str, float]], cpus: dict[str, float | None],
         local_cpus: float | None) -> bool:
    """Whether ``misfit`` finds nothing once the sections named in ``cpus`` take those ``num_cpus``."""
    changed = spec.model_copy(update={k: getattr(spec, k).model_copy(update={"num_cpus": v}) for k, v in cpus.items()})
    return misfit(bundles(changed, roles, local_cpus), nodes, spec.strategy) is None


def unplaceable(spec: RaySpec, roles: list[str], nodes: list[dict[str, float]],
                local_cpus: float | None = None) -> str | None:
    """Why the run's group can never be placed on ``nodes``, with the settings that would fit, or None
    (``local_cpus``: the CPUs of a local Ray that this run started, see ``default_cpus``)."""
    why = misfit(bundles(spec, roles, local_cpus), nodes, spec.strategy)
    if why is None:
        return None
    fix = fitting_cpus(spec, roles, nodes, local_cpus)
    return (f"Ray cannot place the roles ({spec.strategy}) on this cluster: {why}"
            + (f"; they would fit with {fix}" if fix else ""))
