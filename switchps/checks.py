"""What the schema alone cannot see: whether the optimizer, model, policy and data a config names would work.

Each function returns ``(sub-path, message)`` problems for a validator in
``switchps.config`` to raise, so they join the one report of the whole file.
TensorFlow is never imported here: zoo models are checked by signature, and a
``module:function`` model is imported only for roles that import it anyway.
"""

from __future__ import annotations

from typing import Any, Literal

from switchps.policies.registry import make_policy, policy_class
from switchps.problems import Problem, did_you_mean, kwargs_problems, under
from switchps.ps_server.optimizers import OPTIMIZERS, make_optimizer
from switchps.worker.data import DataNotFoundError, locate_files
from switchps.worker.models import check_model

Role = Literal["run", "ps", "worker", "evaluator"]
"""The command validating: ``run`` checks everything before the launcher starts a process."""

LOADS_DATA: tuple[Role, ...] = ("run", "worker", "evaluator")


def _constant(step: int) -> float:
    return 1.0


def optimizer_problems(name: str, params: dict[str, float]) -> list[Problem]:
    """Each hyper-parameter the PS would reject, one by one so all are named, then all together."""
    accepted = list(OPTIMIZERS[name].defaults)
    problems = [(key, f"unknown key{did_you_mean(key, accepted)}; {name} takes {', '.join(accepted) or 'none'}")
                for key in params if key not in accepted]
    for key in (k for k in params if k in accepted):
        try:
            make_optimizer(name, 0, _constant, **{key: params[key]})
        except ValueError as e:
            problems.append((key, str(e).removeprefix(f"{name}: ")))
    if not problems:
        try:
            make_optimizer(name, 0, _constant, **params)
        except ValueError as e:
            problems.append(("", str(e)))
    return problems


def model_problems(name: str, kwargs: dict[str, Any], role: Role | None) -> list[Problem]:
    """A zoo model by signature; a ``module:function`` imported (found only, for the TF-free PS)."""
    return check_model(name, kwargs, "none" if role is None else "find" if role == "ps" else "import")


def data_problems(name: str, path: str | None, role: Role | None) -> list[Problem]:
    """The dataset's files, for the roles that will load them."""
    if role not in LOADS_DATA:
        return []
    try:
        locate_files(name, path)
    except DataNotFoundError as e:
        return [("path" if path else "name", str(e))]
    return []


def policy_problems(name: str, kwargs: dict[str, Any]) -> list[Problem]:
    """The policy class, its keyword arguments by signature, then whatever its constructor rejects."""
    try:
        cls = policy_class(name)
    except ValueError as e:
        return [("name", str(e))]
    if problems := kwargs_problems(cls, kwargs, {}):
        return under("kwargs", problems)
    try:
        make_policy(name, kwargs)
    except ValueError as e:
        return [("", str(e))]
    return []
