"""``runtime.wire_dtype``: pushes and replies cross gRPC bytes and shared memory in the narrow type while the
PS keeps float32 values; a worker of another type is refused at registration; the evaluator's pull gets
the PS's float32 values; the emulated link and the simulator charge the wire's bytes; a real run on digits
converges with bfloat16 through either path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from switchps.config.run import parse_config
from switchps.protos import wire_dtype as wd
from switchps.protos.layout import with_wire
from switchps.sim.run import simulate
from switchps.security.channels import ClientSecurity
from switchps.worker.client import PSClient

import test_sharded as sharded
from test_sharded import make  # noqa: F401  (a fixture: shards on loopback)

from test_launch import CONFIGS, check_run_dir, run
from test_sim import column, config

pytest_plugins = ["cluster"]  # cluster_factory: a PS on loopback
torch.set_num_threads(1)

SIZE = 1000
BIG = 2_500_000  # 10 MB of float32 (past the store's inline updates), 5 MB on the wire (past one message)


def _round(x: np.ndarray, wire: str) -> np.ndarray:
    out = np.empty_like(x)
    wd.widen(wd.narrowed(x, wire), out)
    return out


@pytest.mark.parametrize("shared", [False, True], ids=["grpc", "shared_memory"])
@pytest.mark.parametrize("wire,size", [("bfloat16", SIZE), ("float16", SIZE), ("bfloat16", BIG)],
                         ids=["bfloat16", "float16", "bfloat16_streamed"])
def test_a_push_and_its_reply_cross_narrow_while_the_ps_keeps_float32(cluster_factory, wire, size, shared):
    """SGD at learning rate 1 with one sample: the PS's values are minus the sum of the widened pushes, in
    float32 (two pushes sum to values the wire type cannot hold), and the worker gets them narrowed once.
    ``BIG``: a push streamed in frames, an update on the applier thread publishing narrow chunks as it goes."""
    c = cluster_factory(workers=1, size=size, protocol={"name": "asp"}, wire_dtype=wire)
    w = c.workers[0]
    if shared:
        assert w.client.attach(0, size * 2) and w.client.segment.grad.dtype == wd.STORAGE[wire]
    rng = np.random.default_rng(0)
    g1, g2 = rng.standard_normal(size).astype(np.float32), rng.standard_normal(size).astype(np.float32) * 1e-3
    w.push(g1, 1)
    r = w.push(g2, 1)
    assert r.reply.applied and r.reply.nbytes == size * 2 and r.reply.shared == shared
    master = -(_round(g1, wire) + _round(g2, wire))  # float32 sums, as the PS's SGD makes them
    assert c.store.values.dtype == np.float32
    assert np.array_equal(c.store.values, master)
    assert not np.array_equal(master, _round(master, wire)), "the master holds more than the wire can"
    assert np.array_equal(w.params, _round(master, wire))
    evaluator = PSClient(c.address, timeout_s=30)  # float32, asking for the master's values
    values = np.empty(size, np.float32)
    assert evaluator.pull(values, master=True).reply.nbytes == size * 4
    assert np.array_equal(values, master)
    evaluator.close()


def test_a_worker_of_another_wire_dtype_is_refused_at_registration(cluster_factory):
    c = cluster_factory(workers=2, size=4, protocol={"name": "asp"}, wire_dtype="bfloat16")
    other = c.workers[1].client
    with pytest.raises(grpc.RpcError) as err:
        other.register(1, with_wire(c.layout, "float32"), 100)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.details() == ("worker 1 sends runtime.wire_dtype float32, the PS takes bfloat16: "
                                   "the same runtime.wire_dtype on every role")
    assert c.rec.rejections["register:wire_dtype"] == 1
    other.register(1, c.layout, 100)  # the same layout saying the PS's type is taken


def test_the_link_charges_a_push_and_its_reply_their_wire_bytes(cluster_factory, monkeypatch):
    c = cluster_factory(workers=1, size=SIZE, protocol={"name": "asp"}, wire_dtype="bfloat16", link_mbit_s=1000.0)
    charged: list[tuple[str, int]] = []
    for side in ("inbound", "outbound"):
        link = getattr(c.ps.link, side)
        monkeypatch.setattr(link, "admit", lambda n, now, admit=link.admit, side=side: charged.append((side, n))
                            or admit(n, now))
    c.workers[0].push(np.ones(SIZE, np.float32), 1)
    assert charged == [("inbound", SIZE * 2), ("outbound", SIZE * 2)]


def test_the_simulator_charges_half_the_bytes_on_a_bfloat16_wire(tmp_path):
    """As ``test_sim``'s shared link, each transfer 0.05 s, not 0.1: 0.1 s pulls, 0.1 s compute, 0.1 s pushes."""
    cfg = config(cluster={"workers": 2}, train={"steps": 3}, network={"ps_link_mbit_s": 0.208},
                 runtime={"wire_dtype": "bfloat16"})
    simulate(cfg, tmp_path / "r")
    assert [float(t) for t in column(tmp_path / "r", "time_s")] == pytest.approx([0.3, 0.6, 0.9])


def test_three_shards_on_a_bfloat16_wire_apply_what_one_applies_and_carry_half_the_bytes(make):
    """Followers take narrow parts and answer narrow ones: bit for bit what one PS on the same wire applies,
    their float32 values kept; the initial values cross in float32, every push part in half the bytes; the
    evaluator's pull joins every shard's float32 values."""
    one, three = (make(k, protocol={"name": "asp"}, wire="bfloat16") for k in (1, 3))
    sharded.asp_rounds(one, 6)
    sharded.asp_rounds(three, 6)
    assert np.array_equal(three.values(), one.values())
    for f in three.followers:
        r, nbytes = f.summary(), f.store.values.nbytes
        assert f.store.values.dtype == np.float32
        assert r["bytes_in"] == nbytes + 12 * nbytes // 2, "the initial values in float32, 12 narrow pushes"
    addresses = [c.address for c in three.clients[0].clients]
    evaluator = sharded.connect(addresses, sharded.LAYOUT, sharded.MAX_BYTES, 2**20, ClientSecurity())
    values = np.empty(sharded.SIZE, np.float32)
    evaluator.pull(values, master=True)
    assert np.array_equal(values, three.values())
    evaluator.close()


@pytest.mark.integration
@pytest.mark.parametrize("shared", [True, False], ids=["shared_memory", "grpc"])
def test_a_bfloat16_run_trains_digits(tmp_path, shared):
    """The torch quickstart (BSP, 4 workers) on a bfloat16 wire reaches the float32 run's bar."""
    proc, run_dir = run(tmp_path, str(CONFIGS / "torch" / "quickstart.yaml"), "--set", "runtime.wire_dtype=bfloat16",
                        "--set", f"runtime.shared_memory={str(shared).lower()}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = check_run_dir(run_dir, "torch", "model.pt")
    assert summary["final_test_accuracy"] >= 0.93 and summary["pushes_rejected"] == 0, summary
    logs = [f.read_text() for f in sorted((run_dir / "logs").glob("worker-*.log"))]
    assert logs and all(("pushes through shared memory" in log) == shared for log in logs)


@pytest.mark.integration
def test_the_benchmark_compares_accuracy_and_bytes_seed_by_seed(tmp_path):
    out = tmp_path / "wire.json"
    proc = subprocess.run([sys.executable, "bench/wire_dtype.py", "--suites", "torch_quickstart", "--seeds", "0",
                           "--dtypes", "float32", "bfloat16", "--conversion-size", "1000", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=Path(__file__).parent.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    suite = json.loads(out.read_text())["suites"]["torch_quickstart"]
    assert suite["bytes_per_step"] == {"float32": 8 * suite["parameters"], "bfloat16": 4 * suite["parameters"]}
    assert suite["accuracy"]["bfloat16"]["mean"] >= 0.93
    assert suite["accuracy_minus_float32_points"]["bfloat16"]["n"] == 1
    assert json.loads(proc.stdout) == json.loads(out.read_text())
