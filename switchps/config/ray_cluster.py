"""The ``cluster.ray`` section of a run config: where `switchps run --backend ray` places each role.

One placement group per run, one bundle per role (the PS, the evaluator, each worker); ``switchps.launch.ray_backend``
reserves it and starts an actor per role in its bundle.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from switchps.config.schema import Section


class RayRoleSpec(Section):
    """What one role's Ray actor reserves: its placement-group bundle (`switchps run --backend ray`)."""

    num_cpus: float | None = Field(None, ge=0, le=1024)
    """CPUs the bundle reserves. Unset: 1, or on a local Ray that `switchps run` started itself (no
    --address) an equal share of its CPUs where 1 each would not fit (``switchps.config.ray_placement``)."""
    num_gpus: float = Field(0.0, ge=0, le=1024)
    memory: int | None = Field(None, gt=0)
    """Bytes of Ray's `memory` resource (a scheduling reservation, not a limit)."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom resources, e.g. `{node_a: 1}` to pin the role to nodes started with that resource."""

    @field_validator("resources")
    @classmethod
    def _custom(cls, v: dict[str, float]) -> dict[str, float]:
        for name, amount in v.items():
            if not name or name in ("CPU", "GPU", "memory", "object_store_memory"):
                raise ValueError(f"{name!r} is not a custom resource (use num_cpus, num_gpus, memory)")
            if not 0 < amount <= 10**6:
                raise ValueError(f"{name}: expected an amount in (0, 1e6], got {amount}")
        return v

    @model_validator(mode="after")
    def _reserves(self) -> "RayRoleSpec":
        if not (self.num_cpus is None or self.num_cpus or self.num_gpus or self.memory or self.resources):
            raise ValueError("reserves nothing: a placement-group bundle needs some resource (e.g. num_cpus: 1)")
        return self


class RaySpec(Section):
    """Where `switchps run --backend ray` places each role: one placement group, one bundle per role."""

    strategy: Literal["pack", "spread", "strict_pack", "strict_spread"] = "pack"
    """The placement group's strategy (Ray's PACK, SPREAD, STRICT_PACK, STRICT_SPREAD)."""
    ps: RayRoleSpec = Field(default_factory=RayRoleSpec)
    evaluator: RayRoleSpec = Field(default_factory=RayRoleSpec)
    worker: RayRoleSpec = Field(default_factory=RayRoleSpec)
    """Each worker's bundle."""
    max_restarts: int = Field(3, ge=0, le=1000)
    """Ray restarts a role's actor (its node lost, the actor killed) this many times; a PS comes back
    from its checkpoint, a worker rejoins."""
    placement_timeout_s: float = Field(60.0, gt=0, le=86400)
    """How long `switchps run` waits for the cluster to reserve the placement group."""
    sync_every_s: float = Field(1.0, gt=0, le=3600)
    """How often the driver collects what each role wrote on its node into the run directory: a lost
    node loses at most this much of its role's logs and records (a PS's checkpoints included)."""
    staging_dir: str | None = None
    """Where on each node a role writes before the driver collects it (default: the node's temporary
    directory); node-local, need not be shared."""
