"""What a run leaves: its final model, loadable anywhere, scoring exactly what the run reported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from switchps.workload.data import load_dataset

from test_launch import SWITCHPS, check_run_dir, rows

pytestmark = pytest.mark.integration

SCORE = """
import sys, numpy as np, keras
model = keras.models.load_model(sys.argv[1])
data = np.load(sys.argv[2])
logits = model.predict(data["x"], batch_size=1024, verbose=0)
assert "switchps" not in sys.modules
bn = [l for l in model.layers if isinstance(l, keras.layers.BatchNormalization)]
stats = [float(np.abs(l.moving_mean.numpy()).sum() + np.abs(l.moving_variance.numpy() - 1).sum()) for l in bn]
print(repr(float(np.mean(np.argmax(logits, axis=-1) == data["y"]))), sum(stats), len(bn))
"""


def score_in_plain_python(model: Path, tmp_path: Path, seed: int = 0) -> tuple[float, float, int]:
    """Accuracy of ``model`` on digits' test split, in a process that imports keras and nothing of switchps;
    also how far its BatchNorm statistics are from their initial values, and how many BN layers it has."""
    data = load_dataset("digits", seed=seed)
    test = tmp_path / "test.npz"
    np.savez(test, x=data.x_test, y=data.y_test)
    out = subprocess.run([sys.executable, "-c", SCORE, str(model), str(test)], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert out.returncode == 0, out.stderr[-2000:]
    acc, drift, layers = out.stdout.split()
    return float(acc), float(drift), int(layers)


def test_quickstart_leaves_a_model_that_scores_exactly_the_reported_accuracy(tmp_path):
    proc = subprocess.run([SWITCHPS, "run", "--quiet"], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    summary = check_run_dir(run_dir)
    assert summary["final_test_accuracy"] >= 0.93 and "final_test_accuracy" in proc.stderr
    accuracy, _, _ = score_in_plain_python(run_dir / "model.keras", tmp_path)
    assert accuracy == summary["final_test_accuracy"], "a fresh Keras evaluation of the exported model"


def test_batchnorm_statistics_reach_evaluation_and_the_exported_model(tmp_path):
    proc = subprocess.run([SWITCHPS, "run", "--quiet", "--set", f"output.dir={tmp_path}", "--set", "name=bn",
                           "--set", "model={name: resnet20}", "--set", "cluster.workers=2",
                           "--set", "train={steps: 40}", "--set", "optimizer.learning_rate=0.02"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = tmp_path.glob("bn-*")
    summary = check_run_dir(run_dir)
    accuracy, drift, bn_layers = score_in_plain_python(run_dir / "model.keras", tmp_path)
    assert bn_layers == 21 and drift > 1.0, "moving statistics moved away from mean 0, variance 1"
    assert accuracy == summary["final_test_accuracy"]
    first = [float(r["compute_s"]) for r in rows(run_dir / "workers.csv") if r["step"] == "0"]
    later = sorted(float(r["compute_s"]) for r in rows(run_dir / "workers.csv") if r["step"] != "0")
    assert min(first) < 20 * later[len(later) // 2], "tracing (100x a step and more) happens before the clock"
