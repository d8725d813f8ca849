"""Offline policy: a fixed schedule of protocol phases (Sync-Switch's hybrid)."""

from __future__ import annotations

from typing import Any, Literal

from switchps import names
from switchps.config.protocol import member
from switchps.policies.base import Decision, Policy, ClusterView

SWITCH_ORDER_DIGITS = {"1": "bsp", "0": "asp"}  # Sync-Switch's --switch-order notation


class Schedule(Policy):
    """Phases of protocols, each lasting a fraction of training, a number of steps, or of epochs.

    ``phases=[{"bsp": 0.05}, {"asp": 0.95}]`` runs BSP for the first 5 % then ASP;
    ``switch_order="101", lengths=[0.1, 0.8, 0.1]`` runs BSP, ASP, BSP.
    The last phase runs to the end of training. A phase may also set protocol fields, put in force when it
    begins: post-local SGD (Lin et al., 2020), BSP until the first learning-rate decay at update 3,000,
    then local SGD with H = 16, is ``phases=[{"bsp": 3000}, {"local_sgd": 1, "local_steps": 16}],
    unit="steps"``; ``[{"local_sgd": 0.5, "local_steps": 4}, {"local_sgd": 0.5, "local_steps": 16}]``
    changes H halfway.
    """

    name = "schedule"

    def __init__(self, phases: list[dict[str, Any]] | None = None, switch_order: str | None = None,
                 lengths: list[float] | None = None, unit: Literal["fraction", "steps", "epochs"] = "fraction"
                 ) -> None:
        if (phases is None) == (switch_order is None):
            raise ValueError("give exactly one of phases, switch_order")
        if switch_order is not None:
            if set(switch_order) - set(SWITCH_ORDER_DIGITS) or not lengths or len(lengths) != len(switch_order):
                raise ValueError("switch_order is a string of 1 (bsp) and 0 (asp) with one length per digit")
            phases = [{SWITCH_ORDER_DIGITS[c]: x} for c, x in zip(switch_order, lengths)]
        if not phases or any(len([k for k in p if k in names.PROTOCOLS]) != 1 for p in phases):
            raise ValueError("phases: a list of mappings like {bsp: 0.05}, one-key but for the protocol fields a "
                             "phase sets ({local_sgd: 0.5, local_steps: 16})")
        self.phases = [_phase(p) for p in phases]
        for name, _, fields in self.phases:
            if unknown := sorted(set(fields) - set(member(name).model_fields)):
                raise ValueError(f"phase {name}: {name} takes no {', '.join(unknown)}")
        if any(x <= 0 for _, x, _ in self.phases):
            raise ValueError("phase lengths must be positive")
        if unit == "fraction" and sum(x for _, x, _ in self.phases) > 1 + 1e-9:
            raise ValueError("phase fractions add up to more than 1")
        self.unit = unit
        self._entered: int | None = None  # the phase the last call saw

    def phase(self, s: ClusterView) -> int:
        at = {"fraction": s.progress, "steps": s.version, "epochs": s.epoch}[self.unit]
        end = 0.0
        for i, (_, length, _) in enumerate(self.phases):
            end += length
            if at < end - 1e-12:
                return i
        return len(self.phases) - 1

    def decide(self, s: ClusterView) -> Decision | None:
        """The phase's protocol if another is in force, and its fields when the phase begins."""
        i = self.phase(s)
        protocol, _, fields = self.phases[i]
        entered, self._entered = i != self._entered, i
        if protocol == s.protocol and not (entered and fields):
            return None
        return Decision(reason=f"schedule phase {i + 1}/{len(self.phases)}: {protocol}"
                               + "".join(f", {k} {v}" for k, v in fields.items()), protocol=protocol, params=fields)

    def state_dict(self) -> dict[str, Any]:
        return {"entered": self._entered}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self._entered = d.get("entered")


def _phase(p: dict[str, Any]) -> tuple[str, float, dict[str, Any]]:
    """A phase as (protocol, length, the protocol fields it sets)."""
    name = next(k for k in p if k in names.PROTOCOLS)
    return name, p[name], {k: v for k, v in p.items() if k != name}
