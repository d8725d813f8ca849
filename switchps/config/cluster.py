"""Where a run's roles are: the PS's address (or its shards'), the workers, how long they wait for each
other, and the Ray placement."""

from __future__ import annotations

from pydantic import Field, ValidationInfo, field_validator, model_validator

from switchps.config.ray_cluster import RaySpec
from switchps.config.schema import MAX_SHARDS, MAX_SIM_WORKERS, MAX_WORKERS, Section, role_of


class Elastic(Section):
    """Elastic membership: the run starts with ``start`` workers; others may join, each with a new index
    below ``max``, at any time; a worker that leaves for good (``cluster.leave_after_s``) is removed from the
    barrier and from N; below ``min`` members training pauses until enough join."""

    min: int = Field(1, ge=1)
    """The fewest members training runs with; below it, pushes wait (the run says it paused)."""
    max: int = Field(ge=1)
    """The most members, and the bound on worker indices: ``[0, max)``."""
    start: int | None = Field(None, ge=1)
    """Workers `switchps run` starts, and training starts once these registered (default ``min``)."""

    @model_validator(mode="after")
    def _ordered(self) -> "Elastic":
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) is above max ({self.max})")
        if self.start is not None and not self.min <= self.start <= self.max:
            raise ValueError(f"start ({self.start}) is outside [min, max] = [{self.min}, {self.max}]")
        return self

    @property
    def starting(self) -> int:
        return self.min if self.start is None else self.start


class Cluster(Section):
    ps: str | list[str] = "127.0.0.1:0"
    """host:port clients reach the PS at; port 0: the PS binds a port the OS picks and publishes the
    address in RUN_DIR/ps.address (`switchps run` passes it to the workers and the evaluator). A list:
    one address per PS shard, shard 0 first (the model is spread over them; see *Sharded PS*)."""
    bind: str | None = None
    """host:port the PS listens on (default: `ps` itself, loopback unless `ps` names another host)."""
    workers: int | list[str] | Elastic = 4
    """Number of local workers, or the list of worker addresses (one per host); at most 1024 (100,000 in a
    simulation). Or elastic bounds, ``{min: M, max: X, start: S}``: workers join and leave while the run
    goes on (see *Elastic workers*)."""
    startup_timeout_s: float = Field(120.0, gt=0)
    """How long the PS waits for every worker to register before starting with those present."""
    reconnect_s: float = Field(60.0, gt=0, le=86400)
    """How long workers and the evaluator retry an unreachable PS before they give up."""
    leave_after_s: float = Field(300.0, gt=0, le=86400)
    """Elastic runs: a member neither pushing nor registering for this long has left for good and is removed
    from N (a fixed-size run keeps a silent worker, excluded, until it comes back)."""
    lease_s: float = Field(10.0, gt=0, le=86400)
    """A worker process holds its index while the PS has heard from it within this long (a push, pull or reply,
    or a push waiting for one): a second process registering at that index meanwhile is refused
    (`ALREADY_EXISTS`, counted) and retries; once the first was silent this long the second takes the index and
    the first's pushes are refused. A restarted worker waits at most this long; keep it above a step's time."""
    max_restarts: int = Field(3, ge=0, le=1000)
    """`switchps run` restarts a PS process that died, from its checkpoint, this many times."""
    ray: RaySpec = Field(default_factory=RaySpec)
    """Placement and restarts under `switchps run --backend ray` (ignored otherwise)."""

    @property
    def num_workers(self) -> int:
        """The workers a run starts with (an elastic run's ``start``)."""
        w = self.workers
        return w if isinstance(w, int) else w.starting if isinstance(w, Elastic) else len(w)

    @property
    def elastic(self) -> Elastic | None:
        return self.workers if isinstance(self.workers, Elastic) else None

    @property
    def max_workers(self) -> int:
        """The bound on worker indices, ``[0, max_workers)``: the count, or an elastic run's ``max``."""
        return self.workers.max if isinstance(self.workers, Elastic) else self.num_workers

    @property
    def shards(self) -> list[str]:
        """Every PS shard's address, shard 0 (the one that decides) first; one for an unsharded PS."""
        return [self.ps] if isinstance(self.ps, str) else list(self.ps)

    @field_validator("workers")
    @classmethod
    def _count(cls, v: int | list[str] | Elastic, info: ValidationInfo) -> int | list[str] | Elastic:
        n = v if isinstance(v, int) else v.max if isinstance(v, Elastic) else len(v)
        if n < 1:
            raise ValueError("need at least one worker")
        if role_of(info) == "simulate" and n > MAX_SIM_WORKERS:
            raise ValueError(f"at most {MAX_SIM_WORKERS} simulated workers, got {n}")
        if role_of(info) != "simulate" and n > MAX_WORKERS:
            raise ValueError(f"at most {MAX_WORKERS} workers, got {n} (a simulation takes up to {MAX_SIM_WORKERS})")
        return v

    @field_validator("ps", "bind")
    @classmethod
    def _address(cls, v: str | list[str] | None) -> str | list[str] | None:
        for a in [] if v is None else [v] if isinstance(v, str) else v:
            host, sep, port = a.rpartition(":")
            if not sep or not host or not port.isdigit() or int(port) > 65535:
                raise ValueError(f"expected host:port, got {a!r}")
        if isinstance(v, list) and not 1 <= len(v) <= MAX_SHARDS:
            raise ValueError(f"expected 1 to {MAX_SHARDS} shard addresses, got {len(v)}")
        if isinstance(v, list) and len(set(v)) < len(v) and not all(a.endswith(":0") for a in v):
            raise ValueError("two shards at one address")
        return v
