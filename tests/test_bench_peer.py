"""The side-by-side benchmarks (``bench/steps.py --vs-tf``, ``bench/tf_ps.py``, ``bench/profile_step.py``):
their usage, and their pure parts. No cluster is started and nothing is timed."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import numpy as np
import pytest

from switchps.config.run import parse_config

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """``bench/steps.py`` as a module, ``bench/`` on the path as when a script runs."""
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("steps")


@pytest.mark.parametrize("script,flag", [("steps.py", "--vs-tf"), ("tf_ps.py", "--warmup-s"),
                                         ("profile_step.py", "--py-spy"), ("shards.py", "transport"),
                                         ("steps.py", "--shards"), ("transport.py", "--shards"),
                                         ("steps.py", "--framework-ab"), ("gpu.py", "--device")])
def test_help(script: str, flag: str) -> None:
    out = subprocess.run([sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage:") and flag in out.stdout


def test_ratio_summary_is_on_the_log_scale(bench: ModuleType) -> None:
    assert bench.ratio_summary([1.2, 0.8, 1.0]) == {"min": 0.8, "median": 1.0, "max": 1.2, "geomean": 0.986,
                                                    "low": 0.5957, "high": 1.634}
    assert bench.ratio_summary([2.0]) == {"min": 2.0, "median": 2.0, "max": 2.0, "geomean": 2.0, "low": None,
                                          "high": None}
    wide = bench.ratio_summary([0.1, 10.0])  # an arithmetic mean gave 5.05 ± 62.9, an interval below 0
    assert wide["geomean"] == 1.0 and 0 < wide["low"] < 1e-12 and wide["high"] > 1e12
    for bad in ([], [2.0, 0.0]):
        with pytest.raises(ValueError):
            bench.ratio_summary(bad)


@pytest.mark.parametrize("ratios,verdict", [([2.7, 2.75, 2.8], "above"), ([2.2, 2.25, 2.3], "below"),
                                            ([2.4, 2.5, 2.7], "not significant either way"),
                                            ([3.0], "not significant either way"),
                                            ([5.0, 8.0, 10.0], "above")])  # arithmetic: 7.67 ± 6.25
def test_ratio_summary_tells_whether_the_pairs_meet_a_target(bench: ModuleType, ratios: list[float],
                                                             verdict: str) -> None:
    assert bench.ratio_summary(ratios, target=2.5)["target"] == {"ratio": 2.5, "verdict": verdict}


def test_data_of_the_small_model_is_switchps_synthetic_set(bench: ModuleType) -> None:
    assert bench.data_config(784) == {"name": "synthetic", "num_samples": 20000, "num_features": 784,
                                      "num_classes": 10}
    assert bench.model_name(784) == "logreg 784->10 (7,850 parameters)"


def test_wide_input_beyond_the_synthetic_limit_is_an_npz(bench: ModuleType) -> None:
    dim = bench.SYNTHETIC_MAX_FEATURES * 2
    data = bench.data_config(dim)
    assert data["name"] == "npz"
    with np.load(data["path"]) as f:
        assert f["x_train"].shape == (bench.train_rows(dim) * 5 // 4, dim)
        assert f["x_train"].dtype == np.uint8 and set(np.unique(f["y_train"])) == set(range(10))
    parse_config({"model": {"name": "logreg"}, "data": data})  # the config accepts it (the file exists)


def test_tf_cluster_and_shares(bench: ModuleType) -> None:
    tf_ps = importlib.import_module("tf_ps")
    ports = tf_ps.free_ports(3)
    assert len(set(ports)) == 3 and all(tf_ps.port_free(p) for p in ports)
    assert tf_ps.cluster_of(ports) == {"ps": [f"127.0.0.1:{ports[0]}"],
                                       "worker": [f"127.0.0.1:{ports[1]}", f"127.0.0.1:{ports[2]}"]}
    assert tf_ps.train_rows(784) == 16000 and tf_ps.samples_per_worker(784, 2) == 8000
    assert tf_ps.train_rows(78400) == 512 and tf_ps.samples_per_worker(78400, 8) == 64


def test_tf_ps_imports_no_tensorflow() -> None:
    """The bench's own process forks children: it must never have imported TF."""
    code = f"import sys; sys.path.insert(0, {str(BENCH)!r}); import tf_ps, steps; print('tensorflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


W = "run_worker (switchps/worker/main.py:60)"
PS_LOOP = ["Thread.run (threading.py:982)", "BaseEventLoop._run_once (asyncio/base_events.py:1922)",
           "Handle._run (asyncio/events.py:80)"]


def test_profile_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    p = importlib.import_module("profile_step")
    compute = [W, "StepRunner._compute (switchps/worker/steps.py:147)",
               "GradientComputer.compute (switchps/workload/tensorflow/gradients.py:94)", "quick_execute (tensorflow/x.py:53)"]
    assert p.classify(compute, p.WORKER_RULES).startswith("compute: TF")
    assert p.classify(compute[:2], p.WORKER_RULES).startswith("compute: sample")
    call = [W, "PSClient.push (switchps/worker/client.py:141)", "_blocking (grpc/_channel.py:1152)"]
    assert p.classify(call, p.WORKER_RULES).startswith("client call")
    decode = [W, "PSClient.push (switchps/worker/client.py:142)",
              "PSClient._read_reply (switchps/worker/client.py:150)",
              "decode_header (switchps/protos/codec.py:110)"]
    assert p.classify(decode, p.WORKER_RULES) == "reply decode"
    token = [*PS_LOOP, "Guard.intercept_service (switchps/ps_server/rpc/guard.py:40)", "verify (switchps/security/auth.py:90)"]
    assert p.classify(token, p.PS_RULES) == "token verification"
    check = [*PS_LOOP, "ParameterServer._receive_push (switchps/ps_server/rpc/service.py:320)",
             "fill (switchps/protos/codec.py:305)", "all_finite (switchps/protos/codec.py:170)"]
    assert p.classify(check, p.PS_RULES) == "checks"
    assert p.classify(check[:-1], p.PS_RULES) == "server receive/decode"
    assert p.classify(PS_LOOP, p.PS_RULES) == "gRPC aio and asyncio runtime"
    assert p.classify([*PS_LOOP[:2], "EpollSelector.select (selectors.py:468)"], p.PS_RULES) == p.WAKE
    assert p.classify(["f (elsewhere.py:1)"], p.PS_RULES) == p.OTHER


def test_profile_reads_py_spy_raw(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    p = importlib.import_module("profile_step")
    raw = tmp_path / "raw.txt"
    raw.write_text("thread (101): MainThread;a (x.py:1);b (y.py:2) 3\n"
                   "thread (0x66): switchps-grpc;c (z.py:3) 1\n")
    got = p.read_raw(raw)
    assert got == {(101, "MainThread"): [(["a (x.py:1)", "b (y.py:2)"], 3)],
                   (102, "switchps-grpc"): [(["c (z.py:3)"], 1)]}
    assert p.shares(got[101, "MainThread"] + [(["GradientComputer.compute (switchps/workload/tensorflow/gradients.py:9)"], 1)],
                    p.WORKER_RULES) == {p.OTHER: 0.75, "compute: TF gradient and its copy out": 0.25}


def test_the_shards_transport_benchmark_runs_every_count_and_prints_strict_json() -> None:
    """A tiny real run: 1 and 2 shards, each a process, one timed round trip of 1 MB each."""
    import json

    out = subprocess.run([sys.executable, str(BENCH / "transport.py"), "--shards", "1", "2", "--sizes-mb", "1",
                          "--reps", "1", "--blocks", "1"], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    (result,) = json.loads(out.stdout, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))["results"]
    assert set(result["cases"]) == {"1 bytes", "2 bytes"} and result["baseline"] == "1 bytes"
    one, two = result["cases"]["1 bytes"], result["cases"]["2 bytes"]
    assert set(two["cpu_s_per_round_trip"]) == {"client", "shard0", "shard1"}
    nbytes = 2**20  # 1 MB, a whole number of 4 KiB pages
    for count in (one, two):  # the figures are each other's: GB/s both ways from the median, in its rounding
        assert count["gb_s"] == pytest.approx(2 * nbytes / (count["median_ms"] / 1e3) / 1e9, rel=0.01)
    assert one["time_vs_baseline"] == 1.0
    assert two["time_vs_baseline"] == pytest.approx(two["median_ms"] / one["median_ms"], rel=0.01)


def test_alternate_runs_its_two_arms_abba_and_divides_the_first_by_the_second(bench: ModuleType, monkeypatch) -> None:
    calls: list[dict] = []

    def run_once(args, **kw):
        calls.append(kw)
        return {"steps_per_s": 200.0 if kw.get("shared_memory", True) else 100.0}

    monkeypatch.setattr(bench, "run_once", run_once)
    args = argparse.Namespace(dim=784, workers=2, seconds=1.0)
    out = bench.alternate(args, 3, {"shared_memory": {}, "grpc_bytes": {"shared_memory": False}})
    assert calls == [{}, {"shared_memory": False}, {"shared_memory": False}, {}, {}, {"shared_memory": False}]
    assert out["pair_ratios"] == [2.0, 2.0, 2.0] and out["ratio_of_medians"] == 2.0
    assert out["ratio"]["target"] == {"ratio": 1.0, "verdict": "above"}  # the same every pair: significant


def test_framework_ab_alternates_torch_and_tf_workers_abba_at_each_model_size(bench: ModuleType,
                                                                             monkeypatch) -> None:
    calls: list[tuple[int, str]] = []

    def run_once(args, framework):
        calls.append((args.dim, framework))
        return {"steps_per_s": 150.0 if framework == "torch" else 100.0, "framework": framework}

    monkeypatch.setattr(bench, "run_once", run_once)
    args = argparse.Namespace(dims=[784, 78400], framework_ab=2, workers=2, seconds=1.0, batch=32, dim=784)
    out = bench.framework_ab(args)
    assert calls == [(784, "torch"), (784, "tensorflow"), (784, "tensorflow"), (784, "torch"),
                     (78400, "torch"), (78400, "tensorflow"), (78400, "tensorflow"), (78400, "torch")]
    assert [m["model"] for m in out["models"]] == [bench.model_name(784), bench.model_name(78400)]
    assert all(m["pair_ratios"] == [1.5, 1.5] for m in out["models"]), "torch over TF, pair by pair"
    assert [r["framework"] for r in out["models"][0]["runs"]] == ["torch", "tensorflow", "tensorflow", "torch"]


def test_the_workers_framework_is_the_run_s(bench: ModuleType) -> None:
    args = argparse.Namespace(network=False, workers=2, dim=784, batch=32, seconds=1.0, no_checkpoint=False,
                              checkpoint_every_s=30.0, framework="torch", wire_dtype="float32")
    assert bench.run_config(args).model.framework == "torch"
    assert bench.run_config(args, framework="tensorflow").model.framework == "tensorflow"
    assert bench.run_config(argparse.Namespace(**{**vars(args), "wire_dtype": "bfloat16"})).runtime.wire_dtype == "bfloat16"


def test_gpu_bench_runs_on_the_cpu_without_tensorflow_and_prints_every_case() -> None:
    """bench/gpu.py, tiny (3 steps of 8 images): a local loop, the computer alone, and a real run with
    one torch worker (more workers are the same launch, only slower here); the process that ran it all never imported TensorFlow (a GPU machine has none)."""
    code = ("import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__'); "
            "assert 'tensorflow' not in sys.modules, 'TensorFlow imported'")
    out = subprocess.run([sys.executable, "-c", code, str(BENCH / "gpu.py"), "--device", "cpu", "--steps", "3",
                          "--batch", "8", "--workers", "1"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    d = json.loads(out.stdout)
    assert (d["device"], d["batch"], d["steps"], d["parameters"]) == ("cpu", 8, 3, 11_173_962)
    assert d["local"]["steps_per_s"] > 0 and d["computer"]["steps_per_s"] > 0
    assert [r["workers"] for r in d["switchps"]] == [1]
    for r in d["switchps"]:
        assert r["updates"] == 3 * r["workers"] and r["pushes_rejected"] == 0
        assert r["compute_ms"] > 0 and r["round_trip_ms"] > 0
        assert r["per_worker_over_local"] == pytest.approx(r["steps_per_s_per_worker"] / d["local"]["steps_per_s"],
                                                           rel=0.01)


def _vs_tf_args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"vs_tf": 2, "dim": 784, "workers": 2, "batch": 32, "seconds": 1.0,
                                 "tf_warmup_s": 0.0, "no_checkpoint": False, "checkpoint_every_s": 30.0,
                                 "target": 3.5, "tf_mode": "both", "network": False, **kw})


def test_vs_tf_interleaves_switchps_and_both_tf_modes_and_takes_the_faster_as_the_peer(bench: ModuleType,
                                                                                      monkeypatch) -> None:
    order: list[str] = []
    tf_speed = {"user": 150.0, "tuned": 100.0}

    def run_once(args):
        order.append("switchps")
        return {"steps_per_s": 300.0}

    def run_peer(workers, seconds, warmup_s, dim, batch, lr, mode):
        order.append(f"tf_{mode}")
        return {"steps_per_s": tf_speed[mode], "mode": mode}

    monkeypatch.setattr(bench, "run_once", run_once)
    monkeypatch.setattr(bench, "run_peer", run_peer)
    out = bench.vs_tf(_vs_tf_args())
    assert order == ["switchps", "tf_user", "tf_tuned", "tf_tuned", "tf_user", "switchps"]
    assert out["peer"] == "tf_user" and out["ratio_switchps_over_tf"] == [2.0, 2.0]
    assert out["ratio"]["target"] == {"ratio": 3.5, "verdict": "below"}
    assert out["tf_modes"]["tuned"]["ratio_switchps_over_tf"] == [3.0, 3.0]
    assert out["tf_user_over_tuned"]["pair_ratios"] == [1.5, 1.5]
    assert [r["who"] for r in out["runs"]] == order
    tf_speed["tuned"] = 200.0  # the tuned peer now the faster: it is the one switchps is measured against
    assert bench.vs_tf(_vs_tf_args())["peer"] == "tf_tuned"


def test_vs_tf_with_one_tf_mode_runs_only_that_one(bench: ModuleType, monkeypatch) -> None:
    modes: list[str] = []

    def run_peer(*args, mode, **kw):
        modes.append(mode)
        return {"steps_per_s": 100.0}

    monkeypatch.setattr(bench, "run_once", lambda args: {"steps_per_s": 300.0})
    monkeypatch.setattr(bench, "run_peer", run_peer)
    out = bench.vs_tf(_vs_tf_args(tf_mode="tuned", network=True))
    assert modes == ["tuned", "tuned"] and out["peer"] == "tf_tuned" and "tf_user_over_tuned" not in out
    assert out["switchps"]["path"] == "network" and out["switchps"]["shared_memory"] is False


def test_network_path_runs_switchps_on_grpc_bytes_with_no_cpu_binding(bench: ModuleType) -> None:
    """``--network``: no shared memory (so no Unix socket) and the launcher binds no worker, as on other
    hosts; without it, switchps as shipped: both."""
    from switchps.config.cpu_binding import CpuBinding, local_bindings

    args = argparse.Namespace(network=False, workers=2, dim=784, batch=32, seconds=1.0, no_checkpoint=False,
                              checkpoint_every_s=30.0, framework="tensorflow", wire_dtype="float32")
    shipped = bench.run_config(args)
    assert shipped.runtime.shared_memory
    assert local_bindings(2, 1, shipped.runtime.cpu, [0, 1])["worker-1"] == CpuBinding((1,), 5)
    network = bench.run_config(argparse.Namespace(**{**vars(args), "network": True}))
    assert not network.runtime.shared_memory
    assert set(local_bindings(2, 1, network.runtime.cpu, [0, 1]).values()) == {CpuBinding()}
    assert not bench.run_config(args, shared_memory=False).runtime.shared_memory  # --shm-ab's second arm


@pytest.fixture
def tf_ps(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("tf_ps")


def test_tf_user_mode_keeps_tf_default_threads_and_tuned_mode_limits_them(tf_ps: ModuleType,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    assert all(tf_ps.threads("user", job) is None for job in ("ps", "worker", "coordinator"))
    assert [tf_ps.threads("tuned", job) for job in ("ps", "worker", "coordinator")] == [(1, 1), (1, 2), (1, 1)]
    with pytest.raises(ValueError):
        tf_ps.threads("fast", "ps")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert "OMP_NUM_THREADS" not in tf_ps.child_env("user") and tf_ps.child_env("tuned")["OMP_NUM_THREADS"] == "1"


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeCoordinator:
    """``schedule`` returns a RemoteValue whose ``fetch`` is recorded; each schedule takes ``step_s``."""

    def __init__(self, clock: FakeClock, step_s: float = 1.0) -> None:
        self.calls: list[str] = []
        self.clock, self.step_s = clock, step_s

    def schedule(self, fn, args):
        self.calls.append("schedule")
        self.clock.now += self.step_s
        return SimpleNamespace(fetch=lambda: self.calls.append("fetch"))

    def join(self) -> None:
        self.calls.append("join")


def test_tf_user_mode_schedules_every_step_then_joins_once_fetching_none(tf_ps: ModuleType) -> None:
    coordinator = FakeCoordinator(FakeClock())
    tf_ps.scheduled_then_joined(coordinator, "step", "iterator", 5)
    assert coordinator.calls == ["schedule"] * 5 + ["join"]


def test_tf_tuned_mode_fetches_every_step_beyond_its_in_flight_limit(tf_ps: ModuleType) -> None:
    clock = FakeClock()
    coordinator = FakeCoordinator(clock)
    steps, _ = tf_ps._schedule_for(coordinator, "step", "iterator", 6.0, limit=2, clock=clock)
    assert steps == 6
    assert coordinator.calls == ["schedule"] * 2 + ["fetch", "schedule"] * 4


def test_tf_user_mode_warm_up_doubles_its_batches_within_the_warm_up_and_returns_the_last_rate(
        tf_ps: ModuleType) -> None:
    clock, sizes = FakeClock(), []

    def batch(n: int) -> None:  # 8 steps/s
        sizes.append(n)
        clock.now += n / 8

    assert tf_ps.MIN_BATCH_S == 0.5
    assert tf_ps.warmed_up_rate(batch, 4.0, first=2, clock=clock) == 8.0
    # 2, 4, 8 steps (1.75 s), then 16 (the 18 that 2.25 s hold at 8/s, capped at twice 8), then the 4 that
    # the shortest batch holds (more than the 0.25 s left): the warm-up ends at 4.25 s
    assert sizes == [2, 4, 8, 16, 4] and clock.now == 4.25


def test_tf_user_mode_warm_up_never_sizes_the_window_from_its_first_batch(tf_ps: ModuleType) -> None:
    """The first batch traces and connects: however long it takes, a later batch of at least ``MIN_BATCH_S``
    gives the rate."""
    clock, sizes = FakeClock(), []

    def batch(n: int) -> None:  # 8 steps/s after a first batch of 10 s
        sizes.append(n)
        clock.now += 10.0 if len(sizes) == 1 else n / 8

    assert tf_ps.warmed_up_rate(batch, 4.0, first=2, clock=clock) == 8.0
    assert sizes == [2, 2, 4]  # 0.25 s is too short a batch to time; 4 steps take 0.5 s


@pytest.mark.integration
def test_tf_ps_runs_as_users_run_it() -> None:
    """A tiny real run of the user mode: TF's default threads read back in the coordinator, no step fetched,
    every port freed."""
    import json

    out = subprocess.run([sys.executable, str(BENCH / "tf_ps.py"), "--mode", "user", "--workers", "1",
                          "--seconds", "1", "--warmup-s", "1", "--dim", "8"], capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["mode"] == "user" and result["steps"] >= 1 and result["ports_freed"]
    assert result["coordinator_threads_read_back"] == {"intra_op": 0, "inter_op": 0}  # 0: TF's default
    assert result["per_step_fetch"] is False and result["in_flight_limit"] is None


@pytest.fixture
def transport(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("transport")


def test_raw_baseline_sends_one_unary_message_where_switchps_does_and_streams_above(transport: ModuleType) -> None:
    """The raw client's call, per size, as the echo server sees it: unary up to switchps's limit for one
    message, a stream of chunks above it."""
    from concurrent import futures

    import grpc

    from switchps.address import free_port
    from switchps.protos.codec import grpc_options, whole_limit

    chunk = 1 << 20
    limit = whole_limit(chunk)
    assert transport.raw_call(limit, chunk) == "unary" and transport.raw_call(limit + 4, chunk) == "stream"
    seen: list[tuple[str, int]] = []

    def echo(frames, ctx):
        sizes = [len(f) for f in frames]
        seen.append(("stream", sum(sizes)))
        yield from (bytes(n) for n in sizes)

    def whole(request: bytes, ctx) -> bytes:
        seen.append(("unary", len(request)))
        return request

    port = free_port()
    server = grpc.server(futures.ThreadPoolExecutor(2), options=grpc_options())
    server.add_generic_rpc_handlers([transport._echo_handler(echo, whole)])
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        for nbytes in (limit, limit + 4):
            assert len(transport.raw_client(port, nbytes, chunk, reps=1, tuned=False)) == 1
    finally:
        server.stop(None)
    assert seen == [("unary", limit)] * 4 + [("stream", limit + 4)] * 4  # 3 warm-up round trips and 1 timed


def test_record_keeps_a_benchmark_s_json_with_its_command_and_commit(tmp_path: Path) -> None:
    bench = Path(__file__).resolve().parent.parent / "bench"
    cmd = [sys.executable, str(bench / "record.py"), "probe", "--dir", str(tmp_path), "--",
           sys.executable, "-c", "print('{\"steps_per_s\": 12.5}')"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    doc = json.loads((tmp_path / "probe.json").read_text())
    assert doc["result"] == {"steps_per_s": 12.5} and shlex.split(doc["command"]) == cmd[6:]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=bench).stdout
    assert doc["commit"] == head.strip() and doc["cpus"] == os.cpu_count()
    failed = subprocess.run([*cmd[:3], "--dir", str(tmp_path), "--", sys.executable, "-c", "raise SystemExit(3)"],
                            capture_output=True, text=True, timeout=60)
    assert failed.returncode != 0 and "exited 3" in failed.stderr


def test_core_push_simulates_each_protocol_and_prints_its_microseconds_per_push() -> None:
    out = subprocess.run([sys.executable, str(BENCH / "core_push.py"), "--workers", "4", "--updates", "50",
                          "--repeat", "2", "--protocols", "bsp", "asp"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert (d["workers"], d["updates"]) == (4, 50) and set(d["us_per_push"]) == {"bsp", "asp"}
    assert all(len(v) == 2 and all(x > 0 for x in v) for v in d["runs"].values())
    assert all(min(v) <= d["us_per_push"][p] <= max(v) for p, v in d["runs"].items())  # the median
