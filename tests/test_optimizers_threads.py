"""The parallel apply (``runtime.ps_threads``): the optimizers and the sums on several threads give the very
bytes one thread gives, ``steps`` still yields a finished prefix, a failing block fails the apply, and
``auto`` picks one thread on a small host."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import wait_until

from switchps.config.run import RuntimeSpec
from switchps.optim import optimizers as O
from switchps.optim.lanes import Lanes, _Round, auto_threads, ps_threads
from switchps.optim.schedules import make_schedule
from switchps.ps_server.sums import Sums

pytest_plugins = ["cluster"]  # cluster_factory: a PS on loopback

BLOCK = O.BLOCK  # the real block: arrays large enough that NumPy releases the GIL
TRAINABLE, SIZE = 5 * BLOCK + 123, 5 * BLOCK + 130  # a partial last block, then 7 elements of state
CASES = [("sgd", {}), ("sgd", {"momentum": 0.5}), ("momentum", {}), ("nesterov", {}), ("rmsprop", {}),
         ("rmsprop", {"momentum": 0.5}), ("adam", {}), ("adagrad", {})]


@pytest.fixture(scope="module")
def lanes():
    made = {n: Lanes(n) for n in (1, 2, 4)}
    yield made
    for each in made.values():
        each.close()


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint32)


def _train(name: str, hyper: dict[str, float], lanes: Lanes, steps: int = 3) -> tuple[np.ndarray, dict]:
    """``steps`` updates from random sums of 3 pushes, as the store applies them (a 1/samples mean, the
    state the contributors' mean, an exponential schedule, a staleness factor)."""
    rng = np.random.default_rng(7)
    values = rng.standard_normal(SIZE).astype(np.float32)
    opt = O.make_optimizer(name, TRAINABLE, make_schedule("exponential", 0.05, decay_steps=2, decay_rate=0.7),
                           **hyper)
    for step in range(steps):
        grad = rng.standard_normal((3, SIZE)).astype(np.float32).sum(axis=0)
        for _ in O.apply_update(opt, values, TRAINABLE, grad, samples=96, contributors=3,
                                lr_factor=1 / (1 + step % 2), lanes=lanes):
            pass
    return values, opt.state_dict()


@pytest.mark.parametrize(("name", "hyper"), CASES, ids=[f"{n}-{h}" if h else n for n, h in CASES])
def test_every_optimizer_gives_the_same_bytes_on_1_2_and_4_threads(monkeypatch, lanes, name, hyper):
    monkeypatch.setattr(O, "BLOCK", BLOCK)
    (one, one_state), *others = [_train(name, hyper, lanes[n]) for n in (1, 2, 4)]
    assert not np.array_equal(one, np.random.default_rng(7).standard_normal(SIZE).astype(np.float32))
    for values, state in others:
        assert np.array_equal(_bits(values), _bits(one))
        assert state.keys() == one_state.keys()
        for key, arr in state.items():
            assert np.array_equal(_bits(arr), _bits(one_state[key])) if isinstance(arr, np.ndarray) \
                else arr == one_state[key], key


def test_steps_yields_increasing_ends_below_which_the_values_are_final(monkeypatch, lanes):
    monkeypatch.setattr(O, "BLOCK", BLOCK)
    rng = np.random.default_rng(3)
    start, grad = rng.standard_normal(TRAINABLE).astype(np.float32), rng.standard_normal(TRAINABLE).astype(np.float32)
    final = start.copy()
    O.make_optimizer("adam", TRAINABLE, 0.01).apply(final, grad.copy())
    params, ends, finished_blocks = start.copy(), [], []
    for end in O.make_optimizer("adam", TRAINABLE, 0.01).steps(
            params, grad.copy(), lanes=lanes[4], done=lambda lo, hi: finished_blocks.append(lo)):
        assert np.array_equal(_bits(params[:end]), _bits(final[:end])), f"params[:{end}] not final"
        ends.append(end)
    assert ends == sorted(set(ends)) and ends[-1] == TRAINABLE
    assert sorted(finished_blocks) == list(range(0, TRAINABLE, BLOCK)), "done once per block"


def test_the_prefix_grows_only_when_the_blocks_before_it_are_done():
    r = _Round(size=10, block=3)  # blocks 0..2 of 3 elements, block 3 of 1
    assert [r.claim() for _ in range(5)] == [0, 1, 2, 3, None]
    assert r.finish(2) == 0 and r.finish(1) == 0
    assert r.finish(0) == 9 and r.finish(3) == 10


def test_a_block_that_fails_on_another_thread_fails_the_run_and_stops_the_claims(lanes):
    started: list[int] = []

    def work(lane: int, block: slice) -> None:
        started.append(lane)
        if lane != 0:
            raise ValueError("boom")
        wait_until(lambda: 1 in started, what="the other lane to take a block")

    with pytest.raises(ValueError, match="boom"):
        list(lanes[2].run(10 * BLOCK, BLOCK, work))
    assert started.count(1) == 1 and started.count(0) <= 1, "no block claimed after the failure"


def test_sums_join_on_threads_gives_the_same_sum(lanes):
    rng = np.random.default_rng(5)
    pushes = rng.standard_normal((3, 3 * O.BLOCK + 11)).astype(np.float32)
    sums = []
    for n in (1, 4):
        s = Sums()
        for p in pushes:
            s.join(0, p.copy(), lanes[n])
        sums.append(s.take(0))
    assert np.array_equal(_bits(sums[0]), _bits(sums[1]))
    assert np.array_equal(_bits(sums[0]), _bits(pushes[0] + pushes[1] + pushes[2]))


@pytest.mark.parametrize(("cores", "processes", "threads"),
                         [(2, 1, 1), (4, 1, 1), (8, 1, 4), (16, 1, 8), (64, 1, 8), (16, 2, 4), (16, 4, 1),
                          (32, 2, 8)])
def test_auto_threads_stay_one_on_a_small_host_and_take_half_the_cores_on_a_large_one(cores, processes, threads):
    assert auto_threads(cores, processes) == threads


def test_ps_threads_counts_the_shards_on_this_shards_host(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(32)))
    shards = ["a:1", "a:2", "b:1", "a:3"]
    assert ps_threads("auto", shards, 0) == 5 and ps_threads("auto", shards, 2) == 8
    assert ps_threads(3, shards, 0) == 3
    assert RuntimeSpec().ps_threads == "auto"
    with pytest.raises(ValueError):
        RuntimeSpec(ps_threads=0)


def test_a_ps_applying_on_two_threads_replies_with_the_bytes_of_one(cluster_factory):
    size, rng = 8 * BLOCK + 5, np.random.default_rng(11)  # 4.2 MB: above the 4 MiB a model runs inline
    grads = rng.standard_normal((2, 2, size + 3)).astype(np.float32)  # 2 BSP rounds of 2 workers
    replies = []
    for threads in (1, 2):
        c = cluster_factory(workers=2, size=size, state=3, ps_threads=threads,
                            optimizer={"name": "adam", "learning_rate": 0.01})
        assert c.store.lanes.threads == threads
        for pushes in grads:  # two pushes sum to the same bits in either order
            got = [p.result() for p in [w.push_async(g, 4) for w, g in zip(c.workers, pushes)]]
        replies.append([_bits(r.values).copy() for r in got])
    assert np.array_equal(replies[0][0], replies[0][1]) and np.array_equal(replies[0][0], replies[1][0])
    assert np.array_equal(replies[1][0], replies[1][1]) and np.count_nonzero(replies[0][0]) == size + 3


def test_the_apply_benchmark_runs_and_pairs_each_thread_count_with_one():
    bench = Path(__file__).resolve().parent.parent / "bench" / "apply.py"
    out = subprocess.run([sys.executable, str(bench), "--params", "300001", "--threads", "1", "2", "--blocks", "2",
                          "--reps", "1", "--work", "sgd", "adam", "join"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert set(result["work"]) == {"sgd", "adam", "join"}
    for work in result["work"].values():
        assert work["1"]["speedup"]["geomean"] == 1.0 and work["1"]["ms"]["n"] == 2
        assert work["2"]["speedup"]["n"] == 2 and work["2"]["ms"]["mean"] > 0
