"""Reading a run directory: its CSV tables as arrays, its summary and config, and where tables print.

A run directory holds ``ps.csv``, ``workers.csv``, ``eval.csv``, ``events.jsonl``, ``summary.json`` and
``config.yaml``; any CSV may be header-only.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from rich.console import Console


def read_csv(path: Path) -> dict[str, np.ndarray]:
    """Read a CSV into ``column -> array``.

    A column is float (empty fields -> NaN) if every non-empty value parses as a float,
    otherwise a str array. A header-only file gives empty float arrays; a missing or
    empty file gives ``{}``.
    """
    path = Path(path)
    if not path.is_file():
        return {}
    with path.open(newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        rows = [row for row in reader if row]
    if header is None:
        return {}
    return {
        name.strip(): _to_array([row[i] if i < len(row) else "" for row in rows])
        for i, name in enumerate(header)
    }


def _to_array(values: list[str]) -> np.ndarray:
    try:
        return np.array([float(v) if v.strip() else np.nan for v in values], dtype=float)
    except ValueError:
        return np.array(values, dtype=str)


def nrows(table: dict[str, np.ndarray]) -> int:
    return len(next(iter(table.values()))) if table else 0


def num(table: dict[str, np.ndarray], column: str) -> np.ndarray:
    """Column as floats; all-NaN when missing or non-numeric."""
    values = table.get(column)
    if values is None or values.dtype.kind != "f":
        return np.full(nrows(table), np.nan)
    return values


def text(table: dict[str, np.ndarray], column: str) -> np.ndarray:
    values = table.get(column)
    return np.full(nrows(table), "", dtype=str) if values is None else values.astype(str)


def pairs(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Points where both coordinates are finite, sorted by x."""
    keep = np.isfinite(x) & np.isfinite(y)
    order = np.argsort(x[keep], kind="stable")
    return x[keep][order], y[keep][order]


def opt_float(value: Any) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


@dataclass
class Run:
    """Everything read from one run directory."""

    run_dir: Path
    name: str
    protocol: str
    summary: dict[str, Any]
    ps: dict[str, np.ndarray] = field(repr=False)
    workers: dict[str, np.ndarray] = field(repr=False)
    eval: dict[str, np.ndarray] = field(repr=False)

    @classmethod
    def load(cls, run_dir: Path) -> Run:
        run_dir = Path(run_dir)
        summary_path, config_path = run_dir / "summary.json", run_dir / "config.yaml"
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
        config = yaml.safe_load(config_path.read_text()) if config_path.is_file() else None
        config_name = config.get("name") if isinstance(config, dict) else None
        ps = read_csv(run_dir / "ps.csv")
        phases = list(dict.fromkeys(p for p in text(ps, "protocol") if p))
        return cls(
            run_dir=run_dir,
            name=str(summary.get("name") or config_name or run_dir.name),
            protocol="→".join(phases) if len(phases) > 1 else str(summary.get("protocol") or "".join(phases) or "?"),
            summary=summary,
            ps=ps,
            workers=read_csv(run_dir / "workers.csv"),
            eval=read_csv(run_dir / "eval.csv"),
        )

    def title(self, what: str) -> str:
        return f"{self.name} ({self.protocol}): {what}"


def console() -> Console:
    """Where tables are printed: the terminal, or 160 columns when output goes to a file or pipe."""
    out = Console()
    if not out.is_terminal:
        out.width = 160
    return out
