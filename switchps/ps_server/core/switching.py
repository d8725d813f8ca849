"""The protocol in force and its changes: a switch waits for a round in flight, then drains the old
protocol into the new one; the learning rate and momentum follow (``rescale``), ramped after a switch;
every switch is recorded for the overhead figure.

A switch is decided (``request``, or ``decided`` for a policy's decision), waits while the protocol in
force is busy with a round (``ready`` says when it no longer is), and then takes two steps around the
core running an effect: ``begin`` returns what the old protocol still has to do (its drain, or, for the
same rule with other parameters, a membership check), and ``complete`` puts the new protocol in force
after that has run, rescales, and records the switch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from pydantic import ValidationError

from switchps.config.optimizer import OptimizerSpec
from switchps.config.protocol import AVERAGING, ProtocolSpec, carried, member, protocol_spec, saved_spec
from switchps.config.policy import SwitchSpec
from switchps.policies.base import Decision
from switchps.ps_server.core.actions import Action, Apply, Record, SetOptimizer
from switchps.ps_server.core.events import Batches, Effect, Membership, Update
from switchps.ps_server.core.overhead import SwitchRecord
from switchps.ps_server.core.protocols import make_protocol
from switchps.ps_server.core.rescale import ramp, rescaled, restore_factor

LOCAL_FIELDS = frozenset({"local_steps", "inner_optimizer", "inner_state", "outer_optimizer"})
"""A spec's local-steps fields, which a switch keeps only under the same name (``Switching.respec``)."""


class Pending(NamedTuple):
    """A switch decided (while a round is in flight, it waits): the new spec, why, by which policy, when."""

    new: ProtocolSpec
    reason: str
    policy: str
    decided_at: float


class Switching:
    """The protocol in force, a switch that waits for its round, the learning-rate scale and momentum."""

    def __init__(self, spec: ProtocolSpec, on_switch: SwitchSpec, momentum: float, members: Membership,
                 targets: Sequence[ProtocolSpec] = (), optimizer: OptimizerSpec | None = None) -> None:
        self.spec, self.on_switch = spec, on_switch
        # the fields given for protocols a switch may reach: the configured protocol's, ``policy.protocols``'
        self.targets = {t.name: t.model_dump(exclude_unset=True) for t in [spec, *targets]}
        self.members = members  # the lifecycle's, as the protocols see it
        self.optimizer = optimizer or OptimizerSpec()  # the run's: gradients', and local SGD's inner default
        self.protocol = make_protocol(spec, self.optimizer)
        self.reference = make_protocol(spec, self.optimizer)  # the configured protocol, for the learning-rate rule
        self.outer = spec.outer() if spec.local else AVERAGING
        """The outer optimizer of the last protocol with local steps in force: movements pushed under it and
        applied after a switch away from it still take it."""
        self.configured_momentum = self.momentum = momentum
        self.lr_scale = 1.0
        self.pending: Pending | None = None
        self.switched_at: int | None = None  # the version at the last protocol switch, for ``rescale.ramp``
        self.restore = 1.0
        self.switches: list[SwitchRecord] = []

    def applied(self, u: Update, version: int, now: float) -> Apply:
        """Update ``version`` applies ``u`` now: its action, with the learning-rate factor in force (the
        protocol's own, e.g. staleness, times the ramp after a switch)."""
        for sw in self.switches:
            sw.applied(self.spec.name, now)
        since = None if self.switched_at is None else version - 1 - self.switched_at
        factor = u.lr_factor * (1.0 if since is None else ramp(self.on_switch, self.restore, since))
        a = u.aggregate
        return Apply(version, a, factor, self.spec.name, self.protocol.work.budget(-1, {}).time_budget_s,
                     now - a.started, self.outer if a.local_steps else None, self.members.num_workers)

    def decided(self, d: Decision, policy: str, now: float) -> tuple[Pending | None, list[Record]]:
        """The protocol or parameters a decision asks for: the switch to make now (``request``), and a
        ``decision_rejected`` record if they are not valid."""
        update = {**d.params, **({"name": d.protocol} if d.protocol else {}),
                  **({"time_budget_s": d.time_budget_s} if d.time_budget_s is not None else {})}
        if not update:
            return None, []
        try:
            new = self.respec(update)
        except ValidationError as err:
            return None, [Record("decision_rejected", {"policy": policy, "reason": d.reason,
                                                       "error": str(err.errors()[0]["msg"])})]
        if new.local and self.members.gradients_only:
            return None, [Record("decision_rejected", {"policy": policy, "reason": d.reason, "error":
                                 f"workers {sorted(self.members.gradients_only)} cannot take local steps"})]
        return self.request(Pending(new, d.reason, policy, now)), []

    def respec(self, update: dict[str, Any]) -> ProtocolSpec:
        """The spec a switch to ``update`` (a name, fields) puts in force: the fields its member shares with
        the spec in force, then those given for it (``targets``), then ``update``'s; a field its member does
        not take is an error (``pydantic.ValidationError``). Local steps are a name's: they go on across a
        switch from local steps to a name that takes them by default (local_sgd -> async_local_sgd) or to
        one the switch gives them (diloco -> amb with ``local_steps``: anytime local SGD), with the inner and
        outer optimizers in force (DiLoCo's AdamW stays); else the new name's own apply (bsp's None would make
        local_sgd a gradient's, and local_sgd's H would give bsp local steps)."""
        name = update.get("name", self.spec.name)
        given = {**self.targets.get(name, {}), **update}
        kept = carried(self.spec.model_dump(), name)
        if name != self.spec.name:
            if self.spec.local and (member(name).model_fields["local_steps"].default or "local_steps" in given):
                kept |= {"inner_optimizer": self.spec.inner(self.optimizer).model_dump(),
                         "outer_optimizer": self.spec.outer().model_dump()}
            else:
                kept = {k: v for k, v in kept.items() if k not in LOCAL_FIELDS}
        return protocol_spec({**kept, **given})

    def request(self, sw: Pending) -> Pending | None:
        """A switch decided: the one to make now, or None if it changes nothing or waits, as ``pending``,
        for the round in flight."""
        if sw.new == self.spec:
            return None
        if self.protocol.rule.busy():
            self.pending = sw
            return None
        return sw

    def ready(self) -> Pending | None:
        """The pending switch, once the protocol in force is no longer busy with a round."""
        return self.pending if self.pending is not None and not self.protocol.rule.busy() else None

    def begin(self, new: ProtocolSpec, now: float) -> Effect:
        """Start switching to ``new``: what the protocol in force must still do before it leaves."""
        self.pending = None
        if self.protocol.same_rule(new):  # same rule, other parameters: keep its state
            self.protocol.reconfigure(new)
            self.spec = new
            return self.protocol.rule.on_membership(self.members, now)
        return self.protocol.rule.drain(self.members, now)  # nothing left behind

    def complete(self, sw: Pending, old: ProtocolSpec, b: Batches, step_s: float, version: int,
                 now: float) -> list[Action]:
        """Put ``sw.new`` in force after ``begin``'s effect has run (the same rule is in force already),
        rescale for it (``b``: the batches now) and record the switch from ``old`` (``step_s``: a worker's
        normal step, for the overhead figure)."""
        new = sw.new
        if self.spec is not new:
            previous, self.spec, self.protocol = self.protocol, new, make_protocol(new, self.optimizer)
            self.protocol.rule.enter(previous.rule, self.members, now)
        if new.local:
            self.outer = new.outer()
        out: list[Action] = [*self.rescaled(b, self.on_switch.optimizer_state if old.name != new.name else "keep")]
        if old.name != new.name:
            self.switches.append(SwitchRecord(sw.decided_at, new.name, step_s))
            self.switched_at = version
            self.restore = restore_factor(self.momentum, self.configured_momentum) \
                if self.on_switch.momentum == "asynchrony" else 1.0
        before = old.model_dump()
        return out + [Record("switch" if old.name != new.name else "reconfigure", {
            "version": version, "reason": sw.reason, "policy": sw.policy, "lr_scale": self.lr_scale,
            "momentum": self.momentum, "from": old.name, "to": new.name,
            "changed": {k: v for k, v in new.model_dump().items() if before.get(k) != v}})]

    def rescaled(self, b: Batches, state: str = "keep") -> list[SetOptimizer]:
        """The scale and momentum for the protocol in force (``b``: the batches now), set absolutely, if they
        changed (``rescale``)."""
        scale, momentum = rescaled(self.protocol, self.reference, self.on_switch, self.configured_momentum, b)
        if math.isclose(scale, self.lr_scale, rel_tol=1e-12) and momentum == self.momentum and state == "keep":
            return []
        self.lr_scale, self.momentum = scale, momentum
        return [SetOptimizer(scale, momentum if self.configured_momentum else None, state, self.on_switch.state_scale)]

    def remeasured(self, b: Batches) -> list[SetOptimizer]:
        """After updates: ``rescaled`` again if the protocol in force measures its batch (``measures_batch``),
        so that its learning rate follows the batches measured (``b``: the batches now)."""
        return self.rescaled(b) if self.protocol.measures_batch else []

    def state_dict(self, now: float) -> dict[str, Any]:
        p = self.pending
        return {"spec": self.spec.model_dump(), "protocol": self.protocol.state_dict(now),
                "lr_scale": self.lr_scale, "momentum": self.momentum,
                "pending": None if p is None else [p.new.model_dump(), p.reason, p.policy, p.decided_at - now],
                "switched_at": self.switched_at, "restore": self.restore, "outer": self.outer.model_dump(),
                "switches": [[s.decided_at - now, s.to, s.step_s, [t - now for t in s.updates]]
                             for s in self.switches]}

    def load_state_dict(self, d: dict[str, Any], now: float) -> None:
        """(After the lifecycle's: the protocol enters the membership it restored.)"""
        self.spec = saved_spec(d["spec"])
        self.protocol = make_protocol(self.spec, self.optimizer)
        self.outer = OptimizerSpec.model_validate(d.get("outer", AVERAGING.model_dump()))
        self.protocol.rule.enter(None, self.members, now)
        self.protocol.load_state_dict(d["protocol"], now)
        self.lr_scale, self.momentum = d["lr_scale"], d["momentum"]
        p = d["pending"]
        self.pending = None if p is None else Pending(saved_spec(p[0]), p[1], p[2], now + p[3])
        self.switched_at, self.restore = d["switched_at"], d["restore"]
        self.switches = [_switch(now, sw, d.get("update_times", [])) for sw in d["switches"]]


def _switch(now: float, saved: list, update_times: list[list]) -> SwitchRecord:
    """A switch's record from a checkpoint (``[decided_at, to, step_s, updates]``); one written before switches
    kept their own updates' times has the first update's time alone, and every update's time beside
    (``update_times``)."""
    at, to, step_s, updates = saved
    sw = SwitchRecord(now + at, to, step_s)
    if isinstance(updates, list):
        sw.updates = [now + t for t in updates]
    elif updates is not None:
        for t, protocol in update_times:
            if t >= updates:
                sw.applied(protocol, now + t)
    return sw
