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
    ({"phases": [{"local_steps": 4}]}, "one-key"),
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


def test_a_schedule_phase_sets_protocol_fields_when_it_begins():
    """Post-local SGD as a schedule: BSP, then local SGD with H = 4, then H = 16 (the same name, new fields)."""
    s = Schedule(phases=[{"bsp": 2}, {"local_sgd": 2, "local_steps": 4}, {"local_sgd": 1, "local_steps": 16}],
                 unit="steps")
    assert s.decide(snap("bsp", version=0)) is None
    d = s.decide(snap("bsp", version=2))
    assert (d.protocol, d.params) == ("local_sgd", {"local_steps": 4}) and "local_steps 4" in d.reason
    assert s.decide(snap("local_sgd", version=3)) is None, "fields are set once, when the phase begins"
    saved = s.state_dict()
    again = Schedule(phases=[{"bsp": 2}, {"local_sgd": 2, "local_steps": 4}, {"local_sgd": 1, "local_steps": 16}],
                     unit="steps")
    again.load_state_dict(saved)
    assert again.decide(snap("local_sgd", version=3)) is None, "a resumed schedule knows the phase it entered"
    assert again.decide(snap("local_sgd", version=4)).params == {"local_steps": 16}


def test_a_schedule_phase_names_only_fields_its_protocol_takes():
    with pytest.raises(ValueError, match="phase bsp: bsp takes no window_s"):
        Schedule(phases=[{"bsp": 0.5, "window_s": 1.0}, {"asp": 0.5}])


def test_post_local_sgd_in_the_core_orders_local_steps_from_the_switch_on():
    """The schedule's switch reaches the workers' orders: BSP's gradients, then rounds of local steps whose
    movements the outer optimizer applies (``Apply.outer``), with H changing between phases."""
    from harness import Harness
    from switchps.ps_server.core.events import StepReport

    h = Harness(workers=2, policy=Schedule(phases=[{"bsp": 2}, {"local_sgd": 2, "local_steps": 4},
                                                   {"local_sgd": 1, "local_steps": 16}], unit="steps"))
    seen = []
    for _ in range(5):
        order = h.core.work_order(0)
        seen.append(order.local.steps if order.local else 0)
        for w in range(2):
            h.push(w, 1.0, samples=order.sample_budget, report=StepReport(local_steps=seen[-1]))
    assert seen == [0, 0, 4, 4, 16]
    assert [a.outer is not None for a in h.applied] == [False, False, True, True, True]
    assert h.applied[2].outer.learning_rate == 1.0, "local SGD's outer step averages the movements"
    h.check_books()
