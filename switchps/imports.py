"""User code named by import path (``module:attr``): models and policies.

The ``switchps`` console script does not put the working directory on
``sys.path`` (``python -m`` and ``python -c`` do), so a ``my_policies.py`` next
to the config would be found by one and not the other. Both lookups here
append the working directory first, so user files resolve the same way in the
launcher and in every child process it starts.
"""

from __future__ import annotations

import importlib
import os
import sys
from importlib.machinery import ModuleSpec
from typing import Any


def split_path(path: str) -> tuple[str, str]:
    """``"pkg.mod:attr"`` -> ``("pkg.mod", "attr")``; ValueError unless both parts are there."""
    module, sep, attr = path.partition(":")
    if not (sep and module and attr):
        raise ValueError(f"expected module:attr, got {path!r}")
    return module, attr


def _with_cwd() -> None:
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.append(cwd)


def load_object(path: str) -> Any:
    """Import ``module:attr`` and return the attribute.

    Raises ValueError for a malformed path and ImportError saying why for
    anything else that stops it: a missing module or attribute, or an exception
    raised by the module's own code (callers name the path).
    """
    module, attr = split_path(path)
    _with_cwd()
    try:
        mod = importlib.import_module(module)
    except ImportError:
        raise
    except Exception as e:  # user code may raise anything while it runs
        raise ImportError(f"{module} raised {type(e).__name__}: {e}") from e
    try:
        return getattr(mod, attr)
    except AttributeError:
        raise ImportError(f"module {module!r} has no attribute {attr!r}") from None


def _find_spec(name: str, search: list[str] | None) -> ModuleSpec | None:
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        spec = find(name, search) if find else None
        if spec is not None:
            return spec
    return None


def find_module(path: str) -> None:
    """Check that the module of ``module:attr`` exists without running it (nor its parent packages);
    ImportError says why not.

    ``importlib.util.find_spec("a.b")`` would import ``a``; walking the meta path
    finders level by level does not, so a process that must stay free of
    TensorFlow can check a path whose package imports it.
    """
    module, _ = split_path(path)
    _with_cwd()
    search: list[str] | None = None
    parts = module.split(".")
    for i in range(len(parts)):
        name = ".".join(parts[: i + 1])
        loaded = sys.modules.get(name)
        spec = getattr(loaded, "__spec__", None) or _find_spec(name, search)
        if spec is None:
            raise ImportError(f"No module named {name!r}")
        if i < len(parts) - 1 and spec.submodule_search_locations is None:
            raise ImportError(f"{name!r} is not a package")
        search = list(spec.submodule_search_locations or [])
