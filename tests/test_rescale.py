"""The learning-rate scale and momentum under a protocol, computed absolutely from the configured one."""

from __future__ import annotations

import pytest

from switchps.config.protocol import protocol_spec
from switchps.config.run import SwitchSpec
from switchps.ps_server.core.events import Batches
from switchps.ps_server.core.protocols import Protocol, make_protocol
from switchps.ps_server.core.rescale import lr_scale, momentum_in_force


def proto(name: str, **fields) -> Protocol:
    return make_protocol(protocol_spec({"name": name, "batch": 16, **fields}))


BSP, ASP, AMB = proto("bsp"), proto("asp"), proto("amb", time_budget_s=1.0)
EIGHT = Batches(8, {})


def scale(current: Protocol, reference: Protocol = BSP, b: Batches = EIGHT, mu: float = 0.9,
          **on_switch) -> float:
    return lr_scale(current, reference, SwitchSpec(**on_switch), mu, b)


def test_the_configured_protocol_runs_at_the_configured_rate():
    assert scale(BSP) == scale(ASP, ASP) == scale(AMB, AMB, Batches(8, {}, step_samples=3.0)) == 1.0


def test_linear_rule_and_factor_rule_against_the_reference():
    assert scale(ASP) == pytest.approx(1 / 8)                  # 8 x 16 -> 16 samples per update
    assert scale(BSP, ASP) == pytest.approx(8.0)
    assert scale(ASP, lr=16.0) == pytest.approx(1 / 16) and scale(BSP, ASP, lr=16.0) == 16.0
    assert scale(ASP, lr="keep") == 1.0


def test_amb_uses_the_measured_mean_batch_not_the_nominal_one():
    assert AMB.effective_batch(Batches(8, {})) == 128
    assert scale(AMB, b=Batches(8, {}, step_samples=10.0)) == pytest.approx(80 / 128)
    assert proto("bsp").effective_batch(Batches(8, {}, step_samples=10.0)) == 128, \
        "a measured step means nothing to BSP (and a T left over from AMB cannot reach it: it takes none)"


def test_backup_workers_dynamic_batches_kasync_and_timed():
    assert scale(proto("bsp", backup_workers=2)) == pytest.approx(6 / 8)
    assert scale(BSP, b=Batches(4, {0: 4, 1: 20, 2: 20, 3: 20})) == 1.0, "dynamic batching holds the sum"
    assert scale(proto("kasync", k=4)) == pytest.approx(4 / 8)
    assert scale(proto("kasync")) == 1.0, "K = N keeps the global batch (GBA)"
    timed = proto("timed", window_s=1.0)
    assert scale(timed, b=Batches(8, {}, update_samples=32.0)) == pytest.approx(32 / 128)


def test_momentum_rule_keeps_lr_over_one_minus_momentum_and_only_lowers():
    on = {"momentum": "asynchrony"}
    assert momentum_in_force(ASP, BSP, SwitchSpec(**on), 0.9, 8) == pytest.approx(0.025)
    assert scale(ASP, **on) == pytest.approx(1 / 8 * (1 - 0.025) / (1 - 0.9))
    assert momentum_in_force(BSP, ASP, SwitchSpec(**on), 0.9, 8) == 0.9, "never raised above the configured"
    assert scale(BSP, ASP, **on) == pytest.approx(8.0)
