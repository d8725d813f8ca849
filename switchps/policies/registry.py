"""Policies by name: the built-ins, or any Policy subclass by import path."""

from __future__ import annotations

from typing import Any

from switchps.policies.base import Policy, load_policy_class
from switchps.problems import did_you_mean

BUILTIN = {
    "schedule": "switchps.policies.schedule:Schedule",
    "greedy": "switchps.policies.online:Greedy",
    "elastic": "switchps.policies.online:Elastic",
    "anytime": "switchps.policies.online:Anytime",
    "dynamic_batching": "switchps.policies.online:DynamicBatching",
}


def policy_class(name: str) -> type[Policy]:
    """A built-in policy's class, or a Policy subclass by import path; ValueError says what is wrong."""
    if name not in BUILTIN and ":" not in name:
        raise ValueError(f"unknown policy {name!r}{did_you_mean(name, BUILTIN)}; "
                         f"expected one of {', '.join(BUILTIN)} or module:Class")
    return load_policy_class(BUILTIN.get(name, name))


def make_policy(name: str, kwargs: dict[str, Any]) -> Policy:
    """Build a policy from its settings; bad names or arguments raise ValueError naming them."""
    cls = policy_class(name)
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ValueError(f"{name}: {e}") from None
