"""The preflight: what the schema alone cannot see, whether the optimizer, schedule, model, policy and
data a config names would work, asked of the code that builds them.

This module sits above the config and the roles (it imports the PS's optimizers and schedules, the
frameworks' models, the data, the policies), so that ``switchps.config.run`` imports none of them. Commands pass
``PREFLIGHT`` to ``load_config``/``parse_config``; each check returns ``(sub-path, message)`` problems
for the section validating, so they join the one report of the whole file. TensorFlow is never imported
here: zoo models are checked by signature, and a ``module:function`` model is imported only for roles
that import it anyway.
"""

from __future__ import annotations

from typing import Any

from switchps.policies.registry import make_policy, policy_class
from switchps.problems import Problem, did_you_mean, kwargs_problems, under
from switchps.ps_server.optimizers import OPTIMIZERS, make_optimizer
from switchps.ps_server.schedules import make_schedule
from switchps.config.schema import Role
from switchps.workload.data import DataNotFoundError, locate_files
from switchps.workload.tensorflow.models import check_model
from switchps.workload.torch.models import check_model as check_torch_model

LOADS_DATA: tuple[Role, ...] = ("run", "worker", "evaluator", "simulate")


def _constant(step: int) -> float:
    return 1.0


class Preflight:
    """``switchps.config.schema.Checks`` answered by the code that builds the run."""

    def optimizer(self, name: str, params: dict[str, float]) -> list[Problem]:
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

    def schedule(self, kind: str, params: dict[str, Any]) -> list[Problem]:
        """The schedule built as the PS builds it."""
        try:
            make_schedule(kind, 1.0, **params)
        except ValueError as e:
            return [("", str(e))]
        return []

    def model(self, framework: str, name: str, kwargs: dict[str, Any], role: Role | None) -> list[Problem]:
        """A zoo model by signature; a ``module:function`` imported (found only, for the PS, which loads no
        framework)."""
        check = check_torch_model if framework == "torch" else check_model
        return check(name, kwargs, "none" if role is None else "find" if role == "ps" else "import")

    def data(self, name: str, path: str | None, role: Role | None) -> list[Problem]:
        """The dataset's files, for the roles that will load them."""
        if role not in LOADS_DATA:
            return []
        try:
            locate_files(name, path)
        except DataNotFoundError as e:
            return [("path" if path else "name", str(e))]
        return []

    def policy(self, name: str, kwargs: dict[str, Any]) -> list[Problem]:
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


PREFLIGHT = Preflight()
