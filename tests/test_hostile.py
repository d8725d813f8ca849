"""A client written from the .proto alone: broken streams, idle streams, absurd numbers, probing messages.

Each gets an error status, is counted in the run record, and changes nothing.
"""

from __future__ import annotations

import json
import logging
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

from conftest import wait_until
from switchps.protos import switchps_pb2 as pb
from switchps.protos.codec import encode
from switchps.protos.layout import make_layout

pytest_plugins = ["cluster"]  # cluster_factory: a PS on loopback

SIZE = 16
PUSH = "/switchps.ParameterServer/Push"


def _channel(c, **options) -> grpc.Channel:
    return grpc.insecure_channel(c.address, options=[(f"grpc.{k}", v) for k, v in options.items()])


def _stream(channel: grpc.Channel, method: str = PUSH):
    return channel.stream_stream(method, request_serializer=None, response_deserializer=None)


def _frame0(c, **kw) -> bytes:
    """A complete push in one frame: the header with the whole payload inline."""
    fields = dict(worker=0, base_version=0, samples=4, layout_digest=c.layout.digest, nbytes=SIZE * 4)
    fields.update(kw)
    return next(encode(pb.PushHeader(**fields))) + np.ones(SIZE, np.float32).tobytes()


def _unchanged(c, rejected: str, count: int = 1) -> None:
    np.testing.assert_array_equal(c.params, np.zeros(SIZE))
    assert c.store.version == 0
    assert c.rec.rejections[rejected] == count, dict(c.rec.rejections)


def test_a_stream_that_breaks_after_a_complete_first_frame_applies_nothing(cluster_factory):
    c = cluster_factory(workers=1, size=SIZE, protocol={"name": "asp"})
    channel = _channel(c, max_send_message_length=128 * 2**20)

    def oversized():  # grpc ends the stream at the server's size cap, as if the client had half-closed
        yield _frame0(c)
        yield bytes(65 * 2**20)

    ended = threading.Event()

    def stalled():  # the client's deadline passes while the stream is still open: it stalls till the PS ends it
        yield _frame0(c)
        ended.wait(30)

    with pytest.raises(grpc.RpcError) as err:
        list(_stream(channel)(oversized(), timeout=30))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError) as err:
        list(_stream(channel)(stalled(), timeout=0.5))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # the PS sees the passed deadline either as the end of the stream or as the call's cancellation
    pushes = lambda: {k: v for k, v in c.rec.rejections.items() if k.startswith("push:")}  # noqa: E731
    wait_until(lambda: sum(pushes().values()) == 2, what="the stalled stream to end on the PS")
    ended.set()
    assert c.rec.rejections["push:broken_stream"] >= 1 and set(pushes()) <= {"push:broken_stream", "push:cancelled"}
    np.testing.assert_array_equal(c.params, np.zeros(SIZE))
    assert c.store.version == 0
    assert c.workers[0].push(np.ones(SIZE, np.float32), 4).reply.applied, "a good push still works"
    channel.close()


@pytest.mark.parametrize("method, rpc", [(PUSH, "push"), ("/switchps.ParameterServer/Init", "init")])
def test_an_empty_stream_is_invalid_argument_counted_and_logged_once(cluster_factory, caplog, method, rpc):
    c = cluster_factory(workers=1, size=SIZE, protocol={"name": "asp"})
    channel = _channel(c)
    with caplog.at_level(logging.INFO, logger="switchps"), pytest.raises(grpc.RpcError) as err:
        list(_stream(channel, method)(iter([]), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    _unchanged(c, f"{rpc}:empty")
    records = [r for r in caplog.records if "rejected" in r.getMessage()]
    assert len(records) == 1 and records[0].exc_info is None and "\n" not in records[0].getMessage()
    channel.close()


def _open_push_streams() -> float:
    """The PS's own count of open push streams, as its Prometheus endpoint serves it."""
    return REGISTRY.get_sample_value("switchps_push_streams") or 0.0


def test_idle_streams_do_not_starve_health_checks_or_pulls(cluster_factory):
    c = cluster_factory(workers=1, size=SIZE, protocol={"name": "asp"}, receive_timeout_s=3.0)
    channel = _channel(c)
    never = threading.Event()

    def silent():
        never.wait(30)
        yield b""  # pragma: no cover - the server gives up first

    before = _open_push_streams()
    idle = [_stream(channel)(silent(), timeout=30) for _ in range(100)]
    wait_until(lambda: _open_push_streams() == before + 100, what="every stream to be open on the PS")
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING
    w = c.workers[0]
    assert w.client.pull(w.params, worker=0).order.version == 0
    assert w.push(np.ones(SIZE, np.float32), 4).reply.applied
    codes = []
    for call in idle:
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        codes.append(err.value.code())
    assert set(codes) == {grpc.StatusCode.DEADLINE_EXCEEDED}, "the server cuts streams that send nothing"
    assert c.rec.rejections["push:idle"] == 100
    wait_until(lambda: _open_push_streams() == before, what="the PS to close the streams it cut")
    never.set()
    channel.close()


@pytest.mark.parametrize("fields, reason", [
    ({"samples": 2**62}, "samples"),
    ({"samples": 33}, "samples"),  # above the budget of 32 the worker was given
    ({"stats": pb.StepStats(compute_s=float("nan"))}, "stats"),
    ({"stats": pb.StepStats(send_s=float("inf"))}, "stats"),
    ({"stats": pb.StepStats(sleep_s=-1.0)}, "stats"),
    ({"stats": pb.StepStats(loss_sum=float("-inf"))}, "stats"),
    ({"stats": pb.StepStats(step=-5)}, "stats"),
    ({"stats": pb.StepStats(compute_s=3 * 86400.0)}, "stats"),  # days, on a run seconds old
])
def test_absurd_counts_and_statistics_are_rejected(cluster_factory, fields, reason):
    c = cluster_factory(workers=1, size=SIZE, protocol={"name": "asp", "batch": 32}, train={"epochs": 5})
    channel = _channel(c)
    with pytest.raises(grpc.RpcError) as err:
        list(_stream(channel)(iter([_frame0(c, **fields)]), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    _unchanged(c, f"push:{reason}")
    assert not c.core.done and c.core.samples == 0
    channel.close()


def _register(c, worker: int = 0, partition_size: int = 100, layout: pb.Layout | None = None) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        c.workers[0].client.register(worker, layout or c.layout, partition_size)
    return err.value


@pytest.mark.parametrize("kw, reason", [
    ({"partition_size": -1}, "partition_size"),
    ({"partition_size": 0}, "partition_size"),
    ({"worker": 7}, "worker"),
    ({"layout": make_layout([("w", (2**40,))])}, "layout"),
    ({"layout": make_layout([("w", (0,))])}, "layout"),
    ({"layout": pb.Layout(variables=[pb.Variable(name="w", shape=[SIZE])], digest="forged")}, "layout"),
])
def test_bad_registrations_are_rejected_and_the_run_goes_on(cluster_factory, kw, reason):
    c = cluster_factory(workers=1, size=SIZE, protocol={"name": "asp"}, train={"epochs": 5})
    assert _register(c, **kw).code() == grpc.StatusCode.INVALID_ARGUMENT
    assert c.rec.rejections[f"register:{reason}"] == 1
    assert c.core.members.registered == {0: 100} and not c.core.done
    assert c.workers[0].push(np.ones(SIZE, np.float32), 4).reply.applied


def test_error_messages_never_reveal_the_layout_digest(cluster_factory):
    c = cluster_factory(workers=2, size=SIZE)
    secret = c.layout.digest
    foreign = _register(c, 1, layout=make_layout([("other", (3, 3))]))
    channel = _channel(c)
    with pytest.raises(grpc.RpcError) as wrong:
        list(_stream(channel)(iter([_frame0(c, layout_digest="0" * 40)]), timeout=10))
    for err in (foreign, wrong.value):
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        details = err.details()
        assert not any(secret[i : i + 6] in details for i in range(len(secret) - 5)), details
    channel.close()


@pytest.mark.parametrize("report, code", [
    (pb.EvalReport(version=0, test_accuracy=1.5), grpc.StatusCode.INVALID_ARGUMENT),
    (pb.EvalReport(version=0, test_accuracy=float("nan")), grpc.StatusCode.INVALID_ARGUMENT),
    (pb.EvalReport(version=99, test_accuracy=0.5), grpc.StatusCode.INVALID_ARGUMENT),
    (pb.EvalReport(version=0, test_accuracy=0.999, final=True), grpc.StatusCode.FAILED_PRECONDITION),
])
def test_implausible_evaluations_are_rejected(cluster_factory, report, code):
    c = cluster_factory(workers=1, size=SIZE)
    call = _channel(c).unary_unary("/switchps.ParameterServer/Eval", pb.EvalReport.SerializeToString,
                                   pb.Status.FromString)
    with pytest.raises(grpc.RpcError) as err:
        call(report, timeout=10)
    assert err.value.code() == code
    assert sum(v for k, v in c.rec.rejections.items() if k.startswith("eval:")) == 1
    assert not c.rec.evals and c.ps.final_eval is None


def test_a_pull_for_an_unknown_worker_is_rejected(cluster_factory):
    c = cluster_factory(workers=1, size=SIZE)
    with pytest.raises(grpc.RpcError) as err:
        c.workers[0].client.pull(np.empty(SIZE, np.float32), worker=12345)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert c.rec.rejections["pull:unknown_worker"] == 1


def _strict(text: str):
    def refuse(constant: str):
        raise ValueError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


def test_summary_and_events_are_strict_json_even_for_a_diverged_run(tmp_path):
    from switchps.ps_server.records import RunRecorder

    rec = RunRecorder(tmp_path)
    rec.start(time.monotonic())
    rec.evaluation(3, float("nan"), 0.1)
    rec.event("diverged", loss=float("inf"), values=[1.0, float("-inf")])
    summary = rec.close({"final_test_loss": float("nan"), "nested": {"x": float("inf")}})
    assert summary["final_test_loss"] != summary["final_test_loss"]  # the in-memory value is NaN
    saved = _strict((tmp_path / "summary.json").read_text())
    assert saved["final_test_loss"] is None and saved["nested"] == {"x": None}
    (event,) = [_strict(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert event["loss"] is None and event["values"] == [1.0, None]
