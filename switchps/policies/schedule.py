"""Offline policy: a fixed schedule of protocol phases (Sync-Switch's hybrid)."""

from __future__ import annotations

from typing import Literal

from switchps.policies.base import Decision, Policy, ClusterView

SWITCH_ORDER_DIGITS = {"1": "bsp", "0": "asp"}  # Sync-Switch's --switch-order notation


class Schedule(Policy):
    """Phases of protocols, each lasting a fraction of training, a number of steps, or of epochs.

    ``phases=[{"bsp": 0.05}, {"asp": 0.95}]`` runs BSP for the first 5 % then ASP;
    ``switch_order="101", lengths=[0.1, 0.8, 0.1]`` runs BSP, ASP, BSP.
    The last phase runs to the end of training.
    """

    name = "schedule"

    def __init__(self, phases: list[dict[str, float]] | None = None, switch_order: str | None = None,
                 lengths: list[float] | None = None, unit: Literal["fraction", "steps", "epochs"] = "fraction"
                 ) -> None:
        if (phases is None) == (switch_order is None):
            raise ValueError("give exactly one of phases, switch_order")
        if switch_order is not None:
            if set(switch_order) - set(SWITCH_ORDER_DIGITS) or not lengths or len(lengths) != len(switch_order):
                raise ValueError("switch_order is a string of 1 (bsp) and 0 (asp) with one length per digit")
            phases = [{SWITCH_ORDER_DIGITS[c]: x} for c, x in zip(switch_order, lengths)]
        if not phases or any(len(p) != 1 for p in phases):
            raise ValueError("phases: a list of one-key mappings like {bsp: 0.05}")
        self.phases = [next(iter(p.items())) for p in phases]
        if any(x <= 0 for _, x in self.phases):
            raise ValueError("phase lengths must be positive")
        if unit == "fraction" and sum(x for _, x in self.phases) > 1 + 1e-9:
            raise ValueError("phase fractions add up to more than 1")
        self.unit = unit

    def phase(self, s: ClusterView) -> int:
        at = {"fraction": s.progress, "steps": s.version, "epochs": s.epoch}[self.unit]
        end = 0.0
        for i, (_, length) in enumerate(self.phases):
            end += length
            if at < end - 1e-12:
                return i
        return len(self.phases) - 1

    def decide(self, s: ClusterView) -> Decision | None:
        i = self.phase(s)
        protocol = self.phases[i][0]
        if protocol == s.protocol:
            return None
        return Decision(reason=f"schedule phase {i + 1}/{len(self.phases)}: {protocol}", protocol=protocol)
