"""`switchps role`: turn this task's placement (``switchps.launch.cluster_env``) into the role command it runs.

``plan`` returns the ``switchps`` arguments of the existing role command (``ps``, ``evaluator``,
``worker``), which `switchps role` then runs in the same process (no fork, no exec: nothing here
imports TensorFlow). The derived PS address goes in as ``--set cluster.ps=HOST:PORT`` so that the
config the PS records in its run directory says where it served; the PS listens on all interfaces at
that port unless ``cluster.bind`` says otherwise (a node's own name may resolve to a loopback address).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from switchps.launch.cluster_env import Placement, detect, ps_address, resumes, run_dir
from switchps.config.run import load_config


@dataclass(frozen=True)
class Plan:
    """What this task runs: ``argv`` for the ``switchps`` parser, and the placement that chose it."""

    placement: Placement
    argv: list[str]
    run_dir: Path
    resume: bool


def plan(config: str | None, sets: Sequence[str], given_run_dir: str | None, env: Mapping[str, str],
         hostname: str) -> Plan:
    """The role command for the task ``env`` describes (``ConfigError`` if the environment or the
    config does not allow one)."""
    cfg = load_config(config, sets)  # no role checks yet: the role command runs them
    placement = detect(env, hostname, len(cfg.cluster.shards))
    where = run_dir(placement, given_run_dir, cfg.output.dir, cfg.name)
    overrides = list(sets)
    # SLURM derives every shard's host; a pod only shard 0's, so several shards keep the config's names
    if placement.ps_host is not None and (placement.shard_hosts or len(cfg.cluster.shards) == 1):
        hosts = placement.shard_hosts or (placement.ps_host,)
        addresses = [ps_address(replace(placement, ps_host=h), a) for h, a in zip(hosts, cfg.cluster.shards)]
        overrides.append(f"cluster.ps={addresses[0] if len(addresses) == 1 else '[' + ','.join(addresses) + ']'}")
        if placement.role.kind == "ps" and cfg.cluster.bind is None:
            port = addresses[placement.role.index].rpartition(":")[2]
            overrides.append(f"cluster.bind=0.0.0.0:{port}")
    common = [*([config] if config else []), *(a for o in overrides for a in ("--set", o))]
    kind, resume = placement.role.kind, resumes(placement, where)
    if kind == "ps" and placement.role.index > 0:  # a follower shard: shard 0 names what it resumes from
        argv = ["ps", *common, "--run-dir", str(where), "--shard", str(placement.role.index)]
    elif kind == "ps":
        argv = ["ps", *common, *(["--resume", str(where)] if resume else ["--run-dir", str(where)])]
    elif kind == "evaluator":
        argv = ["evaluator", *common, "--run-dir", str(where)]
    else:
        argv = ["worker", *common, "--run-dir", str(where), "--index", str(placement.role.index)]
    return Plan(placement, argv, where, resume)
