"""A protocol is a work rule and an aggregation rule; the registry names each pair.

The work rule (``work_rules``) sets what a worker's order asks (a sample budget, or a time budget with a
max batch); the aggregation rule (``aggregation``) decides which pushes form an update and when. The
core asks the work rule for orders and hands pushes, timers and membership to the aggregation rule;
the effective batch, for the learning-rate rule, takes both. AMB is rounds with a time budget, FMB
rounds with samples: a name is nothing but its pair and its config member (``config.protocol``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from switchps.config.protocol import ProtocolSpec
from switchps.ps_server.core.aggregation import AggregationRule, Bounded, EveryK, OnArrival, Rounds, Windowed
from switchps.ps_server.core.events import Batches
from switchps.ps_server.core.work_rules import Samples, TimeBudget, WorkRule


@dataclass(frozen=True)
class Pair:
    """A protocol name's rules."""

    rule: type[AggregationRule]
    work: type[WorkRule]


PROTOCOLS: dict[str, Pair] = {
    "bsp": Pair(Rounds, Samples), "fmb": Pair(Rounds, Samples), "amb": Pair(Rounds, TimeBudget),
    "asp": Pair(OnArrival, Samples), "ssp": Pair(Bounded, Samples), "kasync": Pair(EveryK, Samples),
    "timed": Pair(Windowed, Samples), "backup": Pair(Rounds, Samples),
}
"""Every protocol by name (``names.PROTOCOLS``, in its order): its aggregation rule and its work rule."""


@dataclass
class Protocol:
    """The protocol in force: its config member and the two rules built from it."""

    spec: ProtocolSpec
    rule: AggregationRule
    work: WorkRule

    @property
    def name(self) -> str:
        return self.spec.name

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
        self.work = PROTOCOLS[new.name].work(new)

    def state_dict(self, now: float) -> dict[str, Any]:
        """The aggregation rule's state (a work rule holds none)."""
        return self.rule.state_dict(now)

    def load_state_dict(self, d: dict[str, Any], now: float) -> None:
        self.rule.load_state_dict(d, now)


def make_protocol(s: ProtocolSpec) -> Protocol:
    pair = PROTOCOLS[s.name]
    return Protocol(s, pair.rule(s), pair.work(s))
