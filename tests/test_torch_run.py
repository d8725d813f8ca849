"""`model.framework: torch` end to end: the quickstart trains torch workers on digits, its model file loads
in plain torch and scores the same, `switchps export` writes it again; a TF worker and a torch worker in one
run are refused at registration, naming both frameworks."""

from __future__ import annotations

import subprocess
import sys

import grpc
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from switchps.protos.layout import make_layout
from switchps.workload.data import load_dataset

from test_launch import CONFIGS, SWITCHPS, check_run_dir, run

pytest_plugins = ["cluster"]  # cluster_factory: a PS on loopback


def test_a_second_framework_is_refused_at_registration_naming_both(cluster_factory):
    """The fake workers registered as an older client does (no framework): the first one to name its
    framework sets the run's; another framework is refused (FAILED_PRECONDITION, counted, nothing changed),
    never as a layout's digest, and a client that names none is still judged by its layout."""
    c = cluster_factory(workers=2, size=4, protocol={"name": "asp"})
    tf, torch_worker = (w.client for w in c.workers)
    assert c.ps.framework == ""
    tf.register(0, c.layout, 100, framework="tensorflow", device="cpu")
    with pytest.raises(grpc.RpcError) as err:
        torch_worker.register(1, make_layout([("fc.weight", (2, 2))]), 100, framework="torch", device="cuda:0")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.details() == ("worker 1 runs model.framework torch, the PS's workers tensorflow: "
                                   "one framework per run (the same on every worker)")
    assert (c.ps.framework, c.ps.devices, c.ps.layout) == ("tensorflow", {"cpu"}, c.layout)
    assert c.rec.rejections["register:framework"] == 1
    assert [e["reason"] for e in c.events("register_rejected")] == ["framework"]
    with pytest.raises(grpc.RpcError) as err:
        torch_worker.register(1, make_layout([("fc.weight", (2, 2))]), 100)
    assert "its model layout differs" in err.value.details()
    torch_worker.register(1, c.layout, 100, framework="tensorflow", device="cpu")
    assert c.workers[1].push(np.ones(4, np.float32), 2).reply.applied


SCORE = """
import sys
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

torch.set_num_threads(1)
model = nn.Sequential(OrderedDict(flatten=nn.Flatten(), hidden0=nn.Linear(64, 64), relu0=nn.ReLU(),
                                  logits=nn.Linear(64, 10)))
model.load_state_dict(torch.load(sys.argv[1], weights_only=True))
model.eval()
test = np.load(sys.argv[2])
with torch.inference_mode():
    logits = model(torch.from_numpy(test["x"]))
others = sorted(m for m in sys.modules if m.split(".")[0] in ("switchps", "tensorflow", "keras"))
assert not others, others
print(repr(int((logits.argmax(dim=-1) == torch.from_numpy(test["y"]).long()).sum()) / len(test["y"])))
"""
"""The quickstart's model (mlp, hidden [64], on digits' 64 pixels), re-declared in plain PyTorch."""


@pytest.mark.integration
def test_the_torch_quickstart_trains_and_leaves_a_model_plain_torch_scores_the_same(tmp_path):
    proc, run_dir = run(tmp_path, str(CONFIGS / "torch" / "quickstart.yaml"))
    assert proc.returncode == 0 and run_dir is not None, proc.stderr[-3000:]
    summary = check_run_dir(run_dir, "torch", "model.pt")
    assert summary["final_test_accuracy"] >= 0.93 and summary["device"] == "cpu", summary
    assert (run_dir / "model.safetensors").stat().st_size > 0
    data = load_dataset("digits", seed=0)
    np.savez(tmp_path / "test.npz", x=data.x_test, y=data.y_test)
    out = subprocess.run([sys.executable, "-c", SCORE, str(run_dir / "model.pt"), str(tmp_path / "test.npz")],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path, env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout) == summary["final_test_accuracy"], "plain torch scores the file as the run did"

    exported = subprocess.run([SWITCHPS, "export", str(run_dir)], capture_output=True, text=True, timeout=120)
    assert exported.returncode == 0, exported.stderr[-2000:]
    final = torch.load(run_dir / "model.pt", weights_only=True)
    version = summary["final_version"]
    for file in (run_dir / f"model-v{version}.pt", run_dir / f"model-v{version}.safetensors"):
        written = load_file(file) if file.suffix == ".safetensors" else torch.load(file, weights_only=True)
        assert written.keys() == final.keys() and all(torch.equal(written[k], final[k]) for k in final), file
