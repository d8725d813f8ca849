"""The half-precision wire's conversions (``protos/wire_dtype``) against torch's own."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from switchps.protos import wire_dtype as wd

torch.set_num_threads(1)


def _edge_values() -> np.ndarray:
    """Ties (a half-ulp of bfloat16 above even and odd values), denormals, the largest float32 (rounds to
    inf), infinities, signed zeros and NaNs of every shape a float32 NaN can have."""
    bits = np.array([0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0x00000001, 0x00008000, 0x007FFFFF,
                     0x80018000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x00000000, 0x80000000,
                     0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x7FFFFFFF, 0xFF800001, 0x7FBFFFFF], np.uint32)
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 2**32, 3 * wd.BLOCK + 17, dtype=np.uint64).astype(np.uint32)  # spans blocks
    return np.concatenate([bits, noise]).view(np.float32)


def test_bfloat16_rounds_as_torch_does_and_keeps_nan_and_inf() -> None:
    x = _edge_values()
    w = wd.narrowed(x, "bfloat16")
    expected = torch.from_numpy(x.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(x)
    assert np.array_equal(w[~nan], expected[~nan])  # torch's bits, ties to even included
    back = np.empty_like(x)
    wd.widen(w, back)
    assert np.isnan(back[nan]).all() and not np.isnan(back[~nan]).any()  # no NaN lost (or made)
    want = torch.from_numpy(x.copy()).to(torch.bfloat16).float().numpy()
    assert np.array_equal(back[~nan].view(np.uint32), want[~nan].view(np.uint32))
    assert np.isposinf(back[10]) and np.isneginf(back[11]) and np.isposinf(back[8])  # max float32 -> inf


def test_float16_round_trips_as_torch_does() -> None:
    x = _edge_values()
    back = np.empty_like(x)
    wd.widen(wd.narrowed(x, "float16"), back)
    want = torch.from_numpy(x.copy()).to(torch.float16).float().numpy()
    nan = np.isnan(x)
    assert np.array_equal(np.isnan(back), nan)
    assert np.array_equal(back[~nan].view(np.uint32), want[~nan].view(np.uint32))


@pytest.mark.parametrize("wire", wd.NAMES)
def test_a_narrow_value_widens_to_itself(wire: str) -> None:
    """widen ∘ narrow is the identity on values the wire type holds: a reply's values reach a worker exactly."""
    x = np.linspace(-3, 3, 1001, dtype=np.float32)
    once = np.empty_like(x)
    wd.widen(wd.narrowed(x, wire), once)
    twice = np.empty_like(x)
    wd.widen(wd.narrowed(once, wire), twice)
    assert np.array_equal(once, twice)
    assert wd.narrowed(x, wire).nbytes == wd.wire_nbytes(x.size, wire) == x.size * {"float32": 4}.get(wire, 2)


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu_bookkeeping"])
@pytest.mark.parametrize("wire", ["bfloat16", "float16"])
def test_the_torch_computer_narrows_its_payload_into_a_narrow_area(wire: str, gpu: bool,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A payload area of a narrow type gets the float32 payload narrowed once at the end (accumulated in
    float32): on a GPU on the device, before the copy to the host (run here with the device vectors on the
    CPU, as ``test_torch_gradients`` does)."""
    from test_torch_gradients import ROWS, _computer

    wide, narrow = _computer("resnet20"), _computer("resnet20")
    if gpu:  # the copies through a fake torch.cuda (test_torch_copies)
        from test_torch_copies import FakeCuda

        from switchps.workload.torch.copies import Copies

        narrow._device_values, narrow._device_acc = torch.empty(narrow.size), torch.empty(narrow.size)
        narrow._copies = Copies(torch.device("cpu"), FakeCuda())
        monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: t)  # a CPU build of torch has none
    narrow.payload_to = wd.empty(narrow.size, wire)
    for _ in range(2):  # the second step reuses the float32 accumulator (the state advances each step)
        expected, loss = wide.compute(ROWS, 4)
        got, got_loss = narrow.compute(ROWS, 4)
        assert got is narrow.payload_to and got_loss == loss
        assert np.array_equal(got, wd.narrowed(expected, wire))


def test_the_tensorflow_computer_narrows_its_payload_into_a_narrow_area() -> None:
    from switchps.workload.tensorflow.gradients import GradientComputer
    from switchps.workload.tensorflow.models import build_model
    from switchps.workload.data import load_dataset

    data = load_dataset("digits")
    rows = np.arange(20)
    computers = [GradientComputer(build_model("mlp", data.input_shape, data.num_classes, seed=1, hidden=[8]),
                                  data.x_train[:40], data.y_train[:40]) for _ in range(2)]
    expected, _ = computers[0].compute(rows, 10)
    computers[1].payload_to = wd.empty(computers[1].size, "bfloat16")
    got, _ = computers[1].compute(rows, 10)
    assert got is computers[1].payload_to and np.array_equal(got, wd.narrowed(expected, "bfloat16"))


def test_a_float32_layout_is_byte_for_byte_what_it_was() -> None:
    """float32 leaves ``Layout.wire_dtype`` unset: a float32 run's registrations are the bytes they were."""
    from switchps.protos.layout import layout_wire, make_layout, with_wire

    layout = make_layout([("w", (3, 2))], [("s", (4,))])
    assert with_wire(layout, "float32").SerializeToString() == layout.SerializeToString()
    assert layout_wire(layout) == "float32" and layout_wire(with_wire(layout, "bfloat16")) == "bfloat16"
