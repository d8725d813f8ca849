"""Finding a model builder: a zoo name or an import path ``package.module:function``, the same for every
framework. Each framework's ``models`` module passes its zoo (``MODELS``); nothing here imports a
framework, so the preflight checks a config's model in processes that must load none (the PS, the
launcher)."""

from __future__ import annotations

from typing import Any, Callable, Literal

from switchps.imports import find_module, load_object
from switchps.problems import Problem, did_you_mean, kwargs_problems, under

Load = Literal["none", "find", "import"]


def _unknown(zoo: dict[str, Callable[..., Any]], name: str) -> str:
    return (f"unknown model {name!r}{did_you_mean(name, zoo)}; "
            f"expected one of {', '.join(zoo)} or 'package.module:function'")


def resolve(zoo: dict[str, Callable[..., Any]], name: str) -> Callable[..., Any]:
    """The builder ``name`` names: from ``zoo``, or imported."""
    if name in zoo:
        return zoo[name]
    if ":" not in name:
        raise ValueError(_unknown(zoo, name))
    try:
        fn = load_object(name)
    except (ImportError, ValueError) as e:
        raise ValueError(f"cannot import model function {name!r}: {e}") from e
    if not callable(fn):
        raise ValueError(f"model import path {name!r} is not callable")
    return fn


def check_builder(zoo: dict[str, Callable[..., Any]], name: str, kwargs: dict[str, Any], load: Load) -> list[Problem]:
    """Why building ``name`` with ``kwargs`` would fail, found without building (so without the framework).

    A zoo model's kwargs are bound to its signature. A ``module:function`` is
    imported and checked the same way (``load="import"``), only found
    (``"find"``: its code is not run) or taken on trust (``"none"``).
    """
    if name not in zoo and ":" not in name:
        return [("name", _unknown(zoo, name))]
    if name in zoo or load == "import":
        try:
            fn = resolve(zoo, name)
        except ValueError as e:
            return [("name", str(e))]
        return under("kwargs", kwargs_problems(fn, kwargs, {"input_shape": (1,), "num_classes": 2}))
    if load == "find":
        try:
            find_module(name)
        except (ImportError, ValueError) as e:
            return [("name", f"cannot import model function {name!r}: {e}")]
    return []
