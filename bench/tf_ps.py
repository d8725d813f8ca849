"""The peer: TF2 ParameterServerStrategy + ClusterCoordinator, ASP, on loopback, measured in steps/s.

One PS and N workers, each a ``tf.distribute.Server`` in a process of its own, and the coordinator in
another; all started with ``subprocess`` from this process, which never imports TensorFlow (so nothing
forks after a TF import). The model is switchps's ``logreg``: a softmax layer ``dim -> classes``
(784 -> 10: 7,850 parameters), its two variables on the PS; the data are synthetic, generated on each
worker by a per-worker dataset (``samples_per_worker`` rows, cut into batches, sliced once per step as
switchps's workers slice theirs). A step is one ``coordinator.schedule`` of a ``tf.function`` that takes
the next batch, computes the gradient of the mean cross-entropy on a worker and applies SGD (``lr``) to
the PS's variables. Two ways to run it (``--mode``, ``MODES``):

- ``user``, as a user runs it (TF's parameter-server tutorial): TF's default threads in every process,
  and steps scheduled in batches with no step's result fetched, one ``join`` after each batch. Batches
  grow through ``warmup_s`` (``warmed_up_rate``); the window is one batch sized at the last batch's rate
  to take about ``seconds``: steps/s = its steps / (its first ``schedule`` to its ``join``).
- ``tuned``: every process limited to one intra-op and one inter-op thread (a worker two,
  ``WORKER_INTER_OP``), and every step's loss fetched, with at most ``IN_FLIGHT_PER_WORKER`` steps per
  worker not yet done: steps are scheduled for ``warmup_s``, joined, then for ``seconds``, joined;
  steps/s = steps / (time to the join).

On success, error, Ctrl-C or SIGTERM every process started is stopped and its port checked free.
Prints JSON (only) on stdout.

    python bench/tf_ps.py [--mode user|tuned] [--workers 2] [--seconds 20] [--warmup-s 3] [--dim 784]
                          [--batch 32]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn

STARTUP_S = 180.0
"""How long the servers may take to listen and the coordinator to connect and trace, beyond the run (on 2
cores shared with other work, 784k parameters, 90 s was not enough: four TF imports and the first steps)."""
STOP_S = 5.0
"""SIGTERM -> SIGKILL grace for a child."""
LOCAL = "127.0.0.1"
WORKER_INTER_OP = 2
"""A worker's inter-op threads. With 1 a worker deadlocks in its first step: the scheduled function
reads and assigns the PS's variables from inside the worker's one inter-op thread (measured: the first
``schedule`` never completes, whatever the PS and the coordinator have). 2 is the fewest that runs."""
IN_FLIGHT_PER_WORKER = 4
"""``tuned``: steps scheduled but not yet done, per worker: enough that no worker waits for the coordinator.
``schedule`` itself never blocks (its queue holds 256k closures): without this bound the window would end
with thousands of steps queued, and the join would measure draining them."""
MODES = ("user", "tuned")
"""``user``: TF's defaults and no per-step fetch, as TF's tutorial runs it; ``tuned``: TF held to one thread
per pool (``threads``), every step's loss fetched. Which is faster depends on the model and the machine."""
TUNED_INTER_OP = {"ps": 1, "worker": WORKER_INTER_OP, "coordinator": 1}
MIN_BATCH_S = 0.5
"""``user``: the shortest warm-up batch whose rate sizes the window (a batch's join costs one step's latency)."""


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports the OS calls free now (bound to port 0 together, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((LOCAL, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def port_free(port: int) -> bool:
    """Nothing listens on ``port``: a server could bind it again (connections in TIME_WAIT do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((LOCAL, port))
        except OSError:
            return False
    return True


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((LOCAL, port)) == 0


def cluster_of(ports: list[int]) -> dict[str, list[str]]:
    """ClusterSpec dict: the first port is the PS, the rest are the workers."""
    return {"ps": [f"{LOCAL}:{ports[0]}"], "worker": [f"{LOCAL}:{p}" for p in ports[1:]]}


def threads(mode: str, job: str) -> tuple[int, int] | None:
    """(intra-op, inter-op) threads of ``job``'s process (``ps``, ``worker``, ``coordinator``) in ``mode``;
    None: TF's defaults (as many as the cores)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {MODES}")
    return (1, TUNED_INTER_OP[job]) if mode == "tuned" else None


def child_env(mode: str) -> dict[str, str]:
    """A child's environment: this one's, TF's info logs off; ``tuned`` also holds OpenMP to one thread."""
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if mode == "tuned":
        env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


# ---- inside the child processes (these import TensorFlow) ------------------------------------------


def _tf_threads(mode: str, job: str) -> Any:
    """TensorFlow, with ``job``'s ``threads`` in ``mode`` (left as TF sets them where that is None)."""
    import tensorflow as tf

    if (t := threads(mode, job)) is not None:
        tf.config.threading.set_intra_op_parallelism_threads(t[0])
        tf.config.threading.set_inter_op_parallelism_threads(t[1])
    return tf


def serve(job: str, index: int, cluster: dict[str, list[str]], parent: int, mode: str) -> None:
    """A ``tf.distribute.Server`` for ``job:index`` (TF_CONFIG set as well), until its parent is gone."""
    os.environ["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": job, "index": index}})
    tf = _tf_threads(mode, job)
    t = threads(mode, job)
    config = None if t is None else tf.compat.v1.ConfigProto(intra_op_parallelism_threads=t[0],
                                                             inter_op_parallelism_threads=t[1])
    server = tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=job, task_index=index,
                                  protocol="grpc", config=config, start=True)
    _exit_if_orphaned(parent)  # never returns, so ``server`` stays referenced, serving, until then
    raise AssertionError(server)  # pragma: no cover


def _model(tf: Any, strategy: Any, spec: dict[str, Any]) -> tuple[Any, Any]:
    """The logreg's kernel and bias, created under the strategy (so on the PS); Keras' Dense init."""
    dim, classes = spec["dim"], spec["classes"]
    with strategy.scope():
        limit = (6.0 / (dim + classes)) ** 0.5
        kernel = tf.Variable(tf.random.stateless_uniform([dim, classes], [0, 0], -limit, limit), name="kernel")
        bias = tf.Variable(tf.zeros([classes]), name="bias")
    return kernel, bias


def _dataset_fn(tf: Any, spec: dict[str, Any]) -> Any:
    """Each worker's data: ``samples_per_worker`` rows generated there, as batches, repeated."""
    batch, dim, classes = spec["batch"], spec["dim"], spec["classes"]
    batches = max(1, spec["samples_per_worker"] // batch)

    def dataset_fn(_context: Any = None) -> Any:
        x = tf.random.stateless_normal([batches, batch, dim], [1, 2])
        y = tf.random.stateless_uniform([batches, batch], [3, 4], 0, classes, dtype=tf.int32)
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().prefetch(2)

    return dataset_fn


def _train_step(tf: Any, strategy: Any, kernel: Any, bias: Any, lr: float) -> Any:
    """The scheduled ``tf.function``: next batch, gradient on the worker, SGD on the PS's variables."""

    def replica(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            logits = tf.matmul(x, kernel) + bias
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        g_kernel, g_bias = tape.gradient(loss, [kernel, bias])
        kernel.assign_sub(lr * g_kernel)
        bias.assign_sub(lr * g_bias)
        return loss

    @tf.function
    def step(iterator: Any) -> Any:
        x, y = next(iterator)
        return strategy.run(replica, args=(x, y))

    return step


def coordinate(spec: dict[str, Any]) -> dict[str, Any]:
    """The coordinator: warm up, then measure a window of steps in ``spec["mode"]``; the figures."""
    mode = spec["mode"]
    tf = _tf_threads(mode, "coordinator")
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(tf.train.ClusterSpec(spec["cluster"]),
                                                                    rpc_layer="grpc")
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    kernel, bias = _model(tf, strategy, spec)
    iterator = iter(coordinator.create_per_worker_dataset(_dataset_fn(tf, spec)))
    step = _train_step(tf, strategy, kernel, bias, spec["lr"])
    workers = len(spec["cluster"]["worker"])
    limit = IN_FLIGHT_PER_WORKER * workers if mode == "tuned" else None
    if limit is not None:
        _schedule_for(coordinator, step, iterator, spec["warmup_s"], limit)
        coordinator.join()
        t0 = time.perf_counter()
        steps, last = _schedule_for(coordinator, step, iterator, spec["seconds"], limit)
        coordinator.join()
    else:
        batch = lambda n: scheduled_then_joined(coordinator, step, iterator, n)  # noqa: E731
        rate = warmed_up_rate(batch, spec["warmup_s"], first=workers)
        steps = max(workers, round(rate * spec["seconds"]))
        t0 = time.perf_counter()
        last = batch(steps)
    window = time.perf_counter() - t0
    return {"mode": mode, "steps": steps, "window_s": round(window, 3), "steps_per_s": round(steps / window, 1),
            "last_loss": round(float(last.fetch()), 4), "tensorflow": tf.__version__,
            "threads": {job: threads(mode, job) or "TF's default" for job in TUNED_INTER_OP},
            "coordinator_threads_read_back": {"intra_op": tf.config.threading.get_intra_op_parallelism_threads(),
                                              "inter_op": tf.config.threading.get_inter_op_parallelism_threads()},
            "per_step_fetch": limit is not None, "in_flight_limit": limit}


def _schedule_for(coordinator: Any, step: Any, iterator: Any, seconds: float, limit: int,
                  clock: Callable[[], float] = time.perf_counter) -> tuple[int, Any]:
    """``tuned``: schedule steps for ``seconds``, at most ``limit`` not yet done; (how many, the last's
    RemoteValue)."""
    pending: deque[Any] = deque()
    steps, end = 0, clock() + seconds
    while clock() < end:
        if len(pending) >= limit:
            pending.popleft().fetch()  # waits for the oldest step (its loss: one scalar)
        pending.append(coordinator.schedule(step, args=(iterator,)))
        steps += 1
    return steps, pending[-1]


def scheduled_then_joined(coordinator: Any, step: Any, iterator: Any, steps: int) -> Any:
    """``user``: ``steps`` steps scheduled at once, then one ``join``, as TF's tutorial runs an epoch (no
    step's result fetched); the last step's RemoteValue."""
    for _ in range(steps):
        last = coordinator.schedule(step, args=(iterator,))
    coordinator.join()
    return last


def warmed_up_rate(batch: Callable[[int], object], warmup_s: float, first: int,
                   clock: Callable[[], float] = time.perf_counter) -> float:
    """Run ``batch(n)`` (n steps, all done when it returns) from ``n = first``, each batch at most twice the
    last and no more than the rest of ``warmup_s`` (or ``MIN_BATCH_S``, if more) holds at the last batch's
    rate (never fewer than ``first``). Stop once ``warmup_s`` has passed, a batch after the first (which
    traces and connects) has run, and the last took ``MIN_BATCH_S`` or more; its steps/s."""
    n, start, batches = first, clock(), 0
    while True:
        t0 = clock()
        batch(n)
        now = clock()
        batches += 1
        rate, left = n / (now - t0), warmup_s - (now - start)
        if left <= 0 and batches > 1 and now - t0 >= MIN_BATCH_S:
            return rate
        n = max(first, min(2 * n, math.ceil(rate * max(left, MIN_BATCH_S))))


# ---- in the bench's own process (no TensorFlow here) -------------------------------------------------


@contextmanager
def stoppable() -> Iterator[None]:
    """SIGTERM raises SystemExit and SIGINT KeyboardInterrupt (even if inherited as ignored, as in a
    background job), so the ``finally`` that stops the children runs."""
    def exit_(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, exit_), signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])


def stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every child still running, SIGKILL those alive after ``STOP_S``; reap them all."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    end = time.monotonic() + STOP_S
    for p in procs:
        with suppress(subprocess.TimeoutExpired):
            p.wait(max(0.0, end - time.monotonic()))
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def _tail(log: Path, lines: int = 12) -> str:
    text = log.read_text(errors="replace").splitlines() if log.exists() else []
    return "\n".join(text[-lines:])


def _start(args: list[str], log: Path, mode: str) -> subprocess.Popen:
    with log.open("w") as f:
        return subprocess.Popen([sys.executable, __file__, *args, "--mode", mode], stdout=f,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=child_env(mode))


def _wait_listening(ports: list[int], procs: list[subprocess.Popen], logs: list[Path], deadline: float) -> None:
    for port, proc, log in zip(ports, procs, logs):
        while not listening(port):
            if proc.poll() is not None:
                raise RuntimeError(f"{log.stem} exited with {proc.returncode}:\n{_tail(log)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{log.stem} does not listen on {port}:\n{_tail(log)}")
            time.sleep(0.1)


def _wait_result(coord: subprocess.Popen, log: Path, deadline: float) -> None:
    while coord.poll() is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the coordinator did not finish in time:\n{_tail(log)}")
        time.sleep(0.2)
    if coord.returncode != 0:
        raise RuntimeError(f"the coordinator exited with {coord.returncode}:\n{_tail(log)}")


def train_rows(dim: int) -> int:
    """Training rows of ``dim`` features, as in ``bench/steps.py``'s switchps runs: 16,000 of 784 (its
    synthetic set: 20,000 rows, a fifth held out), as many floats for a larger ``dim``, at least 512."""
    return max(512, 16000 * 784 // max(dim, 784))


def samples_per_worker(dim: int, workers: int) -> int:
    """Rows each worker generates: the training rows split ``workers`` ways (switchps's partitions)."""
    return max(1, train_rows(dim) // workers)


def run_peer(workers: int = 2, seconds: float = 20.0, warmup_s: float = 3.0, dim: int = 784, batch: int = 32,
             lr: float = 0.05, classes: int = 10, mode: str = "user") -> dict[str, Any]:
    """Start the cluster and the coordinator, run TF in ``mode`` (``MODES``), measure, stop everything; the
    figures as a dict."""
    threads(mode, "ps")  # an unknown mode fails here, before any process starts
    ports = free_ports(workers + 1)
    cluster = cluster_of(ports)
    spec = {"cluster": cluster, "dim": dim, "classes": classes, "batch": batch, "lr": lr, "seconds": seconds,
            "warmup_s": warmup_s, "samples_per_worker": samples_per_worker(dim, workers), "mode": mode}
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="switchps-tfps-") as tmp:
        logs = [Path(tmp, "ps-0.log"), *(Path(tmp, f"worker-{i}.log") for i in range(workers))]
        try:
            parent = str(os.getpid())
            for i, log in enumerate(logs):
                job, index = ("ps", 0) if i == 0 else ("worker", i - 1)
                procs.append(_start(["--serve", job, str(index), "--cluster", json.dumps(cluster),
                                     "--parent", parent], log, mode))
            deadline = time.monotonic() + STARTUP_S + warmup_s + seconds
            _wait_listening(ports, procs, logs, deadline)
            spec_file, result_file, coord_log = Path(tmp, "spec.json"), Path(tmp, "result.json"), Path(tmp, "coord.log")
            spec_file.write_text(json.dumps(spec))
            procs.append(_start(["--coordinate", str(spec_file), "--result", str(result_file), "--parent", parent],
                                coord_log, mode))
            _wait_result(procs[-1], coord_log, deadline)
            result = json.loads(result_file.read_text())
        finally:
            stop(procs)
    freed = _ports_freed(ports)
    return {"benchmark": "tf2_parameter_server_strategy", "model": f"logreg {dim}->{classes} "
            f"({dim * classes + classes:,} parameters)", "workers": workers, "batch": batch, "lr": lr,
            "warmup_s": warmup_s, **result, "ports_freed": freed}


def _ports_freed(ports: list[int], wait_s: float = 5.0) -> bool:
    end = time.monotonic() + wait_s
    while not all(port_free(p) for p in ports):
        if time.monotonic() > end:
            return False
        time.sleep(0.1)
    return True


def _exit_if_orphaned(parent: int) -> NoReturn:
    """A daemon thread's loop: end this process once its parent is gone (the bench was SIGKILLed)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def _coordinator_main(spec_file: Path, result_file: Path, parent: int) -> None:
    """The coordinator process: write the result, then exit at once (its threads may hold up a normal exit)."""
    threading.Thread(target=_exit_if_orphaned, args=(parent,), daemon=True).start()
    code = 1
    try:
        result_file.write_text(json.dumps(coordinate(json.loads(spec_file.read_text()))))
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=20.0, help="the measured window")
    ap.add_argument("--warmup-s", type=float, default=3.0, help="steps before the window (traces, connections)")
    ap.add_argument("--dim", type=int, default=784, help="input features (78400: 784,010 parameters)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--mode", choices=MODES, default="user",
                    help="user: TF's default threads, no per-step fetch, a join per batch (TF's tutorial); "
                         "tuned: 1 thread per pool, every step's loss fetched")
    ap.add_argument("--serve", nargs=2, metavar=("JOB", "INDEX"), help=argparse.SUPPRESS)
    ap.add_argument("--cluster", help=argparse.SUPPRESS)
    ap.add_argument("--parent", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--coordinate", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve[0], int(args.serve[1]), json.loads(args.cluster), args.parent, args.mode)
    elif args.coordinate:
        _coordinator_main(Path(args.coordinate), Path(args.result), args.parent)
    else:
        try:
            with stoppable():
                print(json.dumps(run_peer(args.workers, args.seconds, args.warmup_s, args.dim, args.batch, args.lr,
                                          mode=args.mode), indent=2))
        except KeyboardInterrupt:
            sys.exit("tf_ps: interrupted; every process it started is stopped")


if __name__ == "__main__":
    main()
