"""Where a worker step's time goes: logistic regression (784->10, or ``--dim``->10), 2 workers, ASP, authenticated,
checkpointing.

One real run (``switchps.launch.launcher``, as ``bench/steps.py`` runs it). Once training has run ``--warmup-s``,
a clean window of ``--seconds``, nothing attached: steps/s, the CPU time of every thread of the PS,
worker 0 and the evaluator (``/proc``, through psutil), and worker 0's own per-step timers (workers.csv
``compute_s``, ``send_s``; the PS records no per-phase timer, only per-update rows). Then three sampled
windows, one py-spy at a time (``--nonblocking``: the process is never paused): worker 0 wall clock
(``--idle``), worker 0 on-CPU, the PS on-CPU. A bucket's ms per step is its share of a thread's
samples times that thread's time per step in the clean window: wall time for worker 0's main thread,
CPU time for the PS's event loop and applier threads. Threads with no Python frames (gRPC's C core,
TensorFlow's pools) are reported per thread, not split. Without py-spy: the clean window only.
Prints JSON.

    python bench/profile_step.py [--seconds 8] [--warmup-s 4] [--rate 250] [--dim 784] [--py-spy PATH] [--keep DIR]
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from switchps.address import published
from switchps.launch.backends import Child, LocalBackend, RoleSpec
from switchps.security.channels import client_security
from switchps.config.run import RunConfig, parse_config
from switchps.jsonfile import dumps
from switchps.launch.launcher import launch, local_backend
from switchps.worker.client import PSClient
from steps import data_config  # the sibling benchmark's data (bench/ is on sys.path)

CALL = "client call (the socket or gRPC, until the reply is in)"
Rule = tuple[str, str, tuple[str, ...]]
"""(bucket, part of a file path, function names or ``Class.`` prefixes): a frame matches if both do (no
names: any function). A stack goes to the first rule any of its frames matches: order is priority."""
WORKER_RULES: list[Rule] = [
    ("compute: TF gradient and its copy out", "workload/tensorflow/gradients.py", ("GradientComputer.compute",
                                                                      "GradientComputer.finish")),
    ("compute: sample indices and slice the batch", "worker/steps.py", ("StepRunner._compute", "Sampler.take")),
    (CALL, "grpc/", ()),
    (CALL, "worker/local_line.py", ()),
    ("reply decode", "protos/codec.py", ("decode_header", "receive_into", "PayloadWriter.add",
                                         "PayloadWriter.finish", "_frames")),
    ("reply decode", "worker/client.py", ("PSClient._read_reply",)),
    ("encode", "protos/codec.py", ("encode", "_frame0", "array_chunks", "encode_array")),
    (CALL, "worker/client.py", ("PSClient.push", "Reconnect.__call__")),
    ("assign the reply's values to the model", "worker/", ("GradientComputer.assign", "FlatWeights.assign")),
    ("worker loop: step stats, headers, straggler plan", "worker/", ()),
]
PS_RULES: list[Rule] = [
    ("token verification", "ps_server/rpc/guard.py", ()),
    ("token verification", "switchps/security/auth.py", ()),
    ("token verification", "ps_server/rpc/service.py", ("ParameterServer._as_worker",)),
    ("checks", "protos/codec.py", ("all_finite", "sum_squares")),
    ("checks", "ps_server/validate.py", ()),
    ("checks", "ps_server/core/machine.py", ("Core.check_push",)),
    ("checks", "ps_server/store.py", ("ModelStore.check",)),
    ("checks", "ps_server/rpc/service.py", ("_report",)),
    ("server receive/decode", "protos/codec.py", ("decode", "decode_header", "parse", "first_frame", "fill",
                                                  "_read", "PayloadWriter.add", "PayloadWriter.finish")),
    ("server receive/decode", "ps_server/receiving.py", ("BufferPool.", "receiving")),
    ("server receive/decode", "ps_server/rpc/service.py", ("ParameterServer._receive_push",)),
    ("record (rows, events, counts)", "ps_server/records.py", ()),
    ("record (rows, events, counts)", "ps_server/tensorboard.py", ()),
    ("record (rows, events, counts)", "prometheus_client/", ()),
    ("reply encode", "ps_server/snapshot.py", ("Snapshot.",)),
    ("reply encode", "ps_server/rpc/attachments.py", ("write_values", "_copy")),
    ("reply encode", "protos/codec.py", ("aencode", "encode", "_frame0", "whole_frame", "joined")),
    ("reply encode", "ps_server/rpc/service.py", ("ParameterServer._send", "_order")),
    ("apply", "optim/optimizers.py", ()),
    ("apply", "ps_server/store.py", ("ModelStore._apply", "ModelStore._join", "ModelStore.submit",
                                     "ModelStore.join", "ModelStore._enqueue", "ModelStore.recycle")),
    ("apply", "ps_server/sums.py", ()),
    ("checkpoint (between events)", "ps_server/checkpoint", ()),
    ("checkpoint (between events)", "ps_server/rpc/service.py", ("ParameterServer._maybe_checkpoint",)),
    ("core", "ps_server/core/", ()),
    ("core", "ps_server/core/protocols.py", ()),
    ("core", "ps_server/core/events.py", ()),
    ("core", "ps_server/rpc/service.py", ("ParameterServer._execute", "ParameterServer._note_progress",
                                      "ParameterServer._arm", "ParameterServer._fire")),
    ("core", "ps_server/rpc/executor.py", ()),
    ("handler glue (service.py)", "ps_server/rpc/service.py", ()),
    ("handler glue (service.py)", "ps_server/rpc/local_pushes.py", ()),  # the socket's frames and replies
    ("gRPC aio and asyncio runtime", "grpc/", ()),
    ("gRPC aio and asyncio runtime", "asyncio/", ()),
]
OTHER = "other Python"
WAKE = "wake-up: runnable in epoll or a queue wait"
WAIT_LEAVES = ("EpollSelector.select", "ModelStore._apply_loop", "Condition.wait", "Event.wait")
"""Innermost frames of a thread waiting (epoll, ``queue.get``, a condition). An on-CPU sample there is a
thread woken and runnable: its wake-up's CPU, or a wait for a core, which py-spy cannot tell apart."""
LOOP, APPLIER, MAIN = "switchps-grpc", "switchps-applier", "MainThread"


def _matches(frame: str, rule: Rule) -> bool:
    func, _, where = frame.rpartition(" (")
    _, ending, names = rule
    return ending in where.rsplit(":", 1)[0] and (not names or any(
        func == n or (n.endswith(".") and func.startswith(n)) for n in names))


def classify(frames: list[str], rules: list[Rule]) -> str:
    """The bucket of a stack: ``WAKE`` if it waits, else the first rule that any of its frames matches
    (rules are in priority order)."""
    if frames and frames[-1].rpartition(" (")[0] in WAIT_LEAVES:
        return WAKE
    for rule in rules:
        if any(_matches(f, rule) for f in frames):
            return rule[0]
    return OTHER


def read_raw(path: Path) -> dict[tuple[int, str], list[tuple[list[str], int]]]:
    """py-spy's raw output (``--threads``): (tid, thread name) -> [(frames root first, samples)]."""
    out: dict[tuple[int, str], list[tuple[list[str], int]]] = defaultdict(list)
    for line in path.read_text().splitlines() if path.exists() else []:
        stack, _, count = line.rpartition(" ")
        head, *frames = stack.split(";")
        tid, name = re.fullmatch(r"thread \((\w+)\)(?:: (.*))?", head).groups()  # type: ignore[union-attr]
        out[int(tid, 0), name or ""].append((frames, int(count)))
    return out


def shares(stacks: list[tuple[list[str], int]], rules: list[Rule]) -> dict[str, float]:
    """Each bucket's share of a thread's samples."""
    counts: Counter[str] = Counter()
    for frames, n in stacks:
        counts[classify(frames, rules)] += n
    total = sum(counts.values())
    return {b: n / total for b, n in counts.most_common()} if total else {}


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of ``pid``."""
    return {t.id: t.user_time + t.system_time for t in psutil.Process(pid).threads()}


def _comm(pid: int, tid: int) -> str:
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return "?"


@dataclass
class Seen:
    """What the launcher started: role -> pid, and the run directory."""

    pids: dict[str, int] = field(default_factory=dict)
    run_dir: Path | None = None


class WatchingBackend(LocalBackend):
    """``LocalBackend`` that notes each role's pid (roles bound to cores as ``switchps run`` binds them)."""

    def __init__(self, seen: Seen, cfg: RunConfig) -> None:
        super().__init__(bindings=local_backend(cfg).bindings)
        self.seen = seen

    def start(self, role: RoleSpec) -> Child:
        child = super().start(role)
        self.seen.run_dir = role.run_dir
        self.seen.pids[role.role] = child.proc.pid
        return child


@dataclass
class Window:
    """One window: versions and times at its ends, and CPU seconds per (role, tid) spent within it."""

    v0: int = 0
    v1: int = 0
    seconds: float = 0.0
    cpu: dict[str, dict[int, float]] = field(default_factory=dict)
    names: dict[str, dict[int, str]] = field(default_factory=dict)

    @property
    def updates_per_s(self) -> float:
        return (self.v1 - self.v0) / self.seconds


def _clean_window(client: PSClient, pids: dict[str, int], seconds: float) -> Window:
    roles = ("ps", "worker-0", "evaluator")
    before = {r: thread_cpu(pids[r]) for r in roles}
    w, t0 = Window(v0=client.status().version), time.monotonic()
    time.sleep(seconds)
    after = {r: thread_cpu(pids[r]) for r in roles}
    w.v1, w.seconds = client.status().version, time.monotonic() - t0
    w.cpu = {r: {t: after[r][t] - before[r].get(t, 0.0) for t in after[r]} for r in roles}
    w.names = {r: {t: _comm(pids[r], t) for t in after[r]} for r in roles}
    return w


SAMPLED = (("worker-0", "wall"), ("worker-0", "cpu"), ("ps", "cpu"))
"""The sampled windows, one after another: one py-spy at a time, so it perturbs the run least."""


def _spy(py_spy: str, pid: int, mode: str, args: argparse.Namespace, out: Path) -> None:
    cmd = [py_spy, "record", "--pid", str(pid), "--duration", str(max(1, round(args.seconds))), "--rate",
           str(args.rate), "--format", "raw", "--threads", "--nonblocking", "--output", str(out),
           *(["--idle"] if mode == "wall" else [])]
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"py-spy could not sample pid {pid}: {(done.stderr.strip().splitlines() or ['?'])[-1]}")


def python_threads(py_spy: str, pid: int) -> dict[int, str]:
    """The Python threads of ``pid`` (tid -> name), from ``py-spy dump``."""
    text = subprocess.run([py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True).stdout
    found = re.findall(r'^Thread (0x[0-9a-fA-F]+|\d+) \([^)]*\): "([^"]*)"', text, re.MULTILINE)
    return {int(tid, 0): name for tid, name in found}


def _sampled_windows(client: PSClient, pids: dict[str, int], args: argparse.Namespace,
                     out: Path) -> dict[str, Any]:
    rates: dict[str, float] = {}
    for role, mode in SAMPLED:
        w, t0 = Window(v0=client.status().version), time.monotonic()
        _spy(args.py_spy, pids[role], mode, args, out / f"{role}-{mode}.txt")
        w.v1, w.seconds = client.status().version, time.monotonic() - t0
        rates[f"{role} {mode}"] = round(w.updates_per_s, 1)
    return {"updates_per_s": rates, "threads": {r: python_threads(args.py_spy, pids[r]) for r in ("ps", "worker-0")}}


def observe(cfg: RunConfig, seen: Seen, args: argparse.Namespace, out: Path, result: dict[str, Any]) -> None:
    """The observer thread: wait for training, then the clean window and, with py-spy, the sampled ones."""
    try:
        while seen.run_dir is None or published(seen.run_dir) is None or len(seen.pids) < 4:
            time.sleep(0.1)
        client = PSClient(published(seen.run_dir) or "", timeout_s=5.0, security=client_security(cfg, "status"))
        try:
            while client.status().version == 0:
                time.sleep(0.1)
            time.sleep(args.warmup_s)
            result["clean"] = _clean_window(client, seen.pids, args.seconds)
            if args.py_spy:
                result["sampled"] = _sampled_windows(client, seen.pids, args, out)
        finally:
            client.close()
    except BaseException as e:  # reported in the JSON; the run itself ends on its own clock
        result["error"] = f"{type(e).__name__}: {e}"


def step_timers(run_dir: Path, w: Window) -> dict[str, float]:
    """Worker 0's own timers, mean ms over its steps based on versions inside window ``w``."""
    with (run_dir / "workers.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r["worker"] == "0" and w.v0 <= int(r["base_version"]) < w.v1]
    if not rows:
        return {"steps": 0, "step_period_ms": 0.0}
    mean = lambda k: round(1e3 * sum(float(r[k]) for r in rows) / len(rows), 3)  # noqa: E731
    period = 1e3 * w.seconds / len(rows)
    return {"steps": len(rows), "step_period_ms": round(period, 3), "compute_s": mean("compute_s"),
            "send_s": mean("send_s"), "outside_both": round(period - mean("compute_s") - mean("send_s"), 3)}


def _ms(x: float) -> float:
    return round(1e3 * x, 3)


def thread_table(w: Window, role: str, per: int, python: dict[int, str]) -> list[dict[str, Any]]:
    """CPU ms per step (``per`` steps in the window) of each thread of ``role`` that used any."""
    rows = [{"thread": python.get(t, w.names[role][t]), "python": t in python, "cpu_ms": _ms(s / per)}
            for t, s in w.cpu[role].items() if s > 0]
    return sorted(rows, key=lambda r: -r["cpu_ms"])


def buckets(raw: dict[tuple[int, str], list[tuple[list[str], int]]], thread: str, rules: list[Rule],
            scale_ms: float) -> dict[str, float]:
    """Bucket -> ms per step: a thread's sample shares times ``scale_ms`` (its ms per step)."""
    stacks = [s for (_, name), v in raw.items() if name == thread for s in v]
    return {b: round(share * scale_ms, 3) for b, share in shares(stacks, rules).items()}


def _sum(d: dict[str, float], *keys: str) -> float:
    return round(sum(d.get(k, 0.0) for k in keys), 3)


def summary(t: dict[str, dict[str, float]], evaluator_share: float) -> dict[str, Any]:
    """The brief's rows: worker rows are worker 0's wall ms per step, PS rows the PS's CPU ms per push."""
    w, loop, applier = t["worker_0_main_thread_wall"], t["ps_event_loop_cpu"], t["ps_applier_cpu"]
    both = lambda *k: round(_sum(loop, *k) + _sum(applier, *k), 3)  # noqa: E731
    return {
        "worker compute (wall)": _sum(w, *(k for k in w if k.startswith("compute"))),
        "encode (wall)": _sum(w, "encode"),
        "client call (wall)": _sum(w, CALL),
        "server receive/decode (PS CPU)": both("server receive/decode"),
        "checks and token verification (PS CPU)": both("checks", "token verification"),
        "core (PS CPU)": both("core", "handler glue (service.py)"),
        "apply (PS CPU)": both("apply"),
        "reply encode (PS CPU)": both("reply encode"),
        "reply decode (wall)": _sum(w, "reply decode"),
        "assign the reply to the model (wall)": _sum(w, "assign the reply's values to the model"),
        "record (PS CPU)": both("record (rows, events, counts)"),
        "gRPC aio/asyncio runtime, Python side (PS CPU)": both("gRPC aio and asyncio runtime"),
        "wake-ups: event loop and applier (PS CPU)": both(WAKE),
        "evaluator CPU share of the machine": evaluator_share,
    }


def report(run_dir: Path, clean: Window, sampled: dict[str, Any] | None, out: Path) -> dict[str, Any]:
    """The JSON: the summary rows, the buckets per thread, per-thread CPU, the timers; ms per step."""
    timers = step_timers(run_dir, clean)
    pushes, w0_steps = max(1, clean.v1 - clean.v0), max(1, int(timers["steps"]))
    raw = {f"{r}-{m}": read_raw(out / f"{r}-{m}.txt") for r, m in SAMPLED}
    python: dict[str, dict[int, str]] = (sampled or {}).get("threads", {"ps": {}, "worker-0": {}})
    tid = {(role, name): t for role, names in python.items() for t, name in names.items()}
    cpu = lambda role, name: clean.cpu[role].get(tid.get((role, name), -1), 0.0)  # noqa: E731
    table = {
        "worker_0_main_thread_wall": buckets(raw["worker-0-wall"], MAIN, WORKER_RULES, timers["step_period_ms"]),
        "worker_0_main_thread_cpu": buckets(raw["worker-0-cpu"], MAIN, WORKER_RULES,
                                            1e3 * cpu("worker-0", MAIN) / w0_steps),
        "ps_event_loop_cpu": buckets(raw["ps-cpu"], LOOP, PS_RULES, 1e3 * cpu("ps", LOOP) / pushes),
        "ps_applier_cpu": buckets(raw["ps-cpu"], APPLIER, PS_RULES, 1e3 * cpu("ps", APPLIER) / pushes),
    }
    evaluator = sum(clean.cpu["evaluator"].values()) / clean.seconds
    per = {"ps": pushes, "worker-0": w0_steps}
    return {
        "units": "worker rows: worker 0's wall ms per step of its own; PS rows: the PS's CPU ms per push "
                 "(ASP: per update); threads: CPU ms per step (worker 0) or per push (PS)",
        "summary_ms_per_step": summary(table, round(evaluator / (os.cpu_count() or 1), 4)) if sampled else None,
        "updates_per_s": {"clean": round(clean.updates_per_s, 1), **(sampled or {}).get("updates_per_s", {})},
        "worker_0_timers_ms": timers,
        "process_cpu_ms_per_step": {r: _ms(sum(clean.cpu[r].values()) / n) for r, n in per.items()},
        "native_threads_cpu_ms_per_step": {r: _ms(sum(s for t, s in clean.cpu[r].items() if t not in python[r]) / n)
                                           for r, n in per.items()} if sampled else None,
        "buckets_ms_per_step": table if sampled else None,
        "evaluator_cpu_cores": round(evaluator, 4),
        "threads_cpu_ms_per_step": {r: thread_table(clean, r, n, python[r]) for r, n in per.items()},
        "not_separated": NOT_SEPARATED,
    }


NOT_SEPARATED = {
    "client call": "worker 0's wall time inside grpc's blocking call: the PS's whole handling, both loopback "
                   "transfers, gRPC's client work and any wait for a core, which Python frames cannot tell apart; "
                   "the PS's part is its per-push CPU (the PS rows)",
    "native threads": "gRPC's C-core threads and TensorFlow's pools have no Python frames: their CPU is given per "
                      "thread (threads_cpu_ms_per_step, native_threads_cpu_ms_per_step), not split into buckets",
    "server receive vs gRPC": "transfer and HTTP/2 framing run in gRPC's C core; 'server receive/decode' is the "
                              "Python part only (header parse, payload copy into a pooled buffer)",
    "cpu views": "py-spy's on-CPU samples are of runnable threads: on a loaded 2-core machine they include waits "
                 "for a core. Buckets are shares of those samples scaled to the thread's CPU time (/proc), so a "
                 "bucket that waits for cores more than others is overstated; wake-ups are their own row",
}


def config(args: argparse.Namespace) -> RunConfig:
    """``bench/steps.py``'s run: 2 workers, ASP, authenticated, checkpoints every 30 s."""
    return parse_config({
        "name": "profile-step", "cluster": {"workers": 2}, "model": {"name": "logreg"},
        "data": data_config(args.dim),
        "optimizer": {"name": "sgd", "learning_rate": 0.05}, "protocol": {"name": "asp", "batch": 32},
        "train": {"seconds": args.warmup_s + (1 + len(SAMPLED)) * (args.seconds + 1) + 6}, "eval": {"every_s": 5.0},
        "output": {"dir": tempfile.mkdtemp(prefix="switchps-profile-")}, "checkpoint": {"every_s": 30.0},
    })


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=8.0, help="each window's length")
    ap.add_argument("--warmup-s", type=float, default=4.0, help="training before the first window")
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    ap.add_argument("--dim", type=int, default=784, help="input features (78400: 784,010 parameters)")
    ap.add_argument("--py-spy", default=shutil.which("py-spy"), help="the py-spy binary (default: on PATH; none: "
                    "the clean window only)")
    ap.add_argument("--keep", type=Path, help="keep py-spy's raw profiles in this directory")
    args = ap.parse_args()
    cfg, seen, result = config(args), Seen(), dict[str, Any]()
    out = args.keep or Path(tempfile.mkdtemp(prefix="switchps-pyspy-"))
    out.mkdir(parents=True, exist_ok=True)
    watcher = threading.Thread(target=observe, args=(cfg, seen, args, out, result), daemon=True)
    watcher.start()
    run_dir, _ = launch(cfg, quiet=True, backend=WatchingBackend(seen, cfg))
    watcher.join(60)
    if "clean" not in result:
        raise SystemExit(f"profile_step: no measurement: {result.get('error', 'the run ended first')}")
    table = report(run_dir, result["clean"], result.get("sampled"), out)
    table.update(run_dir=str(run_dir), py_spy=args.py_spy, error=result.get("error"))
    if args.keep is None:
        shutil.rmtree(out, ignore_errors=True)
    print(dumps(table, indent=2))


if __name__ == "__main__":
    main()
