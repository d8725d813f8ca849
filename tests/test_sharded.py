"""A sharded PS on loopback: shard 0 and two follower shards as real gRPC servers in this process, fed
by NumPy workers through the real sharded client (``switchps.worker.sharded``)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import grpc
import numpy as np
import pytest

from switchps.security import auth
from switchps.security.certs import write_dir
from switchps.security.channels import ClientSecurity, ServerSecurity
from switchps.config.run import parse_config
from switchps.protos import switchps_pb2 as pb
from switchps.protos import wire_dtype as wd
from switchps.protos.layout import make_layout, with_wire
from switchps.config.security import TLSSpec
from switchps.ps_server.shard.follower import Follower
from switchps.ps_server.rpc.attachments import Attachments
from switchps.ps_server.rpc.main import build_ps, prepare_run_dir
from switchps.ps_server.store import ModelStore
from switchps.optim.optimizers import optimizer_factory
from switchps.ps_server.rpc.server import Server
from switchps.ps_server.rpc.service import ParameterServer
from switchps.worker.client import PSClient
from switchps.worker.sharded import ShardedClient, connect

LAYOUT = make_layout([("kernel", (40, 8)), ("bias", (8,)), ("extra", (30,))], [("moving", (6,))])
SIZE = 40 * 8 + 8 + 30 + 6
MAX_BYTES = 400  # the 1,280-byte kernel becomes 4 row blocks
SECRET = b"0123456789abcdef" * 4


@dataclass
class Sharded:
    """Shard 0, its followers, their servers and one client per worker."""

    ps: ParameterServer
    followers: list[Follower]
    servers: list[Server]
    clients: list[Any]

    def values(self) -> np.ndarray:
        """The whole model, joined from every shard's part."""
        self.ps.store.wait_idle(10)
        for f in self.followers:
            f.store.wait_idle(10)
        if not self.followers:
            return self.ps.store.values.copy()
        client = self.clients[0]
        return client.partition.join([self.ps.store.values, *(f.store.values for f in self.followers)])


def config(shards: int, workers: int, protocol: dict, wire: str = "float32") -> Any:
    return parse_config({
        "cluster": {"ps": ["127.0.0.1:0"] * shards if shards > 1 else "127.0.0.1:0", "workers": workers,
                    "startup_timeout_s": 5},
        "optimizer": {"name": "adam", "learning_rate": 0.01},
        "protocol": {"name": "bsp", **protocol}, "train": {"steps": 10_000},
        "checkpoint": {"every_s": None}, "runtime": {"receive_timeout_s": 5, "wire_dtype": wire}})


def start(tmp_path: Path, shards: int, workers: int = 2, protocol: dict | None = None,
          max_bytes: int = MAX_BYTES, layout: pb.Layout = LAYOUT, tls: TLSSpec | None = None,
          tokens: bool = False, follower_timeout_s: float = 5.0, wire: str = "float32") -> Sharded:
    """With ``tokens``: a token on every call (followers as role ``shard``); with ``tls``, mutual TLS too;
    ``wire``: every role's ``runtime.wire_dtype``."""
    cfg = config(shards, workers, protocol or {}, wire)
    cfg.runtime.shard_max_mb = MAX_BYTES / 2**20
    ps = build_ps(cfg, tmp_path, prepare_run_dir(cfg, tmp_path, False))
    tokens = tokens or tls is not None
    security = ServerSecurity(SECRET, tls) if tokens else ServerSecurity()
    client = (lambda role, i: ClientSecurity(auth.token(SECRET, role, i), tls)) if tokens else \
        (lambda role, i: ClientSecurity())
    host = "localhost" if tls else "127.0.0.1"
    servers = [Server(ps, "127.0.0.1:0", security)]
    addresses = [f"{host}:{servers[0].port}"]
    followers = []
    for k in range(1, shards):
        store = ModelStore(optimizer_factory(cfg.optimizer), cfg.runtime.chunk_bytes, workers=workers, wire=wire)
        followers.append(Follower(k, shards, addresses[0], client("shard", k), store, MAX_BYTES, follower_timeout_s,
                                  tmp_path / "checkpoints" / f"shard-{k}", workers=workers))
        servers.append(Server(followers[-1], "127.0.0.1:0", security))
        addresses.append(f"{host}:{servers[-1].port}")
    deadline = time.monotonic() + 10
    while shards > 1 and not ps.admission.leader.attached:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "the followers attach"
        time.sleep(0.01)
    layout = with_wire(layout, wire)
    clients = [connect(addresses, layout, max_bytes, 2**20, client("worker", i)) for i in range(workers)]
    if layout.digest != LAYOUT.digest:
        return Sharded(ps, followers, servers, clients)
    for i, c in enumerate(clients):
        if c.register(i, layout, 100, local_steps=True).send_init:
            c.init(i, layout, np.linspace(-1, 1, SIZE, dtype=np.float32))
    for i, c in enumerate(clients):
        c.pull(np.empty(SIZE, np.float32), worker=i, wait_initialized=True)
    return Sharded(ps, followers, servers, clients)


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Any]:
    made: list[Sharded] = []

    def factory(shards: int, **kw: Any) -> Sharded:
        made.append(start(tmp_path / f"c{len(made)}", shards, **kw))
        return made[-1]

    yield factory
    for s in made:
        for c in s.clients:
            c.close()
        for server in s.servers:
            server.stop(grace=None)


def push(client: PSClient | ShardedClient, worker: int, step: int, grad: np.ndarray, version: int,
         samples: int = 4, local_steps: int = 0) -> pb.PushReply:
    """``local_steps``: ``grad`` is what that many local steps moved (times ``samples``), not a gradient."""
    header = pb.PushHeader(worker=worker, base_version=version, samples=samples, layout_digest=LAYOUT.digest,
                           session=7, stats=pb.StepStats(step=step, local_steps=local_steps,
                                                         local_loss_sums=[1.0] * local_steps))
    out = np.empty(SIZE, np.float32)
    return client.push(header, np.ascontiguousarray(grad, np.float32), out).reply


def grads(worker: int, step: int) -> np.ndarray:
    return np.random.default_rng(1000 * worker + step).normal(size=SIZE).astype(np.float32)


def asp_rounds(s: Sharded, rounds: int, local_steps: int = 0) -> None:
    version = 0
    for step in range(rounds):
        for w, c in enumerate(s.clients):
            version = push(c, w, step, grads(w, step), version, local_steps=local_steps).order.version


def test_three_shards_apply_what_one_applies_bit_for_bit(make):
    one, three = make(1, protocol={"name": "asp"}), make(3, protocol={"name": "asp"})
    asp_rounds(one, 12)
    asp_rounds(three, 12)
    parts = three.clients[0].partition.parts
    assert all(any(p.name == "kernel" for p in part) for part in parts), "the kernel's 4 blocks spread"
    three.ps.rec.flush()
    events = [json.loads(x) for x in (three.ps.rec.run_dir / "events.jsonl").read_text().splitlines()]
    (recorded,) = [e for e in events if e["event"] == "model_partitioned"]
    assert recorded["digest"] == three.clients[0].partition.digest and sum(recorded["sizes"]) == SIZE
    assert recorded["pieces"] == three.clients[0].partition.describe(), "the run record names every piece"
    assert three.ps.core.version == one.ps.core.version == 24
    assert [f.store.version for f in three.followers] == [24, 24], "every shard at the same version"
    assert np.array_equal(three.values(), one.values()), "bit-identical parameters"
    for f in three.followers:
        r, nbytes = f.summary(), f.store.values.nbytes
        assert r["parts_applied"] == 24 and r["bytes_in"] == (1 + 24) * nbytes, "the initial values, 24 pushes"
        assert r["bytes_out"] == (1 + 2 + 24) * nbytes, "the init's reply, 2 pulls, 24 push replies"
        assert r["mean_apply_ms"] > 0 and r["parts_waiting"] == r["replies_held"] == 0


def test_every_shard_steps_movements_with_its_outer_optimizer_and_gradients_with_the_runs(make):
    diloco = {"name": "async_diloco", "local_steps": 2}  # outer: Nesterov; the run's: Adam
    one, three = make(1, protocol=diloco), make(3, protocol=diloco)
    asp_rounds(one, 6, local_steps=2)
    asp_rounds(three, 6, local_steps=2)
    assert np.array_equal(three.values(), one.values())
    for store in (one.ps.store, three.ps.store, *(f.store for f in three.followers)):
        assert store.optimizer.iterations == 0, "no gradient reached the run's optimizer"
        assert [(o.name, o.iterations) for o in store.outer.made.values()] == [("nesterov", 12)]

def test_a_part_refused_by_one_shard_is_refused_by_all_and_changes_no_shard(make):
    s = make(3, protocol={"name": "asp"})
    asp_rounds(s, 2)
    before = s.values()
    bad = grads(0, 2)
    (a, _), = s.clients[0].partition.ranges(2)[:1]
    bad[a] = np.nan  # in shard 2's part only
    with pytest.raises(grpc.RpcError) as e:
        push(s.clients[0], 0, 2, bad, s.ps.core.version)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "PS shard 2" in e.value.details()
    assert np.array_equal(s.values(), before), "no shard's parameters changed"
    assert s.ps.core.version == 4 and [f.store.version for f in s.followers] == [4, 4]
    assert s.ps.rec.rejections["push:shard2:non_finite"] == 1, "counted once, by shard 0"
    assert s.followers[1].rejections["push_part:non_finite"] == 1
    assert s.followers[0].summary()["parts_dropped"] == 1, "shard 1 dropped the part it had accepted"
    push(s.clients[0], 0, 2, grads(0, 2), s.ps.core.version)  # the worker goes on
    assert s.ps.core.version == 5


def test_a_part_refused_by_shard_zero_is_dropped_by_the_followers(make):
    s = make(3, protocol={"name": "asp"})
    bad = grads(1, 0)
    bad[0] = np.inf  # part 0 holds the kernel's first rows
    assert s.clients[1].partition.ranges(0)[0][0] == 0
    with pytest.raises(grpc.RpcError) as e:
        push(s.clients[1], 1, 0, bad, 0)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [f.summary()["parts_dropped"] for f in s.followers] == [1, 1], "not kept until they expire"
    assert s.ps.core.version == 0


def attached(s: Sharded) -> Sharded:
    """Every worker's parts through a segment per shard, as a worker on the shards' host attaches."""
    for i, c in enumerate(s.clients):
        assert c.attach(i, SIZE * 4) and all(k.segment is not None for k in c.clients), "every shard is here"
    return s


@pytest.mark.parametrize("wire", ["float32", "bfloat16"])
def test_every_shard_takes_its_part_through_a_segment_and_applies_what_grpc_bytes_apply(make, wire):
    """Fails where followers take parts only as gRPC bytes: no segment, nothing counted as shared (on a
    narrow wire: segments whose areas hold the wire's type, the initial values still float32 bytes)."""
    grpc_bytes = make(3, protocol={"name": "asp"}, wire=wire)
    shared = attached(make(3, protocol={"name": "asp"}, wire=wire))
    asp_rounds(grpc_bytes, 6)
    asp_rounds(shared, 6)
    assert np.array_equal(shared.values(), grpc_bytes.values()), "bit-identical parameters"
    out = np.empty(SIZE, np.float32)
    reply = shared.clients[0].push(pb.PushHeader(worker=0, base_version=12, samples=4, layout_digest=LAYOUT.digest,
                                                 session=7, stats=pb.StepStats(step=6)), grads(0, 6), out)
    values = np.empty(SIZE, np.float32)
    wd.widen(wd.narrowed(shared.values(), wire), values)  # the master's values as the wire carries them
    assert reply.fresh and np.array_equal(out, values), "the reply's parts, joined from every segment"
    for f, g in zip(shared.followers, grpc_bytes.followers):
        r, nbytes = f.summary(), f.store.values.nbytes
        part = wd.wire_nbytes(f.store.values.size, wire)
        assert r["bytes_in_shared"] == 13 * part and r["bytes_in"] == nbytes + 13 * part, "init as float32 bytes"
        assert r["bytes_out_shared"] == 13 * part and r["rejections"] == {}
        assert g.summary()["bytes_in_shared"] == g.summary()["bytes_out_shared"] == 0


def test_a_non_finite_part_in_a_followers_segment_is_refused_counted_and_changes_no_shard(make):
    s = attached(make(3, protocol={"name": "asp"}))
    asp_rounds(s, 1)
    before = s.values()
    bad = grads(0, 1)
    (a, _), = s.clients[0].partition.ranges(1)[:1]
    bad[a] = np.nan  # in shard 1's part only
    with pytest.raises(grpc.RpcError) as e:
        push(s.clients[0], 0, 1, bad, s.ps.core.version)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "PS shard 1" in e.value.details()
    assert np.array_equal(s.values(), before) and s.ps.core.version == 2
    assert s.ps.rec.rejections["push:shard1:non_finite"] == 1
    assert s.followers[0].rejections["push_part:non_finite"] == 1
    assert s.followers[0].summary()["parts_waiting"] == 0, "nothing of the refused part kept"
    push(s.clients[0], 0, 1, grads(0, 1), s.ps.core.version)  # the worker goes on, through the segment
    assert s.ps.core.version == 3
    assert s.followers[0].summary()["bytes_in_shared"] == 3 * s.followers[0].store.values.nbytes, "3 parts whole"


def test_a_worker_attaches_again_when_a_follower_has_forgotten_its_segment(make):
    """A follower that restarted between two pushes has no segment of the worker's: its part is refused
    (``NOT_ATTACHED``), and the client attaches a new segment to that follower and sends the part again."""
    s = attached(make(2, protocol={"name": "asp"}))
    follower, client = s.followers[0], s.clients[0].clients[1]
    first = client.segment
    forgot = Attachments()  # what a restarted follower has: its socket, and no segments
    forgot.socket, forgot._local = follower.segments.socket, follower.segments._local
    follower.segments = forgot
    assert push(s.clients[0], 0, 0, grads(0, 0), 0).order.version == 1
    assert client.segment is not None and client.segment is not first
    assert follower.rejections == {"push_part:not_attached": 1} and s.ps.rec.rejections == {}
    assert follower.summary()["bytes_in_shared"] == follower.store.values.nbytes


def test_a_follower_whose_socket_is_out_of_reach_is_on_another_host_and_takes_bytes(make):
    s = make(2, protocol={"name": "asp"})
    s.followers[0].segments.socket = "@switchps-ps-" + "0" * 32  # as another host sees the follower's socket
    assert not s.clients[0].attach(0, SIZE * 4), "not every shard's part through shared memory"
    assert s.clients[0].clients[0].segment is not None and s.clients[0].clients[1].segment is None
    assert push(s.clients[0], 0, 0, grads(0, 0), 0).order.version == 1
    r = s.followers[0].summary()
    assert r["bytes_in_shared"] == 0 and r["bytes_in"] == 2 * s.followers[0].store.values.nbytes


def test_a_bsp_round_completes_on_every_shard_at_once(make):
    s = make(3, protocol={"name": "bsp"})
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        for step in range(3):
            replies = list(pool.map(lambda w: push(s.clients[w], w, step, grads(w, step), step), [0, 1]))
            assert {r.order.version for r in replies} == {step + 1}
    assert [f.store.version for f in s.followers] == [3, 3]
    assert s.followers[0].summary()["parts_applied"] == 6


def test_a_worker_with_another_partition_is_refused_with_one_line(tmp_path, make):
    s = make(3)
    other = ShardedClient([c.address for c in s.clients[0].clients], LAYOUT, 2 * MAX_BYTES, 2**20)
    with pytest.raises(grpc.RpcError) as e:
        other.register(0, LAYOUT, 100)
    other.close()
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "partition of the model over 3 shards differs" in e.value.details()


def test_more_shards_than_pieces_is_refused_with_one_line(tmp_path, make):
    tiny = make_layout([("w", (2,))])
    s = make(3, layout=tiny)
    with pytest.raises(grpc.RpcError) as e:
        s.clients[0].register(0, tiny, 100)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "fewer pieces than the 3 shards" in e.value.details()


def bsp_rounds(s: Sharded, rounds: int) -> None:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(s.clients)) as pool:
        for step in range(rounds):
            list(pool.map(lambda w: push(s.clients[w], w, step, grads(w, step), step), range(len(s.clients))))


def test_with_four_workers_three_shards_match_one_to_float32_rounding(make):
    """Each shard sums a round's parts in the order shard 0 joined the pushes, which may differ from
    another run's arrival order: equal up to the rounding of a reordered float32 sum."""
    one, three = make(1, workers=4), make(3, workers=4)
    bsp_rounds(one, 10)
    bsp_rounds(three, 10)
    assert three.ps.core.version == one.ps.core.version == 10
    assert np.allclose(three.values(), one.values(), rtol=1e-5, atol=1e-6)


def test_every_shard_speaks_mutual_tls_and_checks_tokens(tmp_path, make):
    files = write_dir(tmp_path / "certs", [])
    tls = TLSSpec(cert=str(files["server_cert"]), key=str(files["server_key"]), ca=str(files["ca"]),
                  client_cert=str(files["client_cert"]), client_key=str(files["client_key"]), require_client_cert=True)
    s = make(3, protocol={"name": "asp"}, tls=tls)
    asp_rounds(s, 3)
    assert s.ps.core.version == 6 and [f.store.version for f in s.followers] == [6, 6]
    intruder = ShardedClient([c.address for c in s.clients[0].clients], LAYOUT, MAX_BYTES, 2**20,
                             ClientSecurity(auth.token(SECRET, "worker", 1), tls))  # worker 1's token
    with pytest.raises(grpc.RpcError) as e:
        push(intruder, 0, 9, grads(0, 9), 6)  # ... acting as worker 0
    intruder.close()
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert s.followers[0].rejections["push_part:identity"] == 1, "a follower checks who may push too"
    assert np.isfinite(s.values()).all() and s.ps.core.version == 6


def test_a_follower_whose_channel_does_not_connect_in_time_makes_a_registration_unavailable():
    """Registration waits for each follower's channel (after an outage gRPC would fail a part sent before it
    reconnects at once, and shard 0 would wait for it); one that does not connect is UNAVAILABLE: retried."""
    client = PSClient("127.0.0.1:1")  # nothing listens there
    try:
        with pytest.raises(grpc.RpcError) as e:
            client.wait_ready(0.2)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "not connected within 0.2s" in e.value.details()
    finally:
        client.close()
