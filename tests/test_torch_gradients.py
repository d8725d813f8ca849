"""The PyTorch gradient computer: Σ gradients equal plain autograd's, micro-batches sum, the payload is
written in place at staged values, BatchNorm state rides in the payload, warm-up changes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_torch_copies import FakeCuda

from switchps.protos.codec import aligned_empty
from switchps.workload.data import load_dataset
from switchps.workload.torch.copies import Copies
from switchps.workload.torch.gradients import TorchComputer
from switchps.workload.torch.models import build_model

torch.set_num_threads(1)

ROWS = np.array([3, 17, 3, 39, 0, 5, 8, 21, 30, 11])  # any order, with a repeat


def _computer(name: str) -> TorchComputer:
    data = load_dataset("digits")
    kwargs = {"hidden": [16]} if name == "mlp" else {}
    shape = (8, 8, 1) if name == "resnet20" else data.input_shape
    x = data.x_train[:40].reshape(-1, *shape)
    model = build_model(name, shape, data.num_classes, seed=1, **kwargs)
    return TorchComputer(model, x, data.y_train[:40], "cpu")


def _reference(gc: TorchComputer, rows: np.ndarray) -> tuple[np.ndarray, dict[str, torch.Tensor]]:
    """Plain autograd of the summed cross-entropy on the module itself (a copy of it, in train mode): the Σ
    gradient as a flat vector, and the state dict the forward left."""
    module = build_model("mlp", (64,), 10, hidden=[16]) if gc.weights.names[0] == "hidden0.weight" else \
        build_model("resnet20", (8, 8, 1), 10)
    module.load_state_dict(gc.module.state_dict())
    module.train()
    x, y = gc._x[torch.from_numpy(rows)], gc._y[torch.from_numpy(rows)]
    loss = F.cross_entropy(module(x), y, reduction="sum")
    loss.backward()
    grads = [p.grad.reshape(-1) for p in module.parameters()]  # type: ignore[union-attr]
    return torch.cat(grads).numpy(), module.state_dict()


@pytest.mark.parametrize("name", ["mlp", "resnet20"])
def test_the_sum_gradient_equals_plain_autograd_over_each_micro_batch(name: str) -> None:
    """Micro-batches sum their gradients; with BatchNorm each one's forward normalizes by its own batch, so
    the reference is plain autograd per micro-batch, summed (for the MLP: the whole batch's gradient)."""
    gc = _computer(name)
    n = gc.weights.trainable_size
    for micro in (len(ROWS), 4, 1):  # one call, an uneven tail, per sample
        chunks = [ROWS[i : i + micro] for i in range(0, len(ROWS), micro)]
        expected = sum(_reference(gc, c)[0] for c in chunks)
        grad, loss = gc.compute(ROWS, micro)
        assert grad.shape == (gc.size,) and grad.dtype == np.float32 and loss > 0
        np.testing.assert_allclose(grad[:n], expected, rtol=1e-4, atol=1e-4)
    if name == "mlp":
        np.testing.assert_allclose(grad[:n], _reference(gc, ROWS)[0], rtol=1e-4, atol=1e-4)


def test_the_payload_carries_the_running_statistics_a_plain_forward_leaves() -> None:
    gc = _computer("resnet20")
    _, state = _reference(gc, ROWS)
    grad, _ = gc.compute(ROWS, len(ROWS))
    names = gc.weights.names[gc.weights.count :]
    assert names and all(k.endswith(("running_mean", "running_var")) for k in names)
    left = torch.cat([state[k].reshape(-1) for k in names]).numpy()
    np.testing.assert_allclose(grad[gc.weights.trainable_size :], left, rtol=1e-5, atol=1e-6)
    before = gc.weights.read()[gc.weights.trainable_size :]
    assert not np.allclose(left, before)  # the forward moved them


def test_the_step_writes_its_payload_in_place_at_staged_values_leaving_the_module_alone() -> None:
    gc = _computer("resnet20")
    before = {k: v.clone() for k, v in gc.module.state_dict().items() if v.is_floating_point()}
    staged = gc.buffer()
    staged[:] = gc.weights.read() * np.float32(1.5)  # other values than the module's
    gc.stage(staged)
    gc.payload_to = aligned_empty(gc.size)
    grad, _ = gc.compute(ROWS, len(ROWS))
    assert np.shares_memory(grad, gc.payload_to)
    for k, v in gc.module.state_dict().items():
        if k in before:
            assert torch.equal(v, before[k]), k
    gc.payload_to = None
    gc.assign(staged)  # the module now holds the staged values: plain autograd there gives the same gradient
    expected, _ = _reference(gc, ROWS)
    np.testing.assert_allclose(grad[: gc.weights.trainable_size], expected, rtol=1e-4, atol=1e-4)


def test_a_buffer_staged_again_is_read_at_its_new_contents_and_the_same_segment_written_afresh() -> None:
    """As a worker runs: the reply buffer is rewritten and staged each step, the payload goes to the same
    segment each step (the computer keeps their views)."""
    gc = _computer("mlp")
    reply, gc.payload_to = gc.buffer(), aligned_empty(gc.size)
    initial = gc.weights.read()
    for scale in (1.0, 0.5, 2.0):
        reply[:] = initial * np.float32(scale)
        gc.stage(reply)
        grad, _ = gc.compute(ROWS, 4)
        assert np.shares_memory(grad, gc.payload_to)
        gc.weights.assign(reply)  # the module at the same values: plain autograd there is the reference
        np.testing.assert_allclose(grad, _reference(gc, ROWS)[0], rtol=1e-4, atol=1e-4)


def test_the_gpu_paths_bookkeeping_gives_the_same_payloads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU's computer stages into a vector of its own and accumulates into another, copied out at the end:
    run here with those two vectors on the CPU (no GPU in the tests) and its copies' streams and page
    locking on a fake ``torch.cuda``, against the in-place CPU path: the same payload, bit for bit."""
    cpu, gpu = _computer("resnet20"), _computer("resnet20")
    gpu._device_values, gpu._device_acc = torch.empty(gpu.size), torch.empty(gpu.size)
    cuda = FakeCuda()
    gpu._copies = Copies(torch.device("cpu"), cuda)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: t)  # a CPU build of torch has no pinned memory
    reply = cpu.buffer()
    for scale in (1.0, 0.5):
        reply[:] = cpu.weights.read() * np.float32(scale)
        outs = []
        for gc in (cpu, gpu):
            gc.payload_to = aligned_empty(gc.size)
            gc.stage(reply)
            grad, loss = gc.compute(ROWS, 4)
            assert np.shares_memory(grad, gc.payload_to)
            outs.append((grad.copy(), loss))
        np.testing.assert_array_equal(outs[0][0], outs[1][0])
        assert outs[0][1] == outs[1][1]
    assert cpu._leaves[0].data_ptr() == reply.ctypes.data  # the CPU reads the reply in place
    assert gpu._leaves[0].data_ptr() == gpu._device_values.data_ptr()  # a GPU reads its copy
    np.testing.assert_array_equal(gpu.read()[: gpu.weights.trainable_size], reply[: gpu.weights.trainable_size])
    assert cuda.log.count(("on", "copy")) == 4  # each step's upload and download, on the copy stream


def test_without_a_place_each_step_returns_a_new_vector() -> None:
    gc = _computer("mlp")
    first, _ = gc.compute(ROWS, 4)
    second, _ = gc.compute(ROWS, 4)
    assert not np.shares_memory(first, second)
    np.testing.assert_allclose(first, second, rtol=1e-6)


def test_warm_up_leaves_values_and_state_as_they_were() -> None:
    gc = _computer("resnet20")
    staged = gc.buffer()
    staged[:] = gc.weights.read()
    staged[gc.weights.trainable_size :] = 0.5  # state the forwards would move
    gc.stage(staged)
    before = gc.read()
    gc.warm_up(16, 4)
    np.testing.assert_array_equal(gc.read(), before)


def test_losses_are_the_per_sample_terms_of_the_summed_loss() -> None:
    gc = _computer("mlp")
    _, loss = gc.compute(ROWS, 3)
    losses = gc.losses(ROWS)
    assert losses.shape == (len(ROWS),)
    assert losses.sum() == pytest.approx(loss, rel=1e-5)


def test_read_and_assign_round_trip_values_and_state() -> None:
    gc = _computer("resnet20")
    flat = np.arange(gc.size, dtype=np.float32) / gc.size
    gc.assign(flat)
    np.testing.assert_array_equal(gc.read(), flat)
    np.testing.assert_array_equal(gc.weights.read(), flat)


def test_a_tied_parameter_runs_at_the_given_values_under_both_names_and_the_module_gets_its_own_back() -> None:
    torch.manual_seed(0)
    data = load_dataset("digits")
    tied = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    tied[2].weight = tied[0].weight
    gc = TorchComputer(tied, data.x_train[:40], data.y_train[:40], "cpu")
    assert gc.weights.names == ["0.weight", "0.bias", "2.bias"]  # the tied tensor once on the wire
    staged = gc.buffer()
    staged[:] = gc.weights.read() * np.float32(0.5)
    gc.stage(staged)
    grad, _ = gc.compute(ROWS, len(ROWS))
    assert all(isinstance(p, torch.nn.Parameter) for p in tied.parameters()) and tied[2].weight is tied[0].weight
    gc.assign(staged)
    x, y = gc._x[torch.from_numpy(ROWS)], gc._y[torch.from_numpy(ROWS)]
    F.cross_entropy(tied(x), y, reduction="sum").backward()
    expected = torch.cat([p.grad.reshape(-1) for p in tied.parameters()]).numpy()  # type: ignore[union-attr]
    np.testing.assert_allclose(grad, expected, rtol=1e-4, atol=1e-4)


def test_the_step_benchmark_times_both_frameworks_on_the_same_batches() -> None:
    bench = Path(__file__).resolve().parent.parent / "bench" / "torch_step.py"
    proc = subprocess.run([sys.executable, str(bench), "--steps", "3", "--blocks", "2", "--hidden", "8"],
                          capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["model"] == "mlp[8]" and report["params"] == 64 * 8 + 8 + 8 * 10 + 10
    assert set(report["us_per_step_median"]) == {"tensorflow", "torch"} and report["torch_over_tf"]["n"] == 2
