"""A user's own PyTorch loop (``switchps.worker.torch_loop``), unchanged, under local SGD and DiLoCo (issue 46):
a real ``switchps ps`` on loopback, each worker the README's loop in a thread of this process, real torch
gradients, the PS's record read back. One round of local SGD is exactly H steps of ``torch.optim.SGD``; every
push of each local protocol carries H local steps and the model trains; a live switch from gradients to local
steps and back loses no push; under anytime local SGD the time budget ends the rounds. And a loop that calls
``leave()`` is out of an elastic run at once."""

from __future__ import annotations

import copy
import json
import os
import secrets
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from sklearn.datasets import load_digits

from conftest import wait_until
from switchps.worker.torch_loop import join
from switchps.workload.torch.weights import FlatParams
from test_launch import SWITCHPS, rows

torch.set_num_threads(1)

H, B = 4, 16
X, Y = load_digits(return_X_y=True)
DATA = torch.utils.data.TensorDataset(torch.tensor(X / 16, dtype=torch.float32), torch.tensor(Y))


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


def share(rank: int, workers: int) -> torch.utils.data.Subset:
    """Worker ``rank``'s share of digits."""
    return torch.utils.data.Subset(DATA, range(rank, len(DATA), workers))


def loader(rank: int, workers: int) -> torch.utils.data.DataLoader:
    """Worker ``rank``'s share, in a fixed order."""
    return torch.utils.data.DataLoader(share(rank, workers), batch_size=B)


def train(config: Path, rank: int, workers: int, net: torch.nn.Module, compute_s: float = 0.0,
          leave_after: int | None = None) -> dict[str, Any]:
    """The README's loop, as a user writes it (``compute_s``: a slower device's time per micro-batch; after
    ``leave_after`` steps it leaves the run); the pushes made, and the model's values when the loop ends (the
    stop's reply brings the PS's final values)."""
    data = loader(rank, workers)
    ps = join(config, worker=rank, model=net, samples=len(share(rank, workers)))
    while not ps.stop:
        if ps.steps == leave_after:
            ps.leave()
            break
        for x, y in ps.batches(data):
            ps.backward(F.cross_entropy(net(x), y, reduction="sum"))
            time.sleep(compute_s)  # the user's compute, emulated: not a wait on anything
        ps.step()
    return {"steps": ps.steps, "final": FlatParams(net).read()}


@dataclass
class Run:
    summary: dict[str, Any]
    updates: list[dict[str, str]]
    """ps.csv's rows."""
    pushes: list[dict[str, str]]
    """workers.csv's rows."""
    reports: list[dict[str, Any]]
    run_dir: Path


def run_loop(tmp_path: Path, processes, monkeypatch, protocol: dict[str, Any], steps: int, workers: int = 2,
             nets: list[torch.nn.Module] | None = None, compute_s: float = 0.0,
             leave_after: dict[int, int] | None = None, **more: Any) -> Run:
    """A PS for ``protocol`` (and ``more`` of the config), ``workers`` users' loops against it until it ends
    the run after ``steps`` updates (worker i leaves after ``leave_after[i]`` steps)."""
    monkeypatch.setenv("SWITCHPS_SECRET", secrets.token_hex())
    raw = {"cluster": {"ps": "127.0.0.1:0", "workers": workers}, "model": {"framework": "torch"},
           "protocol": protocol, "optimizer": {"name": "sgd", "learning_rate": 0.2}, "train": {"steps": steps},
           "security": {"secret_env": "SWITCHPS_SECRET"}, "eval": {"final_timeout_s": 0.5}, **more}
    (tmp_path / "ps.yaml").write_text(yaml.safe_dump(raw))
    run_dir = tmp_path / "run"
    ps = processes([SWITCHPS, "ps", "ps.yaml", "--run-dir", str(run_dir)], cwd=tmp_path,
                   env={**os.environ, "OMP_NUM_THREADS": "1"},
                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until(lambda: (run_dir / "ps.address").exists() or ps.poll() is not None, 60, "the PS's address")
    assert ps.poll() is None, ps.communicate()[1]
    raw["cluster"]["ps"] = (run_dir / "ps.address").read_text().strip()
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    nets = nets or [model() for _ in range(workers)]
    pool = ThreadPoolExecutor(workers)
    try:
        futures = [pool.submit(train, config, i, workers, nets[i], compute_s, (leave_after or {}).get(i))
                   for i in range(workers)]
        reports = [f.result(timeout=120) for f in futures]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    _, err = ps.communicate(timeout=60)
    assert ps.returncode == 0, err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["pushes_rejected"] == 0 and summary["workers_not_told_stop"] == []
    return Run(summary, rows(run_dir / "ps.csv"), rows(run_dir / "workers.csv"), reports, run_dir)


def test_a_round_of_local_sgd_from_a_users_loop_is_h_steps_of_torchs_sgd(tmp_path, processes, monkeypatch) -> None:
    lr, net = 0.1, model()
    twin = copy.deepcopy(net)
    local_sgd = {"name": "local_sgd", "batch": B, "local_steps": 3,
                 "inner_optimizer": {"name": "sgd", "learning_rate": lr}}  # outer: averaging (SGD at lr 1)
    run = run_loop(tmp_path, processes, monkeypatch, local_sgd, steps=1, workers=1, nets=[net])
    sgd, batches = torch.optim.SGD(twin.parameters(), lr=lr), iter(loader(0, 1))
    for _ in range(3):  # the same batches, each a mean-loss step
        x, y = next(batches)
        sgd.zero_grad()
        F.cross_entropy(twin(x), y).backward()
        sgd.step()
    assert [(int(u["local_steps"]), int(u["samples"])) for u in run.updates] == [(3, 3 * B)]
    assert run.reports[0]["steps"] == 1
    start, moved = FlatParams(model()).read(), FlatParams(twin).read()
    assert np.abs(moved - start).max() > 1e-3, "the steps moved the model"
    np.testing.assert_allclose(run.reports[0]["final"], moved, atol=1e-5, err_msg="the loop ends at the PS's values")


@pytest.mark.parametrize("name,inner,steps", [  # the outer optimizers are the defaults (averaging, Nesterov)
    ("local_sgd", {"name": "sgd", "learning_rate": 0.5}, 8),
    ("diloco", {"name": "adamw", "learning_rate": 0.01}, 8),
    ("async_local_sgd", {"name": "sgd", "learning_rate": 0.5}, 16),
    ("async_diloco", {"name": "adamw", "learning_rate": 0.003}, 16)])
def test_each_local_protocol_trains_from_users_loops_with_every_push_of_h_local_steps(tmp_path, processes,
                                                                                      monkeypatch, name, inner,
                                                                                      steps) -> None:
    protocol = {"name": name, "batch": B, "local_steps": H, "inner_optimizer": inner}
    run = run_loop(tmp_path, processes, monkeypatch, protocol, steps)
    assert len(run.updates) == run.summary["updates"] == steps
    for u in run.updates:
        pushes = len(u["workers"].split(";"))
        assert pushes == (2 if name in ("local_sgd", "diloco") else 1), u  # a round: both workers' movements
        assert int(u["local_steps"]) == H * pushes and int(u["samples"]) == H * B * pushes, u
    assert {(int(p["local_steps"]), int(p["samples"])) for p in run.pushes} == {(H, H * B)}, "every push: H steps"
    assert len(run.pushes) == sum(r["steps"] for r in run.reports), "every push recorded once"
    # The local steps' mean loss behind each update. Asynchronous DiLoCo's swings late (stale Nesterov steps:
    # 1.17, 1.90, 2.18 in a row), so the halves are compared, and the second half's best with the start.
    losses = [float(u["train_loss"]) for u in run.updates]
    first, second = losses[:steps // 2], losses[steps // 2:]
    assert np.mean(second) < np.mean(first) and min(second) < 0.6 * np.mean(losses[:4]), \
        f"the training loss falls: {losses}"


def test_a_live_switch_takes_users_loops_from_gradients_to_local_sgd_and_back(tmp_path, processes,
                                                                           monkeypatch) -> None:
    phases = [("bsp", 2), ("local_sgd", 3), ("bsp", 2)]
    protocols = [{"name": "bsp", "batch": B, "local_steps": None},
                 {"name": "local_sgd", "batch": B, "local_steps": H,
                  "inner_optimizer": {"name": "sgd", "learning_rate": 0.1}}]
    policy = {"name": "schedule", "every_k": 1, "protocols": protocols,
              "kwargs": {"unit": "steps", "phases": [{p: n} for p, n in phases]}}
    run = run_loop(tmp_path, processes, monkeypatch, {"name": "bsp", "batch": B}, steps=7, policy=policy)
    events = [json.loads(x) for x in (run.run_dir / "events.jsonl").read_text().splitlines()]
    assert [(e["from"], e["to"]) for e in events if e["event"] == "switch"] == [("bsp", "local_sgd"),
                                                                                 ("local_sgd", "bsp")]
    assert [u["protocol"] for u in run.updates] == ["bsp"] * 2 + ["local_sgd"] * 3 + ["bsp"] * 2
    for u in run.updates:  # a switch waits for the round in flight: no push of the other kind joins an update
        assert len(u["workers"].split(";")) == 2, u
        local = u["protocol"] == "local_sgd"
        assert int(u["local_steps"]) == (2 * H if local else 0), u
        assert int(u["samples"]) == 2 * B * (H if local else 1), u
    counts = [int(p["local_steps"]) for p in run.pushes]
    assert set(counts) == {0, H} and counts.count(H) == 2 * 3, "each worker's three rounds, then gradients"


def test_anytime_local_sgd_from_users_loops_ends_rounds_by_the_time_budget(tmp_path, processes, monkeypatch) -> None:
    amb = {"name": "amb", "batch": B, "time_budget_s": 0.025, "local_steps": 8,
           "inner_optimizer": {"name": "sgd", "learning_rate": 0.1}}
    run = run_loop(tmp_path, processes, monkeypatch, amb, steps=4, compute_s=0.01)
    # each local step takes at least 10 ms: T (25 ms from the order's arrival) ends a round after 3 at most
    counts = [int(p["local_steps"]) for p in run.pushes]
    assert counts and all(1 <= k <= 3 for k in counts), counts
    assert all(int(p["samples"]) == int(p["local_steps"]) * B for p in run.pushes)
    assert all(int(u["local_steps"]) * B == int(u["samples"]) for u in run.updates)
    assert len(run.updates) == 4


def test_a_users_loop_that_leaves_an_elastic_run_is_out_at_once(tmp_path, processes, monkeypatch) -> None:
    """``ps.leave()`` after 3 steps: the PS counts worker 1 gone at once (``worker_left``, ``exited``, with
    ``leave_after_s`` at 10 minutes), and worker 0 trains the run to its end alone."""
    elastic = {"ps": "127.0.0.1:0", "workers": {"min": 1, "max": 2, "start": 2}, "leave_after_s": 600}
    run = run_loop(tmp_path, processes, monkeypatch, {"name": "asp", "batch": B}, steps=40, leave_after={1: 3},
                   cluster=elastic, data={"name": "digits", "sampling": "replacement"})
    assert run.reports[1]["steps"] == 3 and run.reports[0]["steps"] == 40 - 3
    events = [json.loads(line) for line in (run.run_dir / "events.jsonl").read_text().splitlines()]
    assert [(e["worker"], e["reason"]) for e in events if e["event"] == "worker_left"] == [(1, "exited")]
    assert [int(u["members"]) for u in run.updates][-1] == 1
