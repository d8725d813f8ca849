"""The learning-rate scale and momentum under a protocol, computed absolutely from the configured one."""

from __future__ import annotations

import pytest

from switchps.config import ProtocolSpec, SwitchSpec
from switchps.ps_server.rescale import Batches, effective_batch, lr_scale, momentum_in_force

BSP, ASP = ProtocolSpec(name="bsp", batch=16), ProtocolSpec(name="asp", batch=16)
AMB = ProtocolSpec(name="amb", batch=16, time_budget_s=1.0)
EIGHT = Batches(8, {})


def scale(spec: ProtocolSpec, reference: ProtocolSpec = BSP, b: Batches = EIGHT, mu: float = 0.9,
          **on_switch) -> float:
    return lr_scale(spec, reference, SwitchSpec(**on_switch), mu, b)


def test_the_configured_protocol_runs_at_the_configured_rate():
    assert scale(BSP) == scale(ASP, ASP) == scale(AMB, AMB, Batches(8, {}, amb_mean=3.0)) == 1.0


def test_linear_rule_and_factor_rule_against_the_reference():
    assert scale(ASP) == pytest.approx(1 / 8)                  # 8 x 16 -> 16 samples per update
    assert scale(BSP, ASP) == pytest.approx(8.0)
    assert scale(ASP, lr=16.0) == pytest.approx(1 / 16) and scale(BSP, ASP, lr=16.0) == 16.0
    assert scale(ASP, lr="keep") == 1.0


def test_amb_uses_the_measured_mean_batch_not_the_nominal_one():
    assert effective_batch(AMB, Batches(8, {})) == 128
    assert scale(AMB, b=Batches(8, {}, amb_mean=10.0)) == pytest.approx(80 / 128)


def test_backup_workers_and_dynamic_batches():
    backup = ProtocolSpec(name="bsp", batch=16, backup_workers=2)
    assert scale(backup) == pytest.approx(6 / 8)
    assert scale(BSP, b=Batches(4, {0: 4, 1: 20, 2: 20, 3: 20})) == 1.0, "dynamic batching holds the sum"


def test_momentum_rule_keeps_lr_over_one_minus_momentum_and_only_lowers():
    on = {"momentum": "asynchrony"}
    assert momentum_in_force(ASP, BSP, SwitchSpec(**on), 0.9, 8) == pytest.approx(0.025)
    assert scale(ASP, **on) == pytest.approx(1 / 8 * (1 - 0.025) / (1 - 0.9))
    assert momentum_in_force(BSP, ASP, SwitchSpec(**on), 0.9, 8) == 0.9, "never raised above the configured"
    assert scale(BSP, ASP, **on) == pytest.approx(8.0)
