"""The policy interface: a frozen view of the cluster in, an optional decision out.

The core calls ``Policy.decide`` after every update of a round-based protocol and
every ``policy.every_k`` updates otherwise. A policy returns ``None`` (no change)
or a ``Decision``, which the core applies itself, live, without a restart. The
flow is one way: a policy never calls back into the PS. It gets its settings at
construction, and whatever it keeps between calls is plain data that
``state_dict`` returns, so a checkpoint can hold it.
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
class ClusterView:
    """What a policy sees when it is consulted."""

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
    local_steps: int | None = None     # H, if the protocol in force takes local steps


@dataclass(frozen=True)
class Decision:
    """What to change. Fields left as None/empty are left as they are."""

    reason: str
    protocol: str | None = None                 # switch to bsp | asp | ssp | amb | fmb | kasync | timed | backup
    params: dict[str, Any] = field(default_factory=dict)   # protocol fields, e.g. {"staleness": 2}
    batches: dict[int, int] | None = None       # per-worker sample budgets
    time_budget_s: float | None = None          # AMB's T
    exclude: frozenset[int] = frozenset()       # take out of the barrier
    readmit: frozenset[int] = frozenset()       # put back into the barrier


class Policy:
    """Base class: subclasses set ``name`` and implement ``decide``; stateful ones extend ``state_dict``."""

    name: ClassVar[str] = "policy"

    def decide(self, s: ClusterView) -> Decision | None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        pass


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
