"""Offline schedules, the policy registry, and user policies loaded by import path."""

from __future__ import annotations

import re
import sys
import textwrap

import pytest

from switchps.checks import PREFLIGHT
from switchps.config.run import ConfigError, parse_config
from switchps.policies.base import ClusterView
from switchps.policies.registry import make_policy
from switchps.policies.schedule import Schedule


def snap(protocol: str = "bsp", progress: float = 0.0, version: int = 0, epoch: float = 0.0) -> ClusterView:
    return ClusterView(version=version, time_s=0.0, progress=progress, protocol=protocol, num_workers=2,
                    active=frozenset({0, 1}), excluded=frozenset(), workers={}, batches={0: 8, 1: 8},
                    train_loss=None, time_budget_s=None, epoch=epoch)


def test_schedule_by_fraction():
    s = Schedule(phases=[{"bsp": 0.05}, {"asp": 0.95}])
    assert s.decide(snap("bsp", 0.0)) is None
    assert s.decide(snap("bsp", 0.049)) is None
    d = s.decide(snap("bsp", 0.05))
    assert d.protocol == "asp" and "phase 2/2" in d.reason
    assert s.decide(snap("asp", 0.99)) is None
    assert s.decide(snap("asp", 1.0)) is None, "the last phase runs to the end"


def test_schedule_starts_in_its_first_phase():
    assert Schedule(phases=[{"bsp": 0.5}, {"asp": 0.5}]).decide(snap("asp", 0.0)).protocol == "bsp"


def test_switch_order_101():
    s = Schedule(switch_order="101", lengths=[0.1, 0.8, 0.1])
    assert [s.phases[i][0] for i in range(3)] == ["bsp", "asp", "bsp"]
    assert s.decide(snap("bsp", 0.5)).protocol == "asp"
    assert s.decide(snap("asp", 0.95)).protocol == "bsp"


def test_schedule_by_steps_and_epochs():
    by_steps = Schedule(phases=[{"bsp": 100}, {"ssp": 1}], unit="steps")
    assert by_steps.decide(snap("bsp", version=99)) is None
    assert by_steps.decide(snap("bsp", version=100)).protocol == "ssp"
    by_epochs = Schedule(phases=[{"bsp": 2}, {"asp": 10}], unit="epochs")
    assert by_epochs.decide(snap("bsp", epoch=1.9)) is None
    assert by_epochs.decide(snap("bsp", epoch=2.0)).protocol == "asp"


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one of phases, switch_order"),
    ({"switch_order": "102", "lengths": [1, 1, 1]}, "1 (bsp) and 0 (asp)"),
    ({"switch_order": "10", "lengths": [0.5]}, "one length per digit"),
    ({"phases": [{"bsp": 0.7}, {"asp": 0.7}]}, "more than 1"),
    ({"phases": [{"bsp": 0.5, "asp": 0.5}]}, "one-key"),
])
def test_bad_schedules(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Schedule(**kwargs)


USER_POLICY = textwrap.dedent("""
    from switchps.policies.base import Decision, Policy

    class AspAfterLoss(Policy):
        name = "asp_after_loss"

        def __init__(self, below: float = 0.5):
            self.below = below

        def decide(self, s):
            if s.protocol == "bsp" and s.train_loss is not None and s.train_loss < self.below:
                return Decision(reason=f"loss {s.train_loss:.3f} < {self.below}", protocol="asp")
            return None

    class NotAPolicy:
        pass
""")


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_policies.py").write_text(USER_POLICY)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_policies"
    sys.modules.pop("my_policies", None)


def test_user_policy_by_import_path(user_module):
    policy = make_policy(f"{user_module}:AspAfterLoss", {"below": 0.4})
    assert policy.decide(snap("bsp")) is None
    low = ClusterView(**{**snap("bsp").__dict__, "train_loss": 0.3})
    assert policy.decide(low).protocol == "asp"
    cfg = parse_config({"policy": {"name": f"{user_module}:AspAfterLoss", "kwargs": {"below": 0.2}}}, checks=PREFLIGHT)
    assert cfg.policy.kwargs == {"below": 0.2}


def test_bad_policies_are_config_errors(user_module):
    for policy, message in (({"name": "nope"}, "module:Class"),
                            ({"name": f"{user_module}:NotAPolicy"}, "not a switchps"),
                            ({"name": f"{user_module}:Missing"}, "cannot import"),
                            ({"name": "schedule", "kwargs": {"phases": []}}, "one-key"),
                            ({"name": f"{user_module}:AspAfterLoss", "kwargs": {"above": 1}}, "unexpected keyword")):
        with pytest.raises(ConfigError, match=re.escape(message)) as err:
            parse_config({"policy": policy}, checks=PREFLIGHT)
        assert str(err.value).startswith("policy")
