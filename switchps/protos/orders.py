"""A work order's time budget on the wire: proto3 has no None, so ``WorkOrder.time_budget_s`` holds 0 for
"no time budget", while every Python type says None. The PS writes the field through ``to_wire`` and
a worker reads it through ``from_wire``; nothing else touches the 0."""

from __future__ import annotations


def to_wire(time_budget_s: float | None) -> float:
    """The wire's value for a time budget (None: none, sent as 0)."""
    return 0.0 if time_budget_s is None else time_budget_s


def from_wire(time_budget_s: float | None) -> float | None:
    """A received order's time budget (0 on the wire: none); an order that never crossed it (a simulated
    worker's) already says None."""
    return time_budget_s or None
