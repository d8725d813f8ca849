"""``bench/gpu_util.py``: its cases' configs, and a tiny real run on the emulated device."""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from switchps.config.run import parse_config

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture
def gpu_util(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("gpu_util")


def _args(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(**{"device": "cpu", "steps": 10, "batch": 128, "step_ms": 11.0, "set": [], **kw})


def test_a_case_on_the_cpu_is_the_sized_model_on_a_device_of_11_ms_a_step(gpu_util: ModuleType,
                                                                           tmp_path: Path) -> None:
    cfg = parse_config(gpu_util.case_config(_args(), 2, 1, tmp_path / "d.npz", tmp_path))
    assert cfg.model.name == "gpu_util:resnet18_sized" and cfg.cluster.num_workers == 2
    assert cfg.device.samples_per_s is not None and 128 / cfg.device.samples_per_s == pytest.approx(0.011)
    assert len(cfg.cluster.shards) == 1 and cfg.train.steps == 20 and cfg.protocol.name == "asp"
    sharded = parse_config(gpu_util.case_config(_args(device="cuda"), 1, 4, tmp_path / "d.npz", tmp_path))
    assert len(sharded.cluster.shards) == 4
    assert sharded.model.name == "resnet18" and sharded.device.samples_per_s is None  # the real model on a GPU


def test_set_writes_any_dotted_field_and_nothing_else(gpu_util: ModuleType, tmp_path: Path) -> None:
    plain = gpu_util.case_config(_args(), 1, 1, tmp_path / "d.npz", tmp_path)
    d = gpu_util.case_config(_args(set=["runtime.shared_memory=false", "runtime.future_knob=3",
                                        "checkpoint.every_s=60"]), 1, 1, tmp_path / "d.npz", tmp_path)
    assert d["runtime"] == {**plain["runtime"], "shared_memory": False, "future_knob": 3}
    assert d["checkpoint"] == {"every_s": 60} and {k: v for k, v in d.items() if k not in ("runtime", "checkpoint")} \
        == {k: v for k, v in plain.items() if k not in ("runtime", "checkpoint")}
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        gpu_util.overrides(["runtime.shared_memory"])


def test_the_sized_model_has_resnet18_s_parameters_and_a_dense_gradient(gpu_util: ModuleType) -> None:
    torch.manual_seed(0)
    model = gpu_util.resnet18_sized((32, 32, 3), 10)
    assert sum(p.numel() for p in model.parameters()) == gpu_util.RESNET18_PARAMETERS
    x, y = torch.randn(4, 32, 32, 3), torch.tensor([0, 1, 2, 3])
    loss = torch.nn.functional.cross_entropy(model(x), y, reduction="sum")
    grads = torch.autograd.grad(loss, list(model.parameters()))
    assert [g.shape for g in grads] == [p.shape for p in model.parameters()]  # none missing: every one is pushed
    assert loss.item() == pytest.approx(torch.nn.functional.cross_entropy(model.linear(x.flatten(1)), y,
                                                                          reduction="sum").item())


def test_gpu_util_runs_tiny_on_the_emulated_device_and_prints_each_case_s_milliseconds() -> None:
    """3 steps of 8 samples through a real run; ``--set`` reaches the config (5 steps, not 3)."""
    out = subprocess.run([sys.executable, str(BENCH / "gpu_util.py"), "--steps", "3", "--batch", "8",
                          "--set", "train.steps=5"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    d = json.loads(out.stdout)
    assert (d["device"], d["parameters"], d["device_ms"], d["overrides"]) == ("emulated", 11_173_962, 11.0,
                                                                              {"train.steps": 5})
    [c] = d["cases"]
    assert (c["workers"], c["shards"], c["updates"], c["pushes_rejected"]) == (1, 1, 5, 0)
    assert 0 < d["utilization"] == c["utilization"] <= 1
    assert c["compute_ms"] >= 11.0 - 0.01 and c["round_trip_ms"] > 0 and c["ps_cpu_ms"] > 0
    assert c["followers_apply_ms"] == [] and "apply_ms" in c  # one PS: no follower; shard 0 says none today
    assert c["copy_ms"] == pytest.approx(c["compute_ms"] - 11.0, abs=0.01)
    assert c["wait_ms"] == pytest.approx(c["period_ms"] - c["compute_ms"], abs=0.01)
