"""The learning-rate scale and momentum in force under a protocol, computed absolutely.

The configured protocol over all workers is the reference: it runs at the
configured learning rate and momentum (scale 1). Under any other protocol the
scale follows from that protocol's effective batch (``Protocol.effective_batch``)
against the reference's, by the ``on_switch.lr`` rule, and from the momentum
rule. Nothing depends on which switches came before or on who happened to be
active at the time, so a round trip BSP -> ASP -> BSP lands exactly where it
started however membership changed in between.
"""

from __future__ import annotations

from switchps.config.run import SwitchSpec
from switchps.ps_server.core.events import Batches
from switchps.ps_server.core.protocols import Protocol


def lr_rule_factor(rule: str | float, ratio: float) -> float:
    """The ``on_switch.lr`` rule for an effective batch ``ratio`` = current / reference."""
    if rule == "keep" or ratio == 1.0:
        return 1.0
    if rule == "linear":
        return ratio
    return float(rule) if ratio > 1.0 else 1.0 / float(rule)


def asynchrony_momentum(momentum: float, workers: int) -> float:
    """Explicit momentum that, with the implicit 1 - 1/N of N asynchronous workers, adds up to ``momentum``."""
    return max(0.0, momentum - (1.0 - 1.0 / workers))


def momentum_in_force(current: Protocol, reference: Protocol, on_switch: SwitchSpec, configured: float,
                      num_workers: int) -> float:
    """The explicit momentum under ``current``: the configured one, lowered by the asynchrony rule when
    ``current`` is asynchronous and the reference is not (the rule only ever lowers what was configured)."""
    if on_switch.momentum == "keep" or not current.asynchronous or reference.asynchronous:
        return configured
    return asynchrony_momentum(configured, num_workers)


def lr_scale(current: Protocol, reference: Protocol, on_switch: SwitchSpec, configured_momentum: float,
             b: Batches) -> float:
    """The multiplier on the configured learning rate while ``current`` is in force.

    The batch rule times (1 - momentum in force) / (1 - configured momentum), so that
    lr / (1 - momentum) is kept when the momentum rule lowers the momentum.
    """
    ratio = current.effective_batch(b) / reference.effective_batch(b)
    scale = lr_rule_factor(on_switch.lr, ratio)
    mu = momentum_in_force(current, reference, on_switch, configured_momentum, b.num_workers)
    return scale * restore_factor(mu, configured_momentum) if on_switch.momentum == "asynchrony" else scale


def restore_factor(mu: float, configured: float) -> float:
    """(1 - mu) / (1 - configured): what the asynchrony rule multiplies the learning rate by."""
    return (1.0 - mu) / (1.0 - configured) if mu != configured else 1.0


def ramp(on_switch: SwitchSpec, restore: float, since: int) -> float:
    """The factor on the learning rate ``since`` updates after a protocol switch: the warm-up's
    (since + 1) / N, and a restore of ``restore`` reached linearly over ``restore_updates``."""
    f = 1.0
    if since < on_switch.warmup_updates:
        f *= (since + 1) / on_switch.warmup_updates
    if since < on_switch.restore_updates and restore != 1.0:
        f *= (1.0 + (restore - 1.0) * since / on_switch.restore_updates) / restore
    return f


def rescaled(current: Protocol, reference: Protocol, on_switch: SwitchSpec, configured_momentum: float,
             b: Batches) -> tuple[float, float]:
    """The learning-rate scale and the momentum in force under ``current``."""
    mu = momentum_in_force(current, reference, on_switch, configured_momentum, b.num_workers)
    return lr_scale(current, reference, on_switch, configured_momentum, b), mu
