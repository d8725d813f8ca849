"""``runtime.max_grad_norm``: a push whose gradient's L2 norm per sample exceeds the bound is refused whole
(INVALID_ARGUMENT, counted as ``push:grad_norm``) on every path a gradient takes, before it joins a sum;
on a sharded PS the bound is on the whole push, its parts' squared norms added up by shard 0. Off by
default: then a finite but absurd gradient is applied."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from switchps.protos import switchps_pb2 as pb
from switchps.protos.codec import PayloadWriter, encode_array
from switchps.protos.segment import available
from switchps.ps_server.shard.followers import Leader, part_key
from switchps.ps_server.validate import check_grad_norm
from switchps.refusals import Rejected
from test_sharded import SIZE as SHARDED_SIZE, grads, make, push  # noqa: F401 (make: a fixture)

pytest_plugins = ["cluster"]  # cluster_factory: a PS on loopback

SIZE = 4096
ABSURD = 3e37
"""One coordinate of issue 42's gradient: finite, and applied today it ends the run at accuracy 0.10."""


def absurd(size: int = SIZE) -> np.ndarray:
    g = np.ones(size, np.float32)
    g[size // 2] = ABSURD
    return g


# ---- without sockets --------------------------------------------------------------------------------


def test_the_bound_is_on_the_norm_of_the_mean_gradient():
    check_grad_norm(9.0, 1, None)  # off: anything finite passes
    check_grad_norm(ABSURD**2, 1, None)
    check_grad_norm(36.0, 3, 2.0)  # sqrt(36) / 3 = 2: at the bound
    with pytest.raises(Rejected) as e:
        check_grad_norm(36.0, 2, 2.0)  # 6 / 2 = 3
    assert e.value.code == "INVALID_ARGUMENT" and e.value.reason == "grad_norm"
    assert "runtime.max_grad_norm" in str(e.value) and "3" in str(e.value)


def test_the_payload_s_squares_are_summed_once_per_value_in_the_finiteness_pass():
    values = np.arange(1, 1001, dtype=np.float32)
    values[7] = ABSURD  # its square overflows float32: summed again in float64
    data = values.tobytes()
    out = np.empty(values.size, np.float32)
    writer = PayloadWriter(out, check_finite=True)
    for a, b in [(0, 6), (6, 1001), (1001, 1002), (1002, 4000)]:  # frames that cut values in two
        writer.add(data[a:b])
    assert writer.finish() is True
    assert writer.squares == pytest.approx(float(np.dot(values.astype(np.float64), values.astype(np.float64))),
                                           rel=1e-6)
    out[:] = 0
    values[3] = np.nan
    writer = PayloadWriter(out, check_finite=True)
    writer.add(values.tobytes())
    assert writer.finish() is False


def test_shard_zero_adds_up_the_followers_squares():
    key = (0, 1, 2, 0)

    async def scenario() -> float:
        leader = Leader(followers=2, wait_s=30)
        leader._heard(1, pb.Verdict(key=part_key(key), squares=9.0))
        leader._heard(2, pb.Verdict(key=part_key(key), squares=16.0))
        return await leader.verdict(key)

    assert asyncio.run(scenario()) == 25.0


# ---- a PS on loopback -----------------------------------------------------------------------------


def _streamed(c, grad: np.ndarray, samples: int, step: int) -> None:
    """A push as a stream of 4 KB frames (what a model over 4 MiB sends), raising the call's error."""
    header = pb.PushHeader(worker=0, base_version=c.core.version, samples=samples, layout_digest=c.layout.digest,
                           nbytes=grad.nbytes, stats=pb.StepStats(step=step))
    channel = grpc.insecure_channel(c.address)
    try:
        call = channel.stream_stream("/switchps.ParameterServer/Push", request_serializer=None,
                                     response_deserializer=None)
        list(call(encode_array(header, grad, 4096), timeout=10))
    finally:
        channel.close()


def _sender(c, path: str):
    w = c.workers[0]
    if path == "shared":
        assert w.client.attach(0, SIZE * 4) and w.client.socket_path, "through the segment and the socket"
    if path == "streamed":
        return lambda grad, samples, step: _streamed(c, grad, samples, step)
    return lambda grad, samples, step: w.push(grad, samples, step=step)


PATHS = ["small", "streamed", pytest.param("shared", marks=pytest.mark.skipif(not available(),
                                                                               reason="no /dev/shm"))]


@pytest.mark.parametrize("path", PATHS)
def test_an_absurd_push_is_refused_counted_and_changes_nothing(cluster_factory, path):
    c = cluster_factory(workers=1, size=SIZE, protocol={"name": "asp"}, max_grad_norm=100.0)
    send = _sender(c, path)
    before = c.params.copy()
    with pytest.raises(grpc.RpcError) as e:
        send(absurd(), 1, 0)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_grad_norm" in e.value.details()
    assert c.rec.rejections == {"push:grad_norm": 1}
    assert [ev["reason"] for ev in c.events("push_rejected")] == ["grad_norm"]
    assert c.core.version == 0 and np.array_equal(c.params, before), "nothing of it applied"
    send(np.ones(SIZE, np.float32), 4, 1)  # norm per sample 64 / 4 = 16: within the bound
    assert c.core.version == 1
    c.store.wait_idle(10)
    np.testing.assert_array_equal(c.params, np.full(SIZE, -0.25, np.float32))


def test_off_by_default_an_absurd_push_is_applied(cluster_factory):
    """Today's behaviour, kept by default: worker identity is trusted, and a finite gradient is applied."""
    c = cluster_factory(workers=1, size=SIZE, protocol={"name": "asp"})
    assert c.ps.max_grad_norm is None
    assert c.workers[0].push(absurd(), 1).reply.applied
    c.store.wait_idle(10)
    assert c.params[SIZE // 2] == -ABSURD and c.rec.rejections == {}


def test_a_refused_push_never_joins_a_bsp_round(cluster_factory):
    c = cluster_factory(workers=2, size=SIZE, protocol={"name": "bsp"}, max_grad_norm=100.0)
    with pytest.raises(grpc.RpcError) as e:
        c.workers[0].push(absurd(), 1, step=0)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and c.core.version == 0
    with ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(lambda w: w.push(np.ones(SIZE, np.float32), 4, step=1), c.workers))
    assert [r.order.version for r in replies] == [1, 1]
    c.store.wait_idle(10)
    np.testing.assert_array_equal(c.params, np.full(SIZE, -0.25, np.float32))  # the two good pushes' mean only
    assert c.rec.rejections == {"push:grad_norm": 1}


# ---- a sharded PS on loopback ---------------------------------------------------------------------


def test_a_sharded_push_is_bounded_whole_though_every_part_is_within(make):
    """Every part of ``flat`` is within the bound, the whole push is not: shard 0 adds the parts' squares
    (a bound checked part by part would let it through), and no shard applies it."""
    s = make(3, protocol={"name": "asp"})
    sizes = s.clients[0].partition.sizes()
    flat = np.ones(SHARDED_SIZE, np.float32)  # samples 1: a part's norm is sqrt(its size)
    bound = (np.sqrt(max(sizes)) + np.sqrt(SHARDED_SIZE)) / 2
    assert np.sqrt(max(sizes)) < bound < np.sqrt(SHARDED_SIZE)
    s.ps.max_grad_norm = float(bound)
    before = s.values()
    with pytest.raises(grpc.RpcError) as e:
        push(s.clients[0], 0, 0, flat, 0, samples=1)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_grad_norm" in e.value.details()
    assert s.ps.rec.rejections == {"push:grad_norm": 1}, "counted once, by shard 0"
    assert [f.summary()["parts_dropped"] for f in s.followers] == [1, 1]
    assert np.array_equal(s.values(), before) and [f.store.version for f in s.followers] == [0, 0]
    assert push(s.clients[0], 0, 0, flat, 0, samples=2).order.version == 1, "half the norm per sample: applied"
    assert [f.store.version for f in s.followers] == [1, 1]


def test_an_absurd_value_in_a_followers_part_is_refused_on_every_shard(make):
    s = make(3, protocol={"name": "asp"})
    s.ps.max_grad_norm = 100.0
    bad = grads(0, 0)
    (a, _), = s.clients[0].partition.ranges(2)[:1]
    bad[a] = ABSURD  # in shard 2's part only
    before = s.values()
    with pytest.raises(grpc.RpcError) as e:
        push(s.clients[0], 0, 0, bad, 0, samples=1)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert s.ps.rec.rejections == {"push:grad_norm": 1}
    assert np.array_equal(s.values(), before) and s.ps.core.version == 0
