"""A protocol is a work rule and an aggregation rule; the registry names each pair.

The work rule (``work_rules``) sets what a worker's order asks (a sample budget, or a time budget with a
max batch); the aggregation rule (``aggregation``) decides which pushes form an update and when. The
core asks the work rule for orders and hands pushes, timers and membership to the aggregation rule;
the effective batch, for the learning-rate rule, takes both. AMB is rounds with a time budget, FMB
rounds with samples: a name is nothing but its pair and its config member (``config.protocol``).
Local steps compose with every pair: a spec with ``local_steps`` runs its pair's aggregation rule over
pushes of ``LocalSteps`` (``local_sgd`` and ``diloco`` are rounds of them, the async names on arrival;
``amb`` with ``local_steps`` is anytime local SGD, ``kasync`` K-async local SGD, and so on).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from switchps.config.optimizer import OptimizerSpec
from switchps.config.protocol import ProtocolSpec
from switchps.ps_server.core.aggregation import AggregationRule, Bounded, EveryK, OnArrival, Rounds, Windowed
from switchps.ps_server.core.events import Batches
from switchps.ps_server.core.work_rules import LocalSteps, Samples, TimeBudget, WorkRule


@dataclass(frozen=True)
class Pair:
    """A protocol name's rules."""

    rule: type[AggregationRule]
    work: type[WorkRule]


PROTOCOLS: dict[str, Pair] = {
    "bsp": Pair(Rounds, Samples), "fmb": Pair(Rounds, Samples), "amb": Pair(Rounds, TimeBudget),
    "asp": Pair(OnArrival, Samples), "ssp": Pair(Bounded, Samples), "kasync": Pair(EveryK, Samples),
    "timed": Pair(Windowed, Samples), "backup": Pair(Rounds, Samples), "local_sgd": Pair(Rounds, Samples),
    "diloco": Pair(Rounds, Samples), "async_local_sgd": Pair(OnArrival, Samples),
    "async_diloco": Pair(OnArrival, Samples),
}
"""Every protocol by name (``names.PROTOCOLS``, in its order): its aggregation rule and its work rule
(wrapped in ``LocalSteps`` when the spec has ``local_steps``: ``work_rule``)."""


@dataclass
class Protocol:
    """The protocol in force: its config member and the two rules built from it."""

    spec: ProtocolSpec
    rule: AggregationRule
    work: WorkRule
    configured: OptimizerSpec
    """The run's optimizer (local SGD's inner one by default)."""

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def local(self) -> bool:
        """Workers take local steps and push what they moved, which the outer optimizer applies."""
        return self.spec.local

    @property
    def asynchronous(self) -> bool:
        """Pushes may be stale by design (the asynchrony momentum rule applies)."""
        return self.rule.asynchronous

    @property
    def measures_batch(self) -> bool:
        """The effective batch is measured (a time budget's steps, a window's updates): the learning rate
        follows it update by update."""
        return self.work.measures_batch or self.rule.measures_batch

    def effective_batch(self, b: Batches) -> float:
        """Samples per update, for the learning-rate rule."""
        return self.rule.effective_batch(b, self.work.samples(b))

    def same_rule(self, new: ProtocolSpec) -> bool:
        """Whether ``new`` runs the aggregation rule in force (a switch keeps its state: ``reconfigure``)."""
        return type(self.rule) is PROTOCOLS[new.name].rule

    def reconfigure(self, new: ProtocolSpec) -> None:
        """Take ``new``'s parameters and work rule, keeping the aggregation rule's state (``same_rule``)."""
        self.spec = self.rule.s = new
        self.work = work_rule(new, self.configured)

    def state_dict(self, now: float) -> dict[str, Any]:
        """The aggregation rule's state (a work rule holds none)."""
        return self.rule.state_dict(now)

    def load_state_dict(self, d: dict[str, Any], now: float) -> None:
        self.rule.load_state_dict(d, now)


def work_rule(s: ProtocolSpec, configured: OptimizerSpec) -> WorkRule:
    """The work rule of ``s``: its pair's, or local steps over it (``configured``: the run's optimizer)."""
    work = PROTOCOLS[s.name].work(s)
    return LocalSteps(s, work, configured) if s.local else work


def make_protocol(s: ProtocolSpec, configured: OptimizerSpec | None = None) -> Protocol:
    """The protocol ``s`` names (``configured``: the run's optimizer; default: the schema's)."""
    configured = configured or OptimizerSpec()
    return Protocol(s, PROTOCOLS[s.name].rule(s), work_rule(s, configured), configured)
