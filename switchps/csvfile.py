"""Reading a CSV file whose header must hold some columns (a straggler trace, a churn trace)."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path


def rows(path: Path, columns: Sequence[str]) -> list[tuple[int, dict[str, str]]]:
    """Each row of ``path`` with its line number (the header is line 1); ``ValueError`` naming the file and
    what is missing if its header lacks one of ``columns`` (others are ignored)."""
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in columns if c not in (reader.fieldnames or ())]
        if missing:
            raise ValueError(f"{path}: missing column(s) {', '.join(missing)} (want {','.join(columns)})")
        return list(enumerate(reader, start=2))
