"""What every config section shares: the strict base class, the bounds on numbers, and the hook through
which the code that builds a run checks what the schema alone cannot see.

The schema imports no role. Whether an optimizer's parameters, a schedule, a model, a dataset's files
or a policy would work is known only to the code that builds them; a command passes that knowledge in
as ``Checks`` (``switchps.checks.PREFLIGHT``) in the validation context, and each section asks it
while pydantic validates, so its problems join the one report of the whole file in the schema's order.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, ValidationInfo

from switchps.problems import Problem, did_you_mean


class Section(BaseModel):
    """A config section: unknown keys and inf/NaN are errors."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


MAX_WORKERS = 1024
"""Each worker is a process and two PS server threads; protobuf counts workers in int32."""
MAX_SHARDS = 64
"""PS shards: each is a process with its own port and its own stream from shard 0."""
MAX_SIM_WORKERS = 100_000
"""A simulation's workers are objects on a virtual clock (10,000 are measured in ``bench/sim_scale.py``)."""
MAX_BATCH = 2**20
"""Samples per step: one step's micro-batches are NumPy arrays built at once."""
MAX_STEPS = 2**31 - 1
"""Model versions and schedule steps: far beyond any run, and within every int32/int64 on the wire."""
MAX_SEED = 2**32 - 1
"""NumPy's legacy seeding (used by keras.utils.set_random_seed) takes [0, 2**32 - 1]."""
MAX_THREADS = 256
"""TensorFlow op threads per process."""

Role = Literal["run", "ps", "worker", "evaluator", "simulate"]
"""The command validating: ``run`` checks everything before the launcher starts a process; ``simulate``
loads the data and the model but opens no connection."""


class Checks(Protocol):
    """What only the code that builds a run can tell about a config: each returns ``(sub-path, message)``
    problems, the sub-path below the field being validated."""

    def optimizer(self, name: str, params: dict[str, float]) -> list[Problem]: ...

    def schedule(self, kind: str, params: dict[str, Any]) -> list[Problem]: ...

    def model(self, framework: str, name: str, kwargs: dict[str, Any], role: Role | None) -> list[Problem]: ...

    def data(self, name: str, path: str | None, role: Role | None) -> list[Problem]: ...

    def policy(self, name: str, kwargs: dict[str, Any]) -> list[Problem]: ...

    def workload(self, cfg: Any, role: Role | None) -> list[Problem]:
        """What only the model built on the data can tell of the whole ``RunConfig`` ``cfg`` (above this
        module), and the host's devices; the paths from its top."""


def role_of(info: ValidationInfo) -> Role | None:
    """The command a config is being validated for, if it said."""
    return (info.context or {}).get("role")


def checks_of(info: ValidationInfo) -> Checks | None:
    """The checks a command passed in, if any (none: the schema alone)."""
    return (info.context or {}).get("checks")


def one_of(v: str, names: Iterable[str], what: str) -> str:
    """``v`` if it is one of ``names`` (the list that builds the thing), else a one-line error."""
    names = list(names)
    if v not in names:
        raise ValueError(f"unknown {what} {v!r}{did_you_mean(v, names)}; expected one of {', '.join(names)}")
    return v
