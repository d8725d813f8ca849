"""The PyTorch zoo and what surrounds it: sizes, image inputs, build errors that name the problem, the wire
layout's names, model files that plain PyTorch loads, and the processes that must not load torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from switchps.config.run import RunConfig
from switchps.workload.torch.files import load, save
from switchps.workload.torch.models import MODELS, build_model, check_model
from switchps.workload.torch.role import FRAMEWORK
from switchps.workload.torch.setup import load_state_dict, prepare, resolve_device
from switchps.workload.torch.weights import FlatParams

torch.set_num_threads(1)


def _params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def test_zoo_sizes() -> None:
    assert _params(build_model("logreg", (64,), 10)) == 650
    assert _params(build_model("mlp", (64,), 10, hidden=[16])) == 64 * 16 + 16 + 16 * 10 + 10
    assert _params(build_model("resnet20", (32, 32, 3), 10)) == 272_474  # as the Keras twin's
    assert _params(build_model("resnet18", (32, 32, 3), 10)) == 11_173_962


@pytest.mark.parametrize("shape", [(64,), (8, 8), (8, 8, 1), (9, 9, 3)])
@pytest.mark.parametrize("name", ["cnn", "resnet20"])
def test_image_models_take_rows_as_the_keras_models_do(name: str, shape: tuple[int, ...]) -> None:
    model = build_model(name, shape, 7)
    assert model(torch.zeros(2, *shape)).shape == (2, 7)


def test_check_model_finds_the_problems_without_building() -> None:
    assert check_model("resnet18", {}, "none") == []
    assert check_model("mlp", {"hidden": [8, 4]}, "none") == []
    [(where, why)] = check_model("resnet19", {}, "none")
    assert where == "name" and "unknown model 'resnet19'" in why and "resnet18" in why
    [(where, why)] = check_model("mlp", {"hiden": [8]}, "none")
    assert where.startswith("kwargs") and "hiden" in where + why


def test_an_image_model_refuses_a_vector_that_is_no_square() -> None:
    with pytest.raises(ValueError, match=r"cnn needs image inputs.*input_shape=\(10,\)"):
        build_model("cnn", (10,), 2)


def test_the_same_seed_builds_the_same_weights() -> None:
    a, b = build_model("mlp", (64,), 10, seed=3), build_model("mlp", (64,), 10, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    c = build_model("mlp", (64,), 10, seed=4)
    assert not torch.equal(a.state_dict()["logits.weight"], c.state_dict()["logits.weight"])


def _float64(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes).double())


def _momentum_none(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes), nn.BatchNorm1d(num_classes, momentum=None))


def _keras(input_shape: tuple[int, ...], num_classes: int) -> Any:
    import keras

    return keras.Sequential([keras.Input(input_shape), keras.layers.Dense(num_classes)])


@pytest.mark.parametrize("builder, error, message", [
    (lambda input_shape, num_classes: "a string", TypeError, r"model 'bad' returned str, not a torch.nn.Module"),
    (_float64, TypeError, r"model 'bad': 1.weight is torch.float64"),
    (_momentum_none, ValueError, r"model 'bad': BatchNorm 2 has momentum=None"),
    (_keras, TypeError, r"model 'bad' returned a Keras model .*set model.framework: tensorflow"),
])
def test_build_errors_name_the_problem(monkeypatch: pytest.MonkeyPatch, builder: Any, error: type[Exception],
                                       message: str) -> None:
    monkeypatch.setitem(MODELS, "bad", builder)
    with pytest.raises(error, match=message):
        build_model("bad", (64,), 10)


def test_layout_names_are_the_state_dict_keys_but_the_integer_buffers() -> None:
    model = build_model("resnet20", (8, 8, 1), 10)
    weights = FlatParams(model)
    keys = list(model.state_dict())
    integers = [k for k in keys if k.endswith("num_batches_tracked")]
    assert integers and set(weights.local) == set(integers)
    layout = weights.layout()
    names = [v.name for v in layout.variables] + [v.name for v in layout.state]
    assert sorted(names) == sorted(set(keys) - set(integers))
    assert [v.name for v in layout.variables] == [n for n, _ in model.named_parameters()]
    assert all(v.name.endswith(("running_mean", "running_var")) for v in layout.state)
    assert weights.size == sum(v.numel() for k, v in model.state_dict().items() if k not in weights.local)


# Plain PyTorch, re-declaring the zoo's models: what a user writes to load a run's model file.
PLAIN = """
import sys
from collections import OrderedDict
import torch
from torch import nn
name, file, inputs, out = sys.argv[1:]
if name == "logreg":
    model = nn.Sequential(OrderedDict(flatten=nn.Flatten(), logits=nn.Linear(64, 10)))
else:
    model = nn.Sequential(OrderedDict(flatten=nn.Flatten(), hidden0=nn.Linear(64, 16), relu0=nn.ReLU(),
                                      logits=nn.Linear(16, 10)))
if file.endswith(".safetensors"):
    from safetensors.torch import load_file
    state = load_file(file)
else:
    state = torch.load(file, weights_only=True)
model.load_state_dict(state)
model.eval()
torch.save(model(torch.load(inputs, weights_only=True)).detach(), out)
assert "switchps" not in sys.modules
"""


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
@pytest.mark.parametrize("name", ["logreg", "mlp"])
def test_plain_pytorch_loads_the_saved_model(tmp_path: Path, name: str, suffix: str) -> None:
    model = build_model(name, (64,), 10, seed=5, **({"hidden": [16]} if name == "mlp" else {})).eval()
    path = FRAMEWORK.save(model, tmp_path / "model.pt")
    assert path == tmp_path / "model.pt" and sorted(p.name for p in tmp_path.iterdir()) == \
        ["model.pt", "model.safetensors"]  # no temporary file left
    x = torch.randn(5, 64)
    torch.save(x, tmp_path / "x.pt")
    subprocess.run([sys.executable, "-c", PLAIN, name, str(tmp_path / f"model{suffix}"), str(tmp_path / "x.pt"),
                    str(tmp_path / "logits.pt")], check=True, timeout=120)
    with torch.no_grad():
        assert torch.equal(torch.load(tmp_path / "logits.pt", weights_only=True), model(x))


def test_a_tied_weight_is_saved_under_both_names(tmp_path: Path) -> None:
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    second.weight = first.weight
    save(nn.Sequential(first, second), tmp_path / "model.pt")
    for file in ("model.pt", "model.safetensors"):
        loaded = load(tmp_path / file)
        assert torch.equal(loaded["1.weight"], first.weight) and torch.equal(loaded["0.weight"], first.weight)


@pytest.mark.parametrize("module", ["switchps.checks", "switchps.workload.torch.models"])
def test_the_checks_and_the_zoo_load_no_torch(module: str) -> None:
    subprocess.run([sys.executable, "-c", f"import {module}, sys; assert 'torch' not in sys.modules"],
                   check=True, timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


def test_prepare_loads_the_configured_state_dict_strictly(tmp_path: Path) -> None:
    source = build_model("mlp", (64,), 10, seed=9, hidden=[16])
    save(source, tmp_path / "start.pt")
    for file in ("start.pt", "start.safetensors"):
        cfg = RunConfig.model_validate({"model": {"framework": "torch", "name": "mlp", "kwargs": {"hidden": [16]},
                                                  "state_dict": str(tmp_path / file)}})
        _, model = prepare(cfg)
        np.testing.assert_array_equal(FlatParams(model).read(), FlatParams(source).read())
    other = build_model("mlp", (64,), 10, hidden=[8])
    mismatch = r"(?s)model.state_dict .*start.pt does not fit the model.*size mismatch for hidden0.weight"
    with pytest.raises(ValueError, match=mismatch):
        load_state_dict(other, str(tmp_path / "start.pt"))
    with pytest.raises(ValueError, match=r"model.state_dict .*missing.pt"):
        load_state_dict(other, str(tmp_path / "missing.pt"))


def test_the_scorer_gives_the_test_sets_mean_loss_and_accuracy_in_eval_mode_leaving_the_mode() -> None:
    cfg = RunConfig.model_validate({"model": {"framework": "torch", "name": "resnet20"}})
    data, model = FRAMEWORK.prepare(cfg)
    gc = FRAMEWORK.computer(cfg, model, data.x_train, data.y_train)
    gc.compute(np.arange(64), 64)  # the computer's own state moves; the module's running statistics do not
    loss, accuracy = FRAMEWORK.scorer(model, data)()
    assert model.training
    model.eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(data.x_test))
    y = torch.from_numpy(data.y_test).long()
    assert loss == pytest.approx(float(torch.nn.functional.cross_entropy(logits, y)), rel=1e-5)
    assert accuracy == pytest.approx(float((logits.argmax(-1) == y).float().mean()))


def test_devices() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    if torch.cuda.is_available():
        assert resolve_device("auto", 5) == torch.device(f"cuda:{5 % torch.cuda.device_count()}")
    else:
        assert resolve_device("auto", 5) == torch.device("cpu")
        with pytest.raises(ValueError, match="runtime.device: cuda:1 but torch sees no GPU"):
            resolve_device("cuda:1")
