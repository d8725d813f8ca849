"""The peer: TF2 ParameterServerStrategy + ClusterCoordinator, ASP, on loopback, measured in steps/s.

One PS and N workers, each a ``tf.distribute.Server`` in a process of its own, and the coordinator in
another; all started with ``subprocess`` from this process, which never imports TensorFlow (so nothing
forks after a TF import). Every process limits TF to one intra-op and one inter-op thread, but for the
workers, which need two inter-op threads (``WORKER_INTER_OP``: with one they deadlock). The model
is switchps's ``logreg``: a softmax layer ``dim -> classes`` (784 -> 10: 7,850 parameters), its two
variables on the PS; the data are synthetic, generated on each worker (``samples_per_worker`` rows,
cut into batches, sliced once per step as switchps's workers slice theirs). A step is one
``coordinator.schedule`` of a ``tf.function`` that takes the next batch, computes the gradient of the
mean cross-entropy on a worker and applies SGD (``lr``) to the PS's variables. After ``warmup_s`` of
steps, steps are scheduled for ``seconds`` (at most ``IN_FLIGHT_PER_WORKER`` per worker not yet done),
then the coordinator joins: steps/s = steps / (time to the join). On success, error, Ctrl-C or SIGTERM
every process started is stopped and its port checked free.
Prints JSON (only) on stdout.

    python bench/tf_ps.py [--workers 2] [--seconds 20] [--warmup-s 3] [--dim 784] [--batch 32]
"""

from __future__ import annotations

import argparse
import json
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
from typing import Any, Iterator, NoReturn

STARTUP_S = 90.0
"""How long the servers may take to listen and the coordinator to connect and trace, beyond the run."""
STOP_S = 5.0
"""SIGTERM -> SIGKILL grace for a child."""
LOCAL = "127.0.0.1"
WORKER_INTER_OP = 2
"""A worker's inter-op threads. With 1 a worker deadlocks in its first step: the scheduled function
reads and assigns the PS's variables from inside the worker's one inter-op thread (measured: the first
``schedule`` never completes, whatever the PS and the coordinator have). 2 is the fewest that runs."""
IN_FLIGHT_PER_WORKER = 4
"""Steps scheduled but not yet done, per worker: enough that no worker waits for the coordinator.
``schedule`` itself never blocks (its queue is unbounded): without this bound the window would end
with thousands of steps queued, and the join would measure draining them."""


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


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


# ---- inside the child processes (these import TensorFlow) ------------------------------------------


def _tf_threads(inter_op: int = 1) -> Any:
    """TensorFlow, limited to one intra-op thread and ``inter_op`` inter-op threads."""
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(inter_op)
    return tf


def serve(job: str, index: int, cluster: dict[str, list[str]], parent: int) -> None:
    """A ``tf.distribute.Server`` for ``job:index`` (TF_CONFIG set as well), until its parent is gone."""
    os.environ["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": job, "index": index}})
    inter_op = WORKER_INTER_OP if job == "worker" else 1
    tf = _tf_threads(inter_op)
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=inter_op)
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
    """The coordinator: warm up, then schedule steps for ``seconds`` and join; the figures."""
    tf = _tf_threads()
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(tf.train.ClusterSpec(spec["cluster"]),
                                                                    rpc_layer="grpc")
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    kernel, bias = _model(tf, strategy, spec)
    iterator = iter(coordinator.create_per_worker_dataset(_dataset_fn(tf, spec)))
    step = _train_step(tf, strategy, kernel, bias, spec["lr"])
    limit = IN_FLIGHT_PER_WORKER * len(spec["cluster"]["worker"])
    _schedule_for(coordinator, step, iterator, spec["warmup_s"], limit)
    coordinator.join()
    t0 = time.perf_counter()
    steps, last = _schedule_for(coordinator, step, iterator, spec["seconds"], limit)
    coordinator.join()
    window = time.perf_counter() - t0
    return {"steps": steps, "window_s": round(window, 3), "steps_per_s": round(steps / window, 1),
            "last_loss": round(float(last.fetch()), 4), "tensorflow": tf.__version__,
            "inter_op_threads": {"ps": 1, "worker": WORKER_INTER_OP, "coordinator": 1}, "in_flight_limit": limit}


def _schedule_for(coordinator: Any, step: Any, iterator: Any, seconds: float, limit: int) -> tuple[int, Any]:
    """Schedule steps for ``seconds``, at most ``limit`` not yet done; (how many, the last's RemoteValue)."""
    pending: deque[Any] = deque()
    steps, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        if len(pending) >= limit:
            pending.popleft().fetch()  # waits for the oldest step (its loss: one scalar)
        pending.append(coordinator.schedule(step, args=(iterator,)))
        steps += 1
    return steps, pending[-1]


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


def _start(args: list[str], log: Path) -> subprocess.Popen:
    with log.open("w") as f:
        return subprocess.Popen([sys.executable, __file__, *args], stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=child_env())


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
             lr: float = 0.05, classes: int = 10) -> dict[str, Any]:
    """Start the cluster and the coordinator, measure, stop everything; the figures as a dict."""
    ports = free_ports(workers + 1)
    cluster = cluster_of(ports)
    spec = {"cluster": cluster, "dim": dim, "classes": classes, "batch": batch, "lr": lr, "seconds": seconds,
            "warmup_s": warmup_s, "samples_per_worker": samples_per_worker(dim, workers)}
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="switchps-tfps-") as tmp:
        logs = [Path(tmp, "ps-0.log"), *(Path(tmp, f"worker-{i}.log") for i in range(workers))]
        try:
            parent = str(os.getpid())
            for i, log in enumerate(logs):
                job, index = ("ps", 0) if i == 0 else ("worker", i - 1)
                procs.append(_start(["--serve", job, str(index), "--cluster", json.dumps(cluster),
                                     "--parent", parent], log))
            deadline = time.monotonic() + STARTUP_S + warmup_s + seconds
            _wait_listening(ports, procs, logs, deadline)
            spec_file, result_file, coord_log = Path(tmp, "spec.json"), Path(tmp, "result.json"), Path(tmp, "coord.log")
            spec_file.write_text(json.dumps(spec))
            procs.append(_start(["--coordinate", str(spec_file), "--result", str(result_file), "--parent", parent],
                                coord_log))
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
    ap.add_argument("--serve", nargs=2, metavar=("JOB", "INDEX"), help=argparse.SUPPRESS)
    ap.add_argument("--cluster", help=argparse.SUPPRESS)
    ap.add_argument("--parent", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--coordinate", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve[0], int(args.serve[1]), json.loads(args.cluster), args.parent)
    elif args.coordinate:
        _coordinator_main(Path(args.coordinate), Path(args.result), args.parent)
    else:
        try:
            with stoppable():
                print(json.dumps(run_peer(args.workers, args.seconds, args.warmup_s, args.dim, args.batch, args.lr),
                                 indent=2))
        except KeyboardInterrupt:
            sys.exit("tf_ps: interrupted; every process it started is stopped")


if __name__ == "__main__":
    main()
