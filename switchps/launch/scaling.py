"""`switchps scale`: change the worker count of a running elastic run (``cluster.workers: {min, max}``).

The command and the launcher running the run (`switchps run`, on any backend) speak through two files in
the run directory. The launcher writes ``workers.json`` (the indices of the workers it runs) whenever that
set changes. `switchps scale` reads it, checks the count asked for against ``cluster.workers``' bounds
(one line, exit 2, when it cannot), and appends it to ``scale.jsonl``. The launcher reads new requests
between its progress polls (at most ~0.5 s apart) and applies the last: new workers take the lowest free
indices below ``max``; the highest-numbered ones are stopped (SIGTERM). The PS counts a newcomer once it
registers, and a stopped worker gone once it says it leaves (``Leave``, from its SIGTERM handler).

Concurrency: the launcher's one thread reads and writes; `switchps scale` only appends whole lines.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from switchps.config.run import load_config
from switchps.errors import RunDirError
from switchps.jsonfile import write_json
from switchps.launch.backends import Backend, Handle, RoleSpec

RUNNING = "workers.json"
"""The launcher's workers: ``{"workers": [indices]}``."""
REQUESTS = "scale.jsonl"
"""Worker counts asked for, one JSON line each (``{"workers": N}``), in the order asked."""


def worker_index(role: str) -> int | None:
    """``worker-<i>``'s index; None for another role."""
    m = re.fullmatch(r"worker-(\d+)", role)
    return int(m.group(1)) if m else None


def ask(run_dir: Path, count: str) -> tuple[int, int]:
    """Ask the launcher of ``run_dir`` for ``count`` workers (``N``, ``+K`` or ``-K``); returns (running,
    asked). Raises ``RunDirError`` (one line) if the run is not a running elastic run or the count is out
    of its bounds."""
    if not (run_dir / "config.yaml").is_file():
        raise RunDirError(f"{run_dir} is not a run directory (no config.yaml)")
    elastic = load_config(run_dir / "config.yaml").cluster.elastic
    if elastic is None:
        raise RunDirError(f"{run_dir}: cluster.workers is a fixed count; only an elastic run "
                          "(cluster.workers: {min, max}) changes its workers")
    if (run_dir / "summary.json").exists():
        raise RunDirError(f"{run_dir}: the run has ended")
    try:
        running = len(json.loads((run_dir / RUNNING).read_text())["workers"])
    except (OSError, ValueError, KeyError) as e:
        raise RunDirError(f"{run_dir}: no launcher runs it ({RUNNING}: {e}); `switchps scale` changes runs "
                          "that `switchps run` started") from None
    if not re.fullmatch(r"[+-]?\d+", count):
        raise RunDirError(f"workers: expected N, +K or -K, got {count!r}")
    asked = running + int(count) if count[0] in "+-" else int(count)
    if not elastic.min <= asked <= elastic.max:
        raise RunDirError(f"workers: {asked} is outside cluster.workers' [min, max] = [{elastic.min}, {elastic.max}]")
    with (run_dir / REQUESTS).open("a") as f:
        f.write(json.dumps({"workers": asked}) + "\n")
    return running, asked


@dataclass
class Scaler:
    """The launcher's side: applies requests to its ``handles`` (the roles it supervises), starting workers
    through ``backend`` with ``role_of(index)`` (kept in ``roles``, for restarts) and stopping others."""

    run_dir: Path
    max_workers: int
    backend: Backend
    roles: dict[str, RoleSpec]
    role_of: Callable[[int], RoleSpec]
    retired: list[Handle] = field(default_factory=list)
    """Workers stopped on request: no longer supervised, stopped for good with the others at the end."""
    read: int = 0  # bytes of the requests file taken so far

    def publish(self, handles: list[Handle]) -> None:
        running = sorted(i for h in handles if (i := worker_index(h.role)) is not None)
        write_json(self.run_dir / RUNNING, {"workers": running})

    def poll(self, handles: list[Handle]) -> None:
        """Apply the newest request not yet applied, if any."""
        path = self.run_dir / REQUESTS
        if not path.exists() or path.stat().st_size == self.read:
            return
        with path.open() as f:
            f.seek(self.read)
            lines = f.read().splitlines(keepends=True)
        whole = [line for line in lines if line.endswith("\n")]  # a line being appended waits for the next poll
        self.read += sum(len(line.encode()) for line in whole)
        if whole:
            self.apply(int(json.loads(whole[-1])["workers"]), handles)

    def apply(self, count: int, handles: list[Handle]) -> None:
        """Run ``count`` workers: start the lowest free indices, or stop the highest."""
        workers = {i: h for h in handles if (i := worker_index(h.role)) is not None}
        free = (i for i in range(self.max_workers) if i not in workers)
        for _ in range(count - len(workers)):
            role = self.role_of(next(free))
            self.roles[role.role] = role
            handles.append(self.backend.start(role))
        for i in sorted(workers, reverse=True)[:max(0, len(workers) - count)]:
            h = workers[i]
            h.stop()
            handles.remove(h)
            self.retired.append(h)
        self.publish(handles)
