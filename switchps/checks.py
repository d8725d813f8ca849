"""The preflight: what the schema alone cannot see, whether the optimizer, schedule, model, policy and
data a config names would work, asked of the code that builds them.

This module sits above the config and the roles (it imports the PS's optimizers and schedules, the
frameworks' models, the data, the policies), so that ``switchps.config.run`` imports none of them. Commands pass
``PREFLIGHT`` to ``load_config``/``parse_config``; each check returns ``(sub-path, message)`` problems
for the section validating, so they join the one report of the whole file. TensorFlow is never imported
here: zoo models are checked by signature, and a ``module:function`` model is imported only for roles
that import it anyway. PyTorch is imported only for a torch run, by the roles that build its model on this
host (``BUILDS``; never the PS): they check the device and build a ``module:function`` model, or one that
loads a ``model.state_dict``, as the workers will.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from switchps.policies.registry import make_policy, policy_class
from switchps.problems import Problem, did_you_mean, kwargs_problems, under
from switchps.optim.optimizers import OPTIMIZERS, make_optimizer
from switchps.optim.schedules import make_schedule
from switchps.config.schema import Role
from switchps.workload.data import DataNotFoundError, configured_dataset, locate_files
from switchps.workload.tensorflow.models import check_model
from switchps.workload.torch.models import check_model as check_torch_model

if TYPE_CHECKING:
    from switchps.config.run import RunConfig

LOADS_DATA: tuple[Role, ...] = ("run", "worker", "evaluator", "simulate")
BUILDS = LOADS_DATA
"""The roles that build the model on this host (``run``: its local workers)."""


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

    def workload(self, cfg: RunConfig, role: Role | None) -> list[Problem]:
        """A torch run, for the roles that build its model here: the device, then the model as built."""
        if cfg.model.framework != "torch" or role not in BUILDS:
            return []
        return _device(cfg.runtime.device) or _torch_model(cfg)


def _device(device: str) -> list[Problem]:
    """``runtime.device``'s GPU, if it names one, among those torch sees on this host."""
    if not device.startswith("cuda"):
        return []
    import torch

    count = torch.cuda.device_count()
    if int(device.partition(":")[2] or 0) < count:
        return []
    seen = "no GPU" if not count else "1 GPU (cuda:0)" if count == 1 else f"{count} GPUs (cuda:0 to cuda:{count - 1})"
    return [("runtime.device", f"{device}: torch {torch.__version__} sees {seen} on this host; use auto or cpu")]


def _torch_model(cfg: RunConfig) -> list[Problem]:
    """A ``module:function`` model, or one that starts from ``model.state_dict``, built on the run's data as
    the workers build it: refused if it is no float32 ``nn.Module`` or the file does not fit it. The zoo's
    models build (their kwargs are bound to their signatures)."""
    spec = cfg.model
    if ":" not in spec.name and spec.state_dict is None:
        return []
    if spec.state_dict is not None and not Path(spec.state_dict).is_file():
        return [("model.state_dict", f"{spec.state_dict}: file not found")]
    from switchps.workload.torch.models import build_model
    from switchps.workload.torch.setup import load_state_dict

    data = configured_dataset(cfg)
    try:
        model = build_model(spec.name, data.input_shape, data.num_classes, seed=cfg.seed, **spec.kwargs)
    except (TypeError, ValueError) as e:
        return [("model.name", str(e))]
    if spec.state_dict is not None:
        try:
            load_state_dict(model, spec.state_dict)
        except ValueError as e:
            return [("model.state_dict", str(e).removeprefix("model.state_dict "))]
    return []


PREFLIGHT = Preflight()
