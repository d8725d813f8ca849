"""The run record: CSV tables, an event log, counters and the summary.

The PS is the only writer of a run directory. Rows are buffered and flushed
by a background thread so that recording never blocks the push path on disk;
a driver without threads (a simulator) flushes them itself. Every time in the
record comes from the driver's clock (``clock``), the one its core runs on:
monotonic time for the gRPC driver, virtual time for a simulator.
``stragglers.csv`` is written in the format of ``switchps.straggler_trace``.
"""

from __future__ import annotations

import csv
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from switchps.jsonfile import dumps, write_json
from switchps.ps_server.core.actions import Apply
from switchps.ps_server.core.events import StepReport
from switchps.ps_server.mlflow_log import LiveLog
from switchps.ps_server.tensorboard import TensorBoard
from switchps.straggler_trace import TRACE_FILE_COLUMNS

PS_COLUMNS = ("time_s", "version", "protocol", "workers", "samples", "local_steps", "staleness_max", "staleness_mean",
              "lr", "train_loss", "b_min", "b_mean", "b_max", "wait_s", "time_budget_s", "pushes",
              "members")
WORKER_COLUMNS = ("time_s", "worker", "step", "base_version", "samples", "compute_s", "send_s",
                  "wait_s", "sleep_s", "loss", "local_steps", "local_losses")
EVAL_COLUMNS = ("time_s", "version", "test_loss", "test_accuracy")
FLUSHER = "switchps-record-flusher"
"""The name of a recorder's flush thread."""


@dataclass
class _Table:
    """One CSV file; ``count`` rows have been appended to it over the whole run."""

    path: Path
    columns: tuple[str, ...]
    keep: int | None = None
    """Resuming: keep the first ``keep`` rows (those of the checkpoint) and move the rest to
    ``<name>.lost.csv``: they describe work the crash lost, which is done again."""
    rows: list[tuple] = field(default_factory=list)
    count: int = 0
    lost: list[list[str]] = field(default_factory=list)
    """Resuming: the rows this resume moved out."""

    def __post_init__(self) -> None:
        if self.keep is None or not self.path.exists():
            with self.path.open("w", newline="") as f:
                csv.writer(f).writerow(self.columns)
            return
        with self.path.open(newline="") as f:
            lines = list(csv.reader(f))[1:]
        kept, lost = lines[:self.keep], lines[self.keep:]
        self.lost = lost
        if lost:
            lost_path = self.path.with_suffix(".lost.csv")
            new = not lost_path.exists()
            with lost_path.open("a", newline="") as f:
                csv.writer(f).writerows([list(self.columns)] * new + lost)
        tmp = self.path.with_suffix(".tmp")
        with tmp.open("w", newline="") as f:
            csv.writer(f).writerows([self.columns, *kept])
        tmp.replace(self.path)
        self.count = len(kept)

    def append(self, row: tuple) -> None:
        self.rows.append(row)
        self.count += 1

    def take(self) -> list[tuple]:
        """The buffered rows, handed over for writing (caller holds the recorder's lock)."""
        rows, self.rows = self.rows, []
        return rows

    def write(self, rows: list[tuple]) -> list[tuple]:
        """Append ``rows`` to the file (caller holds the recorder's write lock, not its lock); returns them."""
        if rows:
            with self.path.open("a", newline="") as f:
                csv.writer(f).writerows(rows)
        return rows


def update_row(a: Apply) -> dict[str, Any]:
    """An update's ps.csv fields, from the core's ``Apply`` (the time and rate are the applier's)."""
    members = a.aggregate.members
    b, staleness = [m.samples for m in members], [m.staleness for m in members]
    return dict(version=a.version, protocol=a.protocol, workers=";".join(str(m.worker) for m in members),
                samples=sum(b), local_steps=a.aggregate.local_steps, staleness_max=max(staleness),
                staleness_mean=sum(staleness) / len(staleness),
                train_loss=sum(m.loss_sum for m in members) / sum(b), b_min=min(b), b_mean=sum(b) / len(b),
                b_max=max(b), wait_s=a.wait_s, time_budget_s=a.time_budget_s,
                pushes=";".join(f"{m.worker}:{m.session}:{m.step}" for m in members), members=a.members)


def local_losses(samples: int, stats: StepReport) -> str:
    """workers.csv's ``local_losses``: each local step's mean loss, space-separated, in step order (the
    first is the loss at the values pulled); each step took ``samples / local_steps`` of the push's samples.
    Empty for a gradient."""
    if not stats.local_steps:
        return ""
    per_step = samples / stats.local_steps
    return " ".join(f"{s / per_step:.6g}" for s in stats.local_loss_sums)


class RunRecorder:
    """Appends rows and events, counts pushes, and writes ``summary.json``."""

    def __init__(self, run_dir: Path, trace: bool = False, flush_every_s: float | None = 0.5,
                 resume: dict[str, Any] | None = None, clock: Callable[[], float] = time.monotonic,
                 mlflow: LiveLog | None = None) -> None:
        """``flush_every_s``: how often a background thread flushes; None: no thread, the driver calls
        ``flush``. ``resume``: a ``position`` from a checkpoint; the record continues from there.
        ``clock``: the driver's clock, on which ``start``'s time is too. ``mlflow``: where each flush also
        logs its new ps.csv and eval.csv rows (``output.mlflow``)."""
        self.run_dir, self.clock = run_dir, clock
        run_dir.mkdir(parents=True, exist_ok=True)
        self.t0: float | None = None  # training start; times in the record count from it
        self._created = clock()
        self._lock = threading.Lock()  # the buffered rows, events and counts
        self._write_lock = threading.Lock()  # one flush writes at a time, in order; taken before ``_lock``
        rows = (resume or {}).get("rows", {})
        self.ps = _Table(run_dir / "ps.csv", PS_COLUMNS, rows.get("ps"))
        self.workers = _Table(run_dir / "workers.csv", WORKER_COLUMNS, rows.get("workers"))
        self.eval = _Table(run_dir / "eval.csv", EVAL_COLUMNS, rows.get("eval"))
        self.trace = _Table(run_dir / "stragglers.csv", TRACE_FILE_COLUMNS, rows.get("trace")) if trace else None
        self.tensorboard = TensorBoard(run_dir)
        self.mlflow = mlflow
        self.busy_s: Counter[int] = Counter()  # per worker: compute + injected delay, i.e. not waiting
        self.member_s = 0.0  # Σ members in force × time, up to the latest update (``member_seconds``)
        self._members: tuple[float, int] | None = None  # the latest update's time and members
        self._events: list[tuple[float, dict[str, Any]]] = []
        # appended to, never truncated: a PS restarted before its first checkpoint starts afresh after
        # what was logged before it (its predecessor's events, a Ray driver's)
        (run_dir / "events.jsonl").touch()
        self.counts: Counter[str] = Counter()
        self.reasons: Counter[str] = Counter()
        self.rejections: Counter[str] = Counter()  # "rpc:reason" for every rejected request
        self.evals: list[tuple[float, int, float, float]] = []
        if resume is not None:
            self._restore(resume)
        self._stop = threading.Event()
        self._flusher: threading.Thread | None = None
        if flush_every_s is not None:
            self._flusher = threading.Thread(target=self._flush_loop, args=(flush_every_s,),
                                             name=FLUSHER, daemon=True)
            self._flusher.start()

    def now(self) -> float:
        """The clock's time, in seconds since the training start (before it: since this recorder was made)."""
        return self._rel(self.clock())

    def _rel(self, t: float) -> float:
        return round(t - (self.t0 if self.t0 is not None else self._created), 6)

    def update(self, a: Apply, lr: float) -> None:
        """One applied update (called by the applier once it knows the rate it applied)."""
        row = {**update_row(a), "time_s": self.now(), "lr": lr}
        with self._lock:
            self.ps.append(tuple(_fmt(row.get(c)) for c in PS_COLUMNS))
            since, members = self._members or (0.0, a.members)  # before the first update: its members
            self.member_s += members * max(0.0, row["time_s"] - since)
            self._members = (row["time_s"], a.members)

    def member_seconds(self, until: float, members: int) -> float:
        """Σ over training, until ``until``, of the members in force × time: each update's members from it to
        the next (``members``, the count the run starts with, if none was applied). What an elastic run's
        worker utilization divides by; a fixed-size run's is its N × ``until``."""
        with self._lock:
            since, n = self._members or (0.0, members)
            return self.member_s + n * max(0.0, until - since)

    def step(self, worker: int, base_version: int, samples: int, stats: StepReport) -> None:
        """One worker step, as its push reported it: a workers.csv row, and the straggler plan if traced."""
        now = self.now()
        self.worker_step(time_s=now, worker=worker, step=stats.step, base_version=base_version, samples=samples,
                         compute_s=stats.compute_s, send_s=stats.send_s, wait_s=stats.wait_s,
                         sleep_s=stats.sleep_s, loss=stats.loss_sum / samples, local_steps=stats.local_steps,
                         local_losses=local_losses(samples, stats))
        if self.trace is not None:
            self.straggler(time_s=now, worker=worker, step=stats.step, sleep_s=stats.delay_sleep_s,
                           factor=stats.delay_factor or 1.0, comm_s=stats.delay_comm_s)
        if stats.batch_exhausted:
            self.count("batch_exhausted")
        if stats.overlapped:
            self.count("overlapped")

    def worker_step(self, **row: Any) -> None:
        with self._lock:
            self.workers.append(tuple(_fmt(row.get(c)) for c in WORKER_COLUMNS))
            self.busy_s[row["worker"]] += row["compute_s"] + row["sleep_s"]

    def straggler(self, **row: Any) -> None:
        """One row of the straggler trace, at full precision so a replay is exact."""
        values = (row[c] for c in TRACE_FILE_COLUMNS)
        with self._lock:
            if self.trace is not None:
                self.trace.append(tuple(repr(v) if isinstance(v, float) else v for v in values))

    def evaluation(self, version: int, test_loss: float, test_accuracy: float) -> None:
        t = self.now()
        with self._lock:
            self.evals.append((t, version, test_loss, test_accuracy))
            self.eval.append((_fmt(t), version, _fmt(test_loss), _fmt(test_accuracy)))

    def event(self, event: str, **fields: Any) -> None:
        with self._lock:
            self._events.append((self.clock(), {"event": event, **fields}))

    def count(self, what: str, reason: str | None = None) -> None:
        """Count an accepted, rejected or dropped push (with its reason)."""
        with self._lock:
            self.counts[what] += 1
            if reason:
                self.reasons[f"{what}:{reason}"] += 1

    def reject(self, rpc: str, reason: str) -> None:
        """Count a rejected request of any RPC; rejected pushes also count as pushes."""
        with self._lock:
            self.rejections[f"{rpc}:{reason}"] += 1
        if rpc == "push":
            self.count("rejected", reason)

    def position(self) -> dict[str, Any]:
        """Where the record stands, for a checkpoint: rows per table (``ps`` is set by the applier,
        whose rows lag the core's updates), counters, and the evaluations so far."""
        with self._lock:
            return {"rows": {"workers": self.workers.count, "eval": self.eval.count,
                             "trace": self.trace.count if self.trace else 0},
                    "counts": dict(self.counts), "reasons": dict(self.reasons),
                    "rejections": dict(self.rejections), "busy_s": {str(w): s for w, s in self.busy_s.items()},
                    "member_s": [self.member_s, *(self._members or ())], "evals": [list(e) for e in self.evals]}

    def ps_rows(self) -> int:
        with self._lock:
            return self.ps.count

    def _restore(self, d: dict[str, Any]) -> None:
        self.counts.update(d["counts"])
        self.reasons.update(d["reasons"])
        self.rejections.update(d["rejections"])
        self.busy_s.update({int(w): s for w, s in d["busy_s"].items()})
        self.member_s, *latest = d.get("member_s", [0.0])  # a checkpoint from before elastic runs: none
        self._members = (float(latest[0]), int(latest[1])) if latest else None
        self.evals = [(t, int(v), loss, acc) for t, v, loss, acc in d["evals"]]

    def start(self, t0: float) -> None:
        """Training started at ``t0`` on the clock (a resumed run: the checkpoint's elapsed time before now)."""
        self.t0 = t0

    def flush(self, final: bool = False) -> None:
        """Write buffered rows; events wait for the training start so their times share its origin.

        The rows are taken under ``_lock`` and written under ``_write_lock`` alone, so the event loop and
        the applier, which take only ``_lock`` to append, never wait on the disk."""
        with self._write_lock:
            with self._lock:
                trace = self.trace.take() if self.trace is not None else []
                ps, workers, evals = self.ps.take(), self.workers.take(), self.eval.take()
                ready = self.t0 is not None or final
                events = [dumps({"time_s": self._rel(t), **e}) for t, e in self._events] if ready else []
                if ready:
                    self._events = []
            if self.trace is not None:
                self.trace.write(trace)
            updates = [dict(zip(PS_COLUMNS, r)) for r in self.ps.write(ps)]
            self.tensorboard.updates(updates)
            self.tensorboard.steps(self.workers.write(workers), WORKER_COLUMNS)
            self.tensorboard.evaluations(self.eval.write(evals))
            self.tensorboard.flush()
            if self.mlflow is not None:
                self.mlflow.log(updates, [dict(zip(EVAL_COLUMNS, r)) for r in evals])
            if events:
                with (self.run_dir / "events.jsonl").open("a") as f:
                    f.write("\n".join(events) + "\n")

    def _flush_loop(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            self.flush()

    def close(self, summary: dict[str, Any]) -> dict[str, Any]:
        """Stop the flusher (if any), flush everything and write ``summary.json``."""
        if self._flusher is not None:
            self._stop.set()
            self._flusher.join()
        self.flush(final=True)
        self.tensorboard.close()
        accs = [e[3] for e in self.evals]
        full = {
            "best_test_accuracy": max(accs) if accs else None,
            "pushes_accepted": self.counts["accepted"],
            "pushes_rejected": self.counts["rejected"],
            "pushes_dropped": self.counts["dropped"],
            "batch_exhausted_steps": self.counts["batch_exhausted"],
            "overlapped_steps": self.counts["overlapped"],
            "push_reasons": dict(sorted(self.reasons.items())),
            "rejections": dict(sorted(self.rejections.items())),
            **summary,
        }
        if self.mlflow is not None:
            full["mlflow"] = self.mlflow.close()
        write_json(self.run_dir / "summary.json", full)
        return full


def _fmt(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return v
