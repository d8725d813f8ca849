"""The policy interface: a stats snapshot in, an optional decision out.

The controller calls ``Policy.decide`` after every round under BSP/AMB/FMB and
every ``every_k`` updates under ASP/SSP. A policy returns ``None`` (no change)
or a ``Decision``; the controller applies it live, without a restart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from switchps.imports import load_object


@dataclass(frozen=True)
class WorkerStats:
    """One worker's recent behaviour, over the controller's sliding window."""

    step_time_s: float      # mean wall time per step (compute + injected delay + push round trip)
    compute_s: float        # mean compute time per step
    samples: float          # mean samples per step
    throughput: float       # samples per second of step time
    steps: int              # steps in the window


@dataclass(frozen=True)
class Snapshot:
    version: int
    time_s: float                      # since training start
    progress: float                    # fraction of the training length done, 0..1
    protocol: str
    num_workers: int
    active: frozenset[int]
    excluded: frozenset[int]           # taken out of the barrier by a policy
    workers: dict[int, WorkerStats]    # workers with at least one step in the window
    batches: dict[int, int]            # current per-worker sample budget
    train_loss: float | None           # mean training loss over recent updates
    time_budget_s: float | None        # AMB's T, if in force
    epoch: float = 0.0                 # samples applied / training-set size


@dataclass(frozen=True)
class Decision:
    """What to change. Fields left as None/empty are left as they are."""

    reason: str
    protocol: str | None = None                 # switch to bsp | asp | ssp | amb | fmb
    params: dict[str, Any] = field(default_factory=dict)   # protocol fields, e.g. {"staleness": 2}
    batches: dict[int, int] | None = None       # per-worker sample budgets
    time_budget_s: float | None = None          # AMB's T
    exclude: frozenset[int] = frozenset()       # take out of the barrier
    readmit: frozenset[int] = frozenset()       # put back into the barrier


class Policy:
    """Base class: subclasses set ``name`` and implement ``decide``."""

    name: ClassVar[str] = "policy"
    every_k: int = 10   # under ASP/SSP, consult the policy every k updates

    def decide(self, s: Snapshot) -> Decision | None:
        raise NotImplementedError


def load_policy_class(path: str) -> type[Policy]:
    """Import ``package.module:ClassName`` (from the working directory too) and check it is a Policy."""
    try:
        cls = load_object(path)
    except ImportError as e:
        raise ValueError(f"policy {path!r}: cannot import ({e})") from None
    except ValueError as e:
        raise ValueError(f"policy {path!r}: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise ValueError(f"policy {path!r}: not a switchps.policies.base.Policy subclass")
    return cls
