"""`switchps run` with a sharded PS: real PS shards, evaluator and TensorFlow workers on loopback."""

from __future__ import annotations

import json
from pathlib import Path

import keras
import numpy as np
import pytest
import yaml

from test_launch import check_run_dir, rows, run

pytestmark = pytest.mark.integration
THREE = ["127.0.0.1:0"] * 3


def config(tmp_path: Path, ps: str | list[str], **sections: object) -> Path:
    """Digits on a small MLP whose kernels are cut into row blocks (``shard_max_mb`` 4 KB)."""
    cfg = {"name": "sharded", "cluster": {"workers": 2, "ps": ps},
           "model": {"name": "mlp", "kwargs": {"hidden": [32]}}, "data": {"name": "digits"},
           "optimizer": {"name": "momentum", "learning_rate": 0.05}, "protocol": {"name": "bsp", "batch": 16},
           "train": {"steps": 50}, "checkpoint": {"every_s": None}, "runtime": {"shard_max_mb": 0.004},
           **sections}
    path = tmp_path / "sharded.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def shard_records(run_dir: Path) -> list[dict]:
    return [json.loads((run_dir / f"shard-{k}.json").read_text()) for k in (1, 2)]


def test_three_shards_train_to_the_same_bits_as_one(tmp_path):
    """BSP, 2 workers, fixed data order: the order of summation is the same, so the models are identical."""
    models = []
    for name, ps in (("one", "127.0.0.1:0"), ("three", THREE)):
        (tmp_path / name).mkdir()
        proc, run_dir = run(tmp_path / name, str(config(tmp_path / name, ps)))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert run_dir is not None
        summary = check_run_dir(run_dir)
        assert summary["final_version"] == summary["updates"] == 50
        models.append(keras.models.load_model(run_dir / "model.keras").get_weights())
    assert all(np.array_equal(a, b) for a, b in zip(*models)), "bit-identical parameters after 50 rounds"
    shards = shard_records(run_dir)
    assert [s["final_version"] for s in shards] == [50, 50] and [s["parts_applied"] for s in shards] == [100, 100]
    assert sum(s["parameters"] for s in shards) < sum(w.size for w in models[1]), "each shard holds a part"


def test_a_switch_bsp_asp_amb_bsp_on_three_shards_loses_and_repeats_nothing(tmp_path):
    phases = [{"bsp": 0.25}, {"asp": 0.25}, {"amb": 0.25}, {"bsp": 0.25}]
    path = config(tmp_path, THREE, protocol={"name": "bsp", "batch": 16, "time_budget_s": 0.05},
                  policy={"name": "schedule", "kwargs": {"phases": phases}}, train={"steps": 80},
                  device={"samples_per_s": 800})
    proc, run_dir = run(tmp_path, str(path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert run_dir is not None
    summary = check_run_dir(run_dir)
    updates = rows(run_dir / "ps.csv")
    protocols = [u["protocol"] for u in updates]
    assert [p for i, p in enumerate(protocols) if i == 0 or p != protocols[i - 1]] == ["bsp", "asp", "amb", "bsp"]
    pushes = [p for u in updates for p in u["pushes"].split(";")]
    assert len(pushes) == len(set(pushes)) == summary["pushes_accepted"], "no push applied twice or lost"
    for s in shard_records(run_dir):  # every shard applied exactly what shard 0 decided
        assert s["final_version"] == s["updates"] == summary["updates"] == 80
        assert s["parts_applied"] == summary["pushes_accepted"] and s["rejections"] == {}
        assert s["parts_freed"] == summary["pushes_dropped"]
