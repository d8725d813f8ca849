"""The straggler trace: the delays a worker plans for one step, and ``stragglers.csv``, where the PS
records them and from which a later run replays them.

The PS writes the file (``ps_server.records``) and workers read it (``worker.stragglers``); the format
lives here, below both, so that neither side imports the other. Delays are kept at full precision, so
``load_trace`` gives a later run exactly the same ``StepDelays``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from switchps import csvfile

TRACE_COLUMNS = ("worker", "step", "sleep_s", "factor", "comm_s")
TRACE_FILE_COLUMNS = ("time_s", *TRACE_COLUMNS)


@dataclass(frozen=True)
class StepDelays:
    """What a worker does to itself during one step."""

    sleep_s: float = 0.0
    """Slept right after the work order arrives, before computing, inside the step's time budget."""
    factor: float = 1.0
    """Compute slowdown: after each micro-batch, sleep (factor - 1) x its measured compute time."""
    comm_s: float = 0.0
    """Slept just before the push (network latency)."""

    @property
    def none(self) -> bool:
        """True when the step is not delayed at all."""
        return self.sleep_s == 0.0 and self.factor == 1.0 and self.comm_s == 0.0


def load_trace(path: str | Path) -> dict[tuple[int, int], StepDelays]:
    """Read a stragglers.csv into {(worker, step): StepDelays}.

    The header must contain ``TRACE_COLUMNS``; other columns (e.g. ``time_s``) are ignored.
    If a (worker, step) appears twice, the last row wins.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"straggler trace not found: {path}")
    out: dict[tuple[int, int], StepDelays] = {}
    for line, row in csvfile.rows(path, TRACE_COLUMNS):
        try:
            key = (int(row["worker"]), int(row["step"]))
            out[key] = StepDelays(float(row["sleep_s"]), float(row["factor"]), float(row["comm_s"]))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}:{line}: bad row ({e})") from None
    return out


def worker_trace(path: str | Path, worker: int) -> dict[int, StepDelays]:
    """One worker's rows of a stragglers.csv as {step: StepDelays} (read-only: shared between callers).

    The file is read once per process and version (path, size, modification time), not once per worker:
    a simulated run builds one reader per worker, and 1,024 workers replaying a 365,000-row trace each
    reading the whole file spent over an hour parsing it.
    """
    path = Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"straggler trace not found: {path}")
    st = path.stat()
    return _by_worker(path, st.st_size, st.st_mtime_ns).get(worker, {})


@lru_cache(maxsize=4)
def _by_worker(path: Path, size: int, mtime_ns: int) -> dict[int, dict[int, StepDelays]]:
    """``load_trace`` grouped by worker; the size and time are part of the cache key only."""
    out: dict[int, dict[int, StepDelays]] = {}
    for (w, step), d in load_trace(path).items():
        out.setdefault(w, {})[step] = d
    return out
