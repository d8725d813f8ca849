"""A real PS on loopback, driven by NumPy 'workers' that speak the real wire protocol.

A pytest plugin for the tests that need sockets (``pytest_plugins = ["cluster"]``): it imports grpc
and the PS driver, which ``conftest.py`` must not, so that the core's tests run without grpc.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from switchps.security import auth
from switchps.security.channels import ClientSecurity, ServerSecurity
from switchps.config.run import parse_config
from switchps.config.security import TLSSpec
from switchps.protos import switchps_pb2 as pb
from switchps.ps_server.rpc.main import build_ps, prepare_run_dir
from switchps.protos.layout import make_layout, with_wire
from switchps.ps_server.rpc.server import Server
from switchps.ps_server.rpc.service import ParameterServer
from switchps.worker.client import PSClient, Reply


@dataclass
class FakeWorker:
    """A worker without TF: pushes whatever gradient the test dictates."""

    index: int
    client: PSClient
    layout: pb.Layout
    size: int
    version: int = 0
    params: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.params = np.zeros(self.size, np.float32)

    def push(self, grad: np.ndarray, samples: int, base_version: int | None = None, session: int = 0,
             step: int = 0) -> Reply:
        header = pb.PushHeader(worker=self.index, samples=samples, layout_digest=self.layout.digest,
                               base_version=self.version if base_version is None else base_version,
                               session=session, stats=pb.StepStats(step=step))
        r = self.client.push(header, np.ascontiguousarray(grad, np.float32), self.params)
        if r.fresh and r.values is not self.params:  # through shared memory: the values are in the segment
            self.params[:] = r.values
        self.version = r.order.version
        return r

    def push_async(self, grad: np.ndarray, samples: int) -> "Pending":
        return Pending(self, grad, samples)


class Pending(threading.Thread):
    """A push running in a thread, to observe blocking."""

    def __init__(self, w: FakeWorker, grad: np.ndarray, samples: int) -> None:
        super().__init__(daemon=True)
        self.w, self.grad, self.samples = w, grad, samples
        self.reply: Reply | None = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.reply = self.w.push(self.grad, self.samples)
        except BaseException as e:  # surfaced by result()
            self.error = e

    def result(self, timeout: float = 10.0) -> Reply:
        self.join(timeout)
        assert not self.is_alive(), "push still blocked"
        if self.error:
            raise self.error
        assert self.reply is not None
        return self.reply


@dataclass
class LiveCluster:
    ps: ParameterServer
    address: str
    run_dir: Path
    workers: list[FakeWorker]
    layout: pb.Layout
    server: Server

    @property
    def core(self):
        return self.ps.core

    @property
    def rec(self):
        return self.ps.rec

    @property
    def store(self):
        return self.ps.store

    @property
    def params(self) -> np.ndarray:
        return self.ps.store.values

    def events(self, kind: str | None = None) -> list[dict]:
        self.rec.flush()
        rows = [json.loads(line) for line in (self.run_dir / "events.jsonl").read_text().splitlines() if line]
        return [r for r in rows if kind is None or r["event"] == kind]

    def ps_rows(self) -> list[dict]:
        import csv

        self.store.wait_idle(10)  # every update the core made is applied and its row recorded
        self.rec.flush()
        with (self.run_dir / "ps.csv").open() as f:
            return list(csv.DictReader(f))


def start_cluster(tmp_path: Path, *, workers: int = 3, size: int = 8, protocol: dict | None = None,
                  train: dict | None = None, optimizer: dict | None = None, chunk_bytes: int | None = None,
                  policy: dict | None = None, link_mbit_s: float | None = None,
                  receive_timeout_s: float = 30.0, state: int = 0, checkpoint: dict | None = None,
                  resume: bool = False, security: ServerSecurity = ServerSecurity(),
                  tls: TLSSpec | None = None, max_grad_norm: float | None = None,
                  ps_threads: int | str = "auto", wire_dtype: str = "float32",
                  cluster: dict | None = None) -> LiveCluster:
    """A real PS on loopback with ``workers`` fake workers holding ``size`` parameters and ``state``
    non-trainable values (pushed after the gradient, averaged per update). With ``security`` the PS
    checks tokens (and serves TLS); each fake worker holds its own token and ``tls`` client files. ``cluster``:
    fields over the cluster section's (elastic bounds: ``workers`` fakes start)."""
    raw = {
        "cluster": {"ps": "127.0.0.1:0", "workers": workers, "startup_timeout_s": 5, **(cluster or {})},
        "data": {"sampling": "replacement"} if cluster and isinstance(cluster.get("workers"), dict) else {},
        "optimizer": optimizer or {"name": "sgd", "learning_rate": 1.0},
        "protocol": {"name": "bsp", **(protocol or {})},
        "train": train or {"steps": 10_000},
        "policy": policy or {},
        "network": {"ps_link_mbit_s": link_mbit_s},
        "runtime": {"receive_timeout_s": receive_timeout_s, "max_grad_norm": max_grad_norm, "ps_threads": ps_threads,
                    "wire_dtype": wire_dtype},
        "checkpoint": checkpoint or {},
    }
    cfg = parse_config(raw)
    ps = build_ps(cfg, tmp_path, prepare_run_dir(cfg, tmp_path, resume))
    if chunk_bytes:
        ps.store.chunk_bytes = chunk_bytes
    server = Server(ps, "127.0.0.1:0", security)
    address = f"localhost:{server.port}" if security.tls else f"127.0.0.1:{server.port}"
    layout = with_wire(make_layout([("w", (size,))], [("s", (state,))] if state else []), wire_dtype)
    fakes = [fake_worker(address, i, layout, size + state, chunk_bytes, security, tls, wire_dtype)
             for i in range(workers)]
    for w in fakes:
        w.version = w.client.pull(w.params, worker=w.index, wait_initialized=True).order.version
    return LiveCluster(ps, address, tmp_path, fakes, layout, server)


def fake_worker(address: str, i: int, layout: pb.Layout, size: int, chunk_bytes: int | None = None,
                security: ServerSecurity = ServerSecurity(), tls: TLSSpec | None = None,
                wire_dtype: str = "float32") -> FakeWorker:
    """Fake worker ``i``, registered (the first to register sends the initial values: zeros)."""
    token = auth.token(security.secret, "worker", i) if security.secret else None
    client = PSClient(address, chunk_bytes or 2 * 1024 * 1024, timeout_s=30,
                      security=ClientSecurity(token, tls or security.tls), wire=wire_dtype)
    reg = client.register(i, layout, partition_size=100, local_steps=True)  # the fakes push what orders ask
    if reg.send_init:
        client.init(i, layout, np.zeros(size, np.float32))
    return FakeWorker(i, client, layout, size)


@pytest.fixture
def cluster_factory(tmp_path):
    made: list[LiveCluster] = []

    def make(**kw) -> LiveCluster:
        c = start_cluster(tmp_path / f"cluster{len(made)}" if made else tmp_path, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        for w in c.workers:
            w.client.close()
        c.server.stop(grace=None)
