"""The README's own-PyTorch-loop example, run as written against a real `switchps ps` on loopback.

Two worker processes run the README's ``train.py`` block (with a footer that reports the final loss on
the whole of digits and the steps each pushed) against the README's ``run.yaml`` block, under BSP and
under AMB; the run must train and its record must count every push once.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml

from conftest import FakeClock, wait_until
from switchps.protos import switchps_pb2 as pb
from switchps.worker.client import Reply
from switchps.worker.session import Batches
from switchps.worker.steps import Budget
from switchps.worker.torch_loop import Worker
from switchps.workload.torch.weights import FlatParams
from test_launch import SWITCHPS, rows

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
FOOTER = '''
import json
from switchps.protos.codec import COPIES
with torch.no_grad():
    everything = F.cross_entropy(model(data.tensors[0]), data.tensors[1]).item()
print(json.dumps({"loss": everything, "steps": ps.steps, "shared": ps.session.payload_area is not None,
                  "copied": COPIES.bytes_copied}))
'''
MODEL_BYTES = 4 * (64 * 64 + 64 + 64 * 10 + 10)  # the README's model
UNTRAINED_LOSS = 2.3  # ln 10: a model that has learnt nothing about 10 classes
STEPS = 100


def readme_blocks() -> tuple[str, str]:
    """The python and yaml blocks of the README's section "Your own PyTorch loop"."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Your own PyTorch loop") :]
    section = section[: section.index("\n## ", 1)]
    python = re.search(r"```python\n(.*?)```", section, re.S)
    config = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert python and config, "the section has a python and a yaml block"
    return python.group(1), config.group(1)


def test_the_example_adds_five_lines() -> None:
    code, _ = readme_blocks()
    assert sum(line.rstrip().endswith("# +") or "# + " in line for line in code.splitlines()) == 5


def run_example(tmp_path: Path, processes, protocol: dict) -> tuple[dict, int, list[dict], list[dict]]:
    """The README's run with ``protocol``: (summary, ps.csv's rows, workers.csv's rows, each worker's footer)."""
    code, config = readme_blocks()
    (tmp_path / "train.py").write_text(code + FOOTER)
    raw = yaml.safe_load(config)
    raw["protocol"] = protocol
    raw["cluster"]["ps"] = "127.0.0.1:0"  # the PS picks a free port and publishes it
    raw["train"] = {"steps": STEPS}
    (tmp_path / "ps.yaml").write_text(yaml.safe_dump(raw))
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SWITCHPS_SECRET": secrets.token_hex()}
    ps = processes([SWITCHPS, "ps", "ps.yaml", "--run-dir", str(run_dir)], cwd=tmp_path, env=env,
                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until(lambda: (run_dir / "ps.address").exists() or ps.poll() is not None, 60, "the PS's address")
    assert ps.poll() is None, ps.communicate()[1]
    raw["cluster"]["ps"] = (run_dir / "ps.address").read_text().strip()
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(raw))
    workers = [processes([sys.executable, "train.py", str(i)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [w.communicate(timeout=120) for w in workers]
    for w, (_, err) in zip(workers, outs):
        assert w.returncode == 0, err
    _, err = ps.communicate(timeout=60)
    assert ps.returncode == 0, err
    summary = json.loads((run_dir / "summary.json").read_text())
    reports = [json.loads(out.splitlines()[-1]) for out, _ in outs]
    return summary, len(rows(run_dir / "ps.csv")), rows(run_dir / "workers.csv"), reports


def check_trained(summary: dict, updates: int, steps: list[dict], reports: list[dict]) -> None:
    assert summary["updates"] == updates == STEPS, "the PS's count, and one ps.csv row per update"
    assert summary["pushes_rejected"] == 0 and summary["workers_not_told_stop"] == []
    assert len(steps) == sum(r["steps"] for r in reports) == summary["pushes_accepted"], "every push counted once"
    assert reports[0]["loss"] == reports[1]["loss"] < UNTRAINED_LOSS / 2, "both hold the same, trained values"
    joining = 3 * MODEL_BYTES  # the initial values sent and the first pull received: copies, once
    assert all(r["shared"] and r["copied"] <= joining for r in reports), "no step copies Σg: it is written in place"


def test_the_readme_loop_trains_under_bsp(tmp_path: Path, processes) -> None:
    summary, updates, steps, reports = run_example(tmp_path, processes, {"name": "bsp", "batch": 64})
    check_trained(summary, updates, steps, reports)
    assert {int(s["samples"]) for s in steps} == {64}, "each step takes the sample budget, whatever the loader's"
    assert [r["steps"] for r in reports] == [STEPS, STEPS], "under BSP each worker pushes once per update"


def test_the_readme_loop_ends_its_steps_by_time_under_amb(tmp_path: Path, processes) -> None:
    amb = {"name": "amb", "batch": 64, "micro_batch": 8, "time_budget_s": 0.02, "max_batch": 100_000}
    summary, updates, steps, reports = run_example(tmp_path, processes, amb)
    check_trained(summary, updates, steps, reports)
    samples = [int(s["samples"]) for s in steps]
    assert max(samples) < 100_000 and summary["batch_exhausted_steps"] == 0, "T ended every step, not max_batch"
    assert len(set(samples)) > 1, f"b varies with the time the micro-batches took: {samples}"


def _order(budget: int, micro: int, time_budget_s: float = 0.0) -> pb.WorkOrder:
    return pb.WorkOrder(sample_budget=budget, micro_batch=micro, time_budget_s=time_budget_s)


def test_batches_cut_the_loaders_batches_to_the_budget_and_carry_the_rest_into_the_next_step() -> None:
    loader = [np.arange(i, min(i + 50, 120)) for i in range(0, 120, 50)]  # batches of 50, 50, 20
    batches, clock, seen = Batches(loader), FakeClock(), list[int]()
    for _ in range(6):
        budget = Budget.of(_order(32, 32), clock.now())
        step = list(batches.step(budget, clock))
        assert budget.done == sum(map(len, step)) == 32 and all(len(b) <= 32 for b in step)
        seen.extend(np.concatenate(step))
    assert sorted(seen[:120]) == list(range(120)), "each sample once per pass"
    assert seen[120:] == list(range(72)), "then the next pass, from the loader again"


def test_batches_slice_tuples_and_dicts_alike() -> None:
    x, y = np.arange(10), np.arange(10, 20)
    for batch in ((x, y), {"x": x, "y": y}):
        out = list(Batches([batch]).step(Budget.of(_order(4, 4), 0.0), FakeClock()))
        first = out[0] if isinstance(out[0], tuple) else (out[0]["x"], out[0]["y"])
        assert [list(a) for a in first] == [[0, 1, 2, 3], [10, 11, 12, 13]]


def test_batches_end_by_amb_time_after_at_least_one_micro_batch() -> None:
    clock = FakeClock()
    batches = Batches([np.arange(32)] * 4)
    for cost_s, expected in ((0.01, 4), (1.0, 1)):  # T = 35 ms: four 10 ms micro-batches; one of 1 s
        budget = Budget.of(_order(1000, 4, time_budget_s=0.035), clock.now())
        taken = 0
        for _ in batches.step(budget, clock):
            clock.sleep(cost_s)
            taken += 1
        assert (taken, budget.done, batches.compute_s) == (expected, 4 * expected, pytest.approx(cost_s * expected))
        assert not budget.exhausted(clock.now())
    budget = Budget.of(_order(8, 4, time_budget_s=10.0), clock.now())
    assert len(list(batches.step(budget, clock))) == 2 and budget.exhausted(clock.now()), "max_batch before T"


@dataclass
class FakeSession:
    """A session without a PS: keeps what ``Worker.step`` pushes and answers with ``answer``."""

    answer: np.ndarray
    order: pb.WorkOrder = field(default_factory=lambda: _order(6, 2))
    clock: FakeClock = field(default_factory=FakeClock)
    received_at: float = 100.0
    payload_area: np.ndarray | None = None
    step: int = 0
    pushed: list[tuple[np.ndarray, int, dict]] = field(default_factory=list)
    in_place: list[bool] = field(default_factory=list)
    """Whether each push's payload was the payload area itself."""

    def pull(self, params: np.ndarray) -> Reply:
        return Reply(pb.PullReply(order=self.order), fresh=True, values=-self.answer)

    def push(self, grad: np.ndarray, samples: int, params: np.ndarray, **stats: float) -> Reply:
        self.pushed.append((grad.copy(), samples, stats))
        self.in_place.append(grad is self.payload_area)
        self.step += 1
        return Reply(pb.PushReply(order=self.order), fresh=True, values=self.answer)


def test_a_step_pushes_the_gradient_sum_then_the_buffers_and_loads_the_reply() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2), torch.nn.Linear(2, 2))
    model[2].bias.requires_grad_(False)  # frozen: state on the wire, no gradient
    flat = FlatParams(model)
    session = FakeSession(np.arange(flat.size, dtype=np.float32))
    session.payload_area = np.zeros(flat.size, np.float32)
    ps = Worker(session, model, flat)  # type: ignore[arg-type]
    np.testing.assert_array_equal(flat.read(), -session.answer)  # it starts from the PS's values
    x, y = torch.randn(6, 3), torch.tensor([0, 1, 1, 0, 1, 0])
    data = torch.utils.data.TensorDataset(x, y)
    for xb, yb in ps.batches(torch.utils.data.DataLoader(data, batch_size=4)):  # 4 + 2, cut into 2 + 2 + 2
        ps.backward(F.cross_entropy(model(xb), yb, reduction="sum"))
    expected = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    state = [t.detach().clone() for t in flat.tensors[flat.count:]]
    ps.step()
    grad, samples, stats = session.pushed[0]
    assert session.in_place == [True], "gathered straight into the payload area"
    np.testing.assert_allclose(grad, torch.cat([t.reshape(-1) for t in expected + state]).numpy(), rtol=1e-6)
    assert samples == 6 and stats["loss_sum"] > 0
    np.testing.assert_array_equal(flat.read(), session.answer)  # the reply's values are the model's
    assert all(p.grad is None for p in model.parameters()), "gradients cleared for the next step"
