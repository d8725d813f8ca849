"""The ``churn`` section: when a simulated elastic run's workers depart and arrive (``switchps simulate``
only; a real run's workers join and leave by themselves).

Either a Poisson process of preemptions (each running worker is preempted at ``preempt_per_hour``; its index
comes back ``rejoin_after_s`` later, or never), or a trace: a CSV of ``time_s,worker,event`` rows, ``event``
``join`` or ``leave``, replayed from the run's start (``cluster.workers.start`` workers, indices
``0..start-1``, run at time 0). A departure stops the worker; the PS learns of it as it would of a real one:
from the worker itself with ``notice``, else after ``cluster.leave_after_s`` of silence. The trace's format and its checks against the cluster live here
so that a bad one is a config error naming ``churn.trace`` before anything starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from switchps import csvfile
from switchps.config.cluster import Cluster
from switchps.config.schema import Role, Section

TRACE_COLUMNS = ("time_s", "worker", "event")
EVENTS = ("join", "leave")


@dataclass(frozen=True)
class Change:
    """One arrival (``join``) or departure (``leave``) of worker ``worker`` at virtual time ``time_s``."""

    time_s: float
    worker: int
    event: Literal["join", "leave"]


class ChurnSpec(Section):
    """Departures and arrivals a simulation injects into an elastic run (``cluster.workers: {min, max}``);
    seeded by the run's ``seed``. Give ``preempt_per_hour`` or ``trace``, not both."""

    preempt_per_hour: float = Field(0.0, ge=0, le=3600)
    """Each running worker is preempted at this rate (a Poisson process, per worker per hour of virtual time):
    it stops at once, losing the step it was computing (a push already sent still arrives). 0: none."""
    rejoin_after_s: float | None = Field(None, gt=0, le=86400)
    """A preempted worker's index comes back (registers again and resumes) this long after it was preempted,
    as a replacement process would; None: it never does."""
    notice: bool = False
    """Whether a departing worker tells the PS it leaves, as a real one stopped with SIGTERM does (a
    preemption's notice, ``switchps scale``: the Leave RPC), so that the PS counts it gone at once; False: it
    vanishes, as in a crash, and the PS notices after ``cluster.leave_after_s`` of silence."""
    trace: str | None = None
    """Path to a CSV with a header ``time_s,worker,event`` and one row per change, ``event`` ``join`` (a new
    index below ``cluster.workers.max``, or one that left) or ``leave`` (a running worker), replayed in time
    order."""

    @model_validator(mode="after")
    def _one_source(self) -> "ChurnSpec":
        if self.trace is not None and self.preempt_per_hour:
            raise ValueError("give preempt_per_hour or trace, not both")
        if self.rejoin_after_s is not None and not self.preempt_per_hour:
            raise ValueError("rejoin_after_s: a preempted worker's return; set preempt_per_hour too")
        return self

    @property
    def active(self) -> bool:
        return bool(self.preempt_per_hour) or self.trace is not None


def read_trace(path: str | Path, start: int, max_workers: int) -> list[Change]:
    """The trace's changes in time order (ties in file order); ``ValueError`` naming the line of the first
    bad row: a missing column, a bad number, an unknown event, an index outside ``[0, max_workers)``, or a
    change that does not fit (a join of a running worker, a leave of one not running: ``0..start-1`` run at
    first)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    rows = [(line, _change(row, path, line, max_workers)) for line, row in csvfile.rows(path, TRACE_COLUMNS)]
    running = set(range(start))
    for line, c in sorted(rows, key=lambda r: r[1].time_s):
        if (c.worker in running) == (c.event == "join"):
            state = "already running" if c.event == "join" else "not running"
            raise ValueError(f"{path}:{line}: worker {c.worker} {c.event}s at {c.time_s} s but is {state} then")
        (running.add if c.event == "join" else running.discard)(c.worker)
    return sorted((c for _, c in rows), key=lambda c: c.time_s)


def _change(row: dict[str, str], path: Path, line: int, max_workers: int) -> Change:
    try:
        time_s, worker, event = float(row["time_s"]), int(row["worker"]), row["event"].strip()
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}:{line}: bad row ({e})") from None
    if not 0 <= time_s < float("inf"):
        raise ValueError(f"{path}:{line}: time_s {time_s} must be a finite time >= 0")
    if not 0 <= worker < max_workers:
        raise ValueError(f"{path}:{line}: worker {worker} is outside [0, cluster.workers.max) = [0, {max_workers})")
    if event not in EVENTS:
        raise ValueError(f"{path}:{line}: event {event!r} is neither join nor leave")
    return Change(time_s, worker, "join" if event == "join" else "leave")


def churn_problems(churn: ChurnSpec, cluster: Cluster, role: Role | None) -> list[tuple[str, str]]:
    """What a run's ``churn`` cannot be, as (field, message): churn outside a simulation or without elastic
    workers, or a trace that does not fit the cluster."""
    if not churn.active:
        return []
    if role not in (None, "simulate"):
        return [("churn", "only `switchps simulate` injects churn; a real run's workers join and leave by "
                          "themselves (remove churn)")]
    if cluster.elastic is None:
        return [("churn", "joins and leaves need elastic workers: cluster.workers: {min: M, max: X, start: S}")]
    if churn.trace is not None:
        try:
            read_trace(churn.trace, cluster.num_workers, cluster.max_workers)
        except ValueError as e:
            return [("churn.trace", str(e))]
    return []
