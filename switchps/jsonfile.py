"""JSON that every strict parser reads: non-finite floats become null, files appear whole.

Python's ``json`` writes NaN and Infinity by default, which are not JSON; a
diverged run's test loss is NaN, so every JSON file the project writes goes
through here.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


def finite(obj: Any) -> Any:
    """``obj`` with every non-finite float (at any depth) replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def dumps(obj: Any, indent: int | None = None) -> str:
    """Strict JSON text of ``obj`` (non-finite floats as null)."""
    return json.dumps(finite(obj), indent=indent, allow_nan=False)


def write_json(path: Path, obj: Any) -> Path:
    """Write ``obj`` as indented strict JSON, atomically: a reader sees the old file or the new one."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)
    return path
