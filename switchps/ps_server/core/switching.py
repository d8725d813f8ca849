"""The protocol in force and its changes: a switch waits for a round in flight, then drains the old
protocol into the new one; the learning rate and momentum follow (``rescale``), ramped after a switch;
every switch is recorded for the overhead figure.

A switch is two steps around the core running an effect: ``begin`` returns what the old protocol still
has to do (its drain, or, for the same rule with other parameters, a membership check), and ``complete``
puts the new protocol in force after that has run.
"""

from __future__ import annotations

import math
from typing import Any

from switchps.config import ProtocolSpec, SwitchSpec
from switchps.ps_server.events import Batches, Effect, Membership, Record, SetOptimizer
from switchps.ps_server.overhead import SwitchRecord
from switchps.ps_server.protocols import PROTOCOLS, make_protocol
from switchps.ps_server.rescale import ramp, rescaled, restore_factor

Pending = tuple[ProtocolSpec, str, str, float]
"""A switch decided while a round was in flight: the new spec, reason, policy and when it was decided."""


class Switching:
    """The protocol in force, a switch that waits for its round, the learning-rate scale and momentum."""

    def __init__(self, spec: ProtocolSpec, on_switch: SwitchSpec, momentum: float) -> None:
        self.spec, self.on_switch = spec, on_switch
        self.protocol = make_protocol(spec)
        self.reference = make_protocol(spec)  # the configured protocol, for the learning-rate rule
        self.configured_momentum = self.momentum = momentum
        self.lr_scale = 1.0
        self.pending: Pending | None = None
        self.switched_at: int | None = None  # the version at the last protocol switch, for ``rescale.ramp``
        self.restore = 1.0
        self.switches: list[SwitchRecord] = []
        self.update_times: list[tuple[float, str]] = []

    def lr_factor(self, version: int, factor: float) -> float:
        """The learning-rate factor of update ``version`` (``factor``: the protocol's own, e.g. staleness)."""
        since = None if self.switched_at is None else version - 1 - self.switched_at
        return factor * (1.0 if since is None else ramp(self.on_switch, self.restore, since))

    def updated(self, now: float) -> None:
        self.update_times.append((now, self.spec.name))
        for sw in self.switches:
            if sw.first_update_at is None and sw.to == self.spec.name:
                sw.first_update_at = now

    def begin(self, new: ProtocolSpec, m: Membership, now: float) -> Effect:
        """Start switching to ``new``: what the protocol in force must still do before it leaves."""
        self.pending = None
        if type(self.protocol) is PROTOCOLS[new.name]:  # same rule, other parameters: keep its state
            self.spec = self.protocol.s = new
            return self.protocol.on_membership(m, now)
        return self.protocol.drain(m, now)  # nothing left behind

    def complete(self, new: ProtocolSpec, m: Membership, now: float) -> None:
        """Put ``new`` in force (``begin``'s effect has run; the same rule is in force already)."""
        if self.spec is not new:
            previous, self.spec, self.protocol = self.protocol, new, make_protocol(new)
            self.protocol.enter(previous, m, now)

    def note(self, old: ProtocolSpec, reason: str, policy: str, decided_at: float, step_s: float,
             version: int) -> Record:
        """Record a completed switch from ``old`` (after ``rescaled``)."""
        new = self.spec
        if old.name != new.name:
            self.switches.append(SwitchRecord(decided_at, new.name, step_s))
            self.switched_at = version
            self.restore = restore_factor(self.momentum, self.configured_momentum) \
                if self.on_switch.momentum == "asynchrony" else 1.0
        before = old.model_dump()
        return Record("switch" if old.name != new.name else "reconfigure", {
            "version": version, "reason": reason, "policy": policy, "lr_scale": self.lr_scale,
            "momentum": self.momentum, "from": old.name, "to": new.name,
            "changed": {k: v for k, v in new.model_dump().items() if before[k] != v}})

    def rescaled(self, b: Batches, state: str = "keep") -> SetOptimizer | None:
        """The scale and momentum for the protocol in force, set absolutely, if they changed."""
        scale, momentum = rescaled(self.protocol, self.reference, self.on_switch, self.configured_momentum, b)
        if math.isclose(scale, self.lr_scale, rel_tol=1e-12) and momentum == self.momentum and state == "keep":
            return None
        self.lr_scale, self.momentum = scale, momentum
        return SetOptimizer(scale, momentum if self.configured_momentum else None, state, self.on_switch.state_scale)

    def state_dict(self, now: float) -> dict[str, Any]:
        p = self.pending
        return {"spec": self.spec.model_dump(), "protocol": self.protocol.state_dict(now),
                "lr_scale": self.lr_scale, "momentum": self.momentum,
                "pending": None if p is None else [p[0].model_dump(), p[1], p[2], p[3] - now],
                "switched_at": self.switched_at, "restore": self.restore,
                "switches": [[s.decided_at - now, s.to, s.step_s, None if s.first_update_at is None
                              else s.first_update_at - now] for s in self.switches],
                "update_times": [[t - now, p] for t, p in self.update_times]}

    def load_state_dict(self, d: dict[str, Any], m: Membership, now: float) -> None:
        self.spec = ProtocolSpec.model_validate(d["spec"])
        self.protocol = make_protocol(self.spec)
        self.protocol.enter(None, m, now)
        self.protocol.load_state_dict(d["protocol"], now)
        self.lr_scale, self.momentum = d["lr_scale"], d["momentum"]
        p = d["pending"]
        self.pending = None if p is None else (ProtocolSpec.model_validate(p[0]), p[1], p[2], now + p[3])
        self.switched_at, self.restore = d["switched_at"], d["restore"]
        self.switches = [SwitchRecord(now + at, to, step_s, None if first is None else now + first)
                         for at, to, step_s, first in d["switches"]]
        self.update_times = [(now + t, p) for t, p in d["update_times"]]
