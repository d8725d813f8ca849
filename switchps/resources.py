"""What each process uses: CPU %, resident memory and network bytes, sampled once a second (psutil).

Every process that knows the run directory (the PS, the evaluator, and workers started by `switchps run`
or given ``--run-dir``) appends one row per second to ``RUN_DIR/resources.csv``, with the name of the
host it runs on; each row is one ``write`` in append mode, so rows of different processes never
interleave. Network bytes are the host's (psutil has no per-process counters); on one host they are the
whole run's traffic. The PS adds each role's peaks, means and hosts to ``summary.json``, and how many
distinct hosts those roles ran on (``in_summary``); `switchps plot` draws them (``figure``).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import psutil

from switchps.jsonfile import write_json

if TYPE_CHECKING:
    from matplotlib.figure import Figure

COLUMNS = ("unix_time", "role", "pid", "cpu_percent", "rss_mb", "net_sent_mb", "net_recv_mb", "host")
"""A row written before hosts were recorded lacks the last column."""
HEADER = ",".join(COLUMNS) + "\n"


class ResourceSampler:
    """A daemon thread appending this process's resources to ``path`` every ``every_s``."""

    def __init__(self, role: str, path: Path, every_s: float = 1.0) -> None:
        self.role, self.path, self.every_s = role, path, every_s
        self.host = socket.gethostname()
        self.proc = psutil.Process()
        self.proc.cpu_percent()  # the first call only starts the measurement
        self._stop = threading.Event()
        try:  # the header, by the one process that creates the file (a check, then a write, let two write it)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "w") as f:
                f.write(HEADER)
        threading.Thread(target=self._loop, name="switchps-resources", daemon=True).start()

    def _loop(self) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        try:
            while not self._stop.wait(self.every_s):
                net = psutil.net_io_counters()
                row = (f"{time.time():.3f},{self.role},{os.getpid()},{self.proc.cpu_percent():.1f},"
                       f"{self.proc.memory_info().rss / 2**20:.1f},{net.bytes_sent / 2**20:.3f},"
                       f"{net.bytes_recv / 2**20:.3f},{self.host}\n")
                os.write(fd, row.encode())
        finally:
            os.close(fd)

    def stop(self) -> None:
        self._stop.set()


def read(path: Path) -> dict[str, dict[str, np.ndarray]]:
    """resources.csv by role: time, cpu_percent and rss_mb arrays, and ``host`` (its hosts' names, "" for a
    row without one). Only whole rows are read: a torn last line, with no newline yet, and headers are
    skipped."""
    out: dict[str, dict[str, list]] = {}
    for line in path.read_text().split("\n")[:-1] if path.exists() else []:
        parts = line.split(",")
        if len(parts) not in (len(COLUMNS) - 1, len(COLUMNS)) or parts[0] == COLUMNS[0]:
            continue  # a torn line, or a header (one that an older switchps wrote twice, anywhere)
        r = out.setdefault(parts[1], {"unix_time": [], "cpu_percent": [], "rss_mb": [], "host": []})
        for key in ("unix_time", "cpu_percent", "rss_mb"):
            r[key].append(float(parts[COLUMNS.index(key)]))
        r["host"].append(parts[COLUMNS.index("host")] if len(parts) == len(COLUMNS) else "")
    return {role: {k: np.asarray(v) for k, v in r.items()} for role, r in out.items()}


def summary(path: Path) -> dict[str, Any] | None:
    """Per role: peak and mean CPU % and RSS (MB), the number of samples, and the hosts it ran on (more
    than one if a restart moved it)."""
    roles = read(path)
    if not roles:
        return None
    return {role: {"cpu_percent_peak": round(float(r["cpu_percent"].max()), 1),
                   "cpu_percent_mean": round(float(r["cpu_percent"].mean()), 1),
                   "rss_mb_peak": round(float(r["rss_mb"].max()), 1),
                   "rss_mb_mean": round(float(r["rss_mb"].mean()), 1), "samples": len(r["rss_mb"]),
                   "hosts": sorted(set(r["host"]) - {""})}
            for role, r in sorted(roles.items())}


def in_summary(path: Path) -> dict[str, Any]:
    """What ``summary.json`` says of resources.csv: ``resources`` (``summary``) and ``hosts``, how many
    distinct hosts the roles in it ran on (None if no row names one). A role whose rows never reached
    this file (started by hand on a host that does not share the run directory) is not counted."""
    roles = summary(path)
    hosts = {h for r in (roles or {}).values() for h in r["hosts"]}
    return {"resources": roles, "hosts": len(hosts) or None}


def figure(path: Path) -> Figure | None:
    """CPU % and RSS over time per role; None if there is nothing to draw."""
    roles = read(path)
    if not roles:
        return None
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 6), layout="constrained")
    cpu, rss = fig.subplots(2, 1, sharex=True)
    t0 = min(float(r["unix_time"][0]) for r in roles.values())
    for role, r in sorted(roles.items()):
        cpu.plot(r["unix_time"] - t0, r["cpu_percent"], label=role, lw=1)
        rss.plot(r["unix_time"] - t0, r["rss_mb"], label=role, lw=1)
    cpu.set(ylabel="CPU % (100 = one core)", title="resources per process")
    rss.set(xlabel="time (s)", ylabel="resident memory (MB)")
    cpu.legend(ncol=4, fontsize="small")
    return fig


def complete(run_dir: Path) -> dict[str, Any]:
    """``summary.json`` with its resources and hosts taken from every role's rows, once every role has ended
    (the PS wrote it before the other roles' last rows, and under Ray before they reached its node)."""
    path = run_dir / "summary.json"
    full = {**json.loads(path.read_text()), **in_summary(run_dir / "resources.csv")}
    write_json(path, full)
    return full
