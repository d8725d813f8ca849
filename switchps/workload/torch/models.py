"""The PyTorch model zoo (being written)."""

from __future__ import annotations

from typing import Any, Callable

from switchps.problems import Problem
from switchps.workload.builders import Load, check_builder

MODELS: dict[str, Callable[..., Any]] = {}


def check_model(name: str, kwargs: dict[str, Any], load: Load) -> list[Problem]:
    """Why building ``name`` would fail, found without building (so without torch)."""
    return check_builder(MODELS, name, kwargs, load)
