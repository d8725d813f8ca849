"""The model zoo and the dataset loaders (fake files in the real on-disk formats)."""

from __future__ import annotations

import gzip
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

try:  # must precede TF's first op; another test module may already have started TF
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
except RuntimeError:
    pass

import keras

from switchps.config.run import parse_config
from switchps.config.workload import DataSpec
from switchps.workload.data import DATASETS, Dataset, DataNotFoundError, configured_dataset, load_dataset
from switchps.workload.tensorflow.models import MODELS, build_model


def _logits(model: keras.Model, input_shape: tuple[int, ...], batch: int = 3) -> np.ndarray:
    x = np.random.default_rng(0).random((batch, *input_shape), dtype=np.float32)
    return keras.ops.convert_to_numpy(model(x, training=False))


def _weights(model: keras.Model) -> dict[str, np.ndarray]:
    return {v.path: v.numpy() for v in model.weights}


# ---------------------------------------------------------------- models


@pytest.mark.parametrize("name,shape,kwargs", [
    ("logreg", (64,), {}),
    ("logreg", (8, 8, 1), {}),
    ("mlp", (64,), {"hidden": [16, 8]}),
    ("mlp", (32, 32, 3), {}),
    ("cnn", (64,), {}),
    ("cnn", (8, 8, 1), {}),
    ("cnn", (784,), {}),
    ("cnn", (32, 32, 3), {"filters": [4, 8], "dense": 16}),
    ("resnet20", (16, 16, 3), {}),
])
def test_zoo_models_output_logits(name, shape, kwargs):
    model = build_model(name, shape, 7, seed=1, **kwargs)
    assert model.built and model.input_shape == (None, *shape)
    out = _logits(model, shape)
    assert out.shape == (3, 7) and np.isfinite(out).all()
    assert not np.allclose(out.sum(axis=1), 1.0)  # raw logits, no softmax
    assert model.layers[-1].activation is keras.activations.linear


def test_mlp_hidden_widths():
    model = build_model("mlp", (64,), 10, hidden=[32, 16])
    assert [l.units for l in model.layers if isinstance(l, keras.layers.Dense)] == [32, 16, 10]
    assert [l.units for l in build_model("mlp", (64,), 10).layers if isinstance(l, keras.layers.Dense)] == [128, 10]


def test_resnet_depths():
    def depth(m: keras.Model) -> int:  # weighted layers on the main path (the paper's count)
        return sum(isinstance(l, (keras.layers.Conv2D, keras.layers.Dense)) and "proj" not in l.name for l in m.layers)

    r20, r32 = build_model("resnet20", (16, 16, 3), 10), build_model("resnet32", (16, 16, 3), 10)
    assert (depth(r20), depth(r32)) == (20, 32)
    assert len(r32.layers) > len(r20.layers) and r32.count_params() > r20.count_params()
    assert any(isinstance(l, keras.layers.BatchNormalization) for l in r20.layers)
    assert r20.get_layer("s2b2_2_conv").output.shape[1:] == (4, 4, 64)
    assert _logits(r32, (16, 16, 3), batch=2).shape == (2, 10)


@pytest.mark.parametrize("name", ["cnn", "resnet20"])
def test_image_models_reject_non_square_flat_inputs(name):
    with pytest.raises(ValueError, match="input_shape"):
        build_model(name, (20,), 10)


def test_same_seed_same_weights_different_seed_different():
    a = _weights(build_model("cnn", (8, 8, 1), 10, seed=5))
    build_model("mlp", (64,), 10, seed=9)  # unrelated builds in between change nothing
    b = _weights(build_model("cnn", (8, 8, 1), 10, seed=5))
    c = _weights(build_model("cnn", (8, 8, 1), 10, seed=6))
    assert list(a) == list(b) == list(c)  # stable variable paths (the wire layout)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not all(np.array_equal(a[k], c[k]) for k in a if a[k].std() > 0)


def test_same_seed_same_weights_across_processes(tmp_path):
    out = tmp_path / "w.npz"
    code = textwrap.dedent(f"""
        import numpy as np, keras
        from switchps.workload.tensorflow.models import build_model
        m = build_model("mlp", (64,), 10, seed=3, hidden=[32])
        np.savez({str(out)!r}, **{{v.path.replace("/", "|"): v.numpy() for v in m.weights}})
    """)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
    here = _weights(build_model("mlp", (64,), 10, seed=3, hidden=[32]))
    with np.load(out) as there:
        assert sorted(k.replace("|", "/") for k in there.files) == sorted(here)
        assert all(np.array_equal(there[k.replace("/", "|")], v) for k, v in here.items())


@pytest.fixture
def custom_module(tmp_path, monkeypatch):
    (tmp_path / "sps_custom_models.py").write_text(textwrap.dedent("""
        import keras

        def tiny(input_shape, num_classes, width=4):
            # no Input layer: unbuilt until build_model builds it
            return keras.Sequential([keras.layers.Flatten(), keras.layers.Dense(width, name="h"),
                                     keras.layers.Dense(num_classes, name="out")])

        def not_a_model(input_shape, num_classes):
            return "nope"

        def a_torch_module(input_shape, num_classes):
            import torch

            return torch.nn.Linear(4, num_classes)

        CONSTANT = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "sps_custom_models", raising=False)
    return "sps_custom_models"


def test_import_path_model(custom_module):
    model = build_model(f"{custom_module}:tiny", (6, 6, 1), 5, seed=2, width=3)
    assert model.built and model.get_layer("h").units == 3
    assert _logits(model, (6, 6, 1)).shape == (3, 5)
    again = build_model(f"{custom_module}:tiny", (6, 6, 1), 5, seed=2, width=3)
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), again.get_weights()))


@pytest.mark.parametrize("spec", ["no_such_module_xyz:fn", "sps_custom_models:missing", "sps_custom_models:CONSTANT"])
def test_bad_import_path(custom_module, spec):
    with pytest.raises(ValueError, match=spec):
        build_model(spec, (4,), 2)


def test_import_path_must_return_a_model(custom_module):
    with pytest.raises(TypeError, match="keras.Model"):
        build_model(f"{custom_module}:not_a_model", (4,), 2)
    with pytest.raises(TypeError, match="returned Linear, not a keras.Model; set model.framework: torch"):
        build_model(f"{custom_module}:a_torch_module", (4,), 2)


def test_unknown_model_lists_the_zoo():
    assert set(MODELS) == {"logreg", "mlp", "cnn", "resnet20", "resnet32"}
    with pytest.raises(ValueError, match="logreg, mlp, cnn, resnet20, resnet32"):
        build_model("vgg", (4,), 2)


# ---------------------------------------------------------------- datasets


def test_digits():
    d = load_dataset("digits")
    assert d.x_train.shape == (1437, 64) and d.x_test.shape == (360, 64) and d.input_shape == (64,)
    assert d.x_train.dtype == np.float32 and d.y_train.dtype == np.int32 and d.num_classes == 10
    assert d.x_train.min() == 0.0 and d.x_train.max() == 1.0
    # stratified: each class's share of the test set matches the whole set to within one sample
    total = np.bincount(np.concatenate([d.y_train, d.y_test]))
    assert np.all(np.abs(np.bincount(d.y_test) - total * 0.2) <= 1)
    same, other = load_dataset("digits"), load_dataset("digits", seed=1)
    assert np.array_equal(d.x_train, same.x_train) and np.array_equal(d.y_test, same.y_test)
    assert not np.array_equal(d.y_train, other.y_train)
    assert load_dataset("digits", test_fraction=0.5).x_test.shape == (899, 64)


@pytest.mark.parametrize("num_partitions", [1, 3, 4, 10])
def test_partitions_are_disjoint_and_cover(num_partitions):
    n = 10
    d = Dataset(np.arange(n, dtype=np.float32)[:, None], np.arange(n, dtype=np.int32), np.zeros((1, 1)),
                np.zeros(1, np.int32), 10)
    partitions = [d.partition(i, num_partitions) for i in range(num_partitions)]
    ids = np.concatenate([x[:, 0] for x, _ in partitions])
    assert len(ids) == n and set(ids) == set(range(n))
    assert all(np.array_equal(x[:, 0], y) for x, y in partitions)  # x and y stay aligned
    assert max(len(y) for _, y in partitions) - min(len(y) for _, y in partitions) <= 1


@pytest.mark.parametrize("index,num_partitions", [(-1, 2), (2, 2), (0, 0), (0, 1438)])
def test_partition_validates(index, num_partitions):
    with pytest.raises(ValueError):
        load_dataset("digits").partition(index, num_partitions)


def test_synthetic():
    d = load_dataset("synthetic", num_samples=500, num_features=6, num_classes=3, seed=4, test_fraction=0.1)
    assert d.x_train.shape == (450, 6) and d.x_test.shape == (50, 6) and d.num_classes == 3
    assert d.x_train.dtype == np.float32 and d.y_train.dtype == np.int32
    assert set(np.unique(d.y_train)) == {0, 1, 2}
    np.testing.assert_allclose(d.x_train.mean(0), 0, atol=1e-5)
    np.testing.assert_allclose(d.x_train.std(0), 1, atol=1e-4)
    again = load_dataset("synthetic", num_samples=500, num_features=6, num_classes=3, seed=4, test_fraction=0.1)
    assert np.array_equal(d.x_test, again.x_test)
    default = load_dataset("synthetic")
    assert default.x_train.shape == (8000, 20) and default.num_classes == 10


def test_synthetic_takes_a_sample_shape_such_as_cifars():
    d = load_dataset("synthetic", num_samples=300, num_features=48, num_classes=10, shape=(4, 4, 3))
    assert d.x_train.shape == (240, 4, 4, 3) and d.x_test.shape == (60, 4, 4, 3) and d.input_shape == (4, 4, 3)
    flat = load_dataset("synthetic", num_samples=300, num_features=48, num_classes=10)
    assert np.array_equal(d.x_train.reshape(240, 48), flat.x_train), "the same samples, shaped"
    assert DataSpec(name="synthetic", shape=[32, 32, 3]).num_features == 3072
    cfg = parse_config({"data": {"name": "synthetic", "num_samples": 100, "shape": [6, 6, 3]}, "train": {"steps": 1}}, [])
    assert configured_dataset(cfg).input_shape == (6, 6, 3), "a run config's shape reaches the data"
    for bad, problem in (({"name": "digits", "shape": [8, 8]}, "synthetic only"),
                         ({"name": "synthetic", "shape": [32, 32, 3], "num_features": 20}, "not the product")):
        with pytest.raises(ValueError, match=problem):
            DataSpec(**bad)


def test_synthetic_informative_features_reach_the_generator_and_are_bounded():
    kw = dict(num_samples=300, num_features=40, num_classes=10, seed=2)
    more = load_dataset("synthetic", informative=24, **kw)
    assert not np.array_equal(more.x_train, load_dataset("synthetic", **kw).x_train), "the default is 10"
    cfg = parse_config({"data": {"name": "synthetic", "num_samples": 300, "num_features": 40, "informative": 24},
                        "train": {"steps": 1}, "seed": 2}, [])
    assert np.array_equal(configured_dataset(cfg).x_train, more.x_train), "a run config's informative reaches the data"
    apart = load_dataset("synthetic", informative=24, class_sep=4.0, **kw)
    assert not np.array_equal(apart.x_train, more.x_train), "class_sep reaches the generator"
    cfg = parse_config({"data": {"name": "synthetic", "num_samples": 300, "num_features": 40, "informative": 24,
                                 "class_sep": 4.0}, "train": {"steps": 1}, "seed": 2}, [])
    assert np.array_equal(configured_dataset(cfg).x_train, apart.x_train), "and a run config's class_sep"


def test_the_data_seed_fixes_the_data_whatever_the_runs_seed():
    def data(run_seed: int, **more) -> np.ndarray:
        raw = {"data": {"name": "synthetic", "num_samples": 200, **more}, "train": {"steps": 1}, "seed": run_seed}
        return configured_dataset(parse_config(raw, [])).x_train

    assert not np.array_equal(data(1), data(2)), "by default each run's seed makes its own data"
    assert np.array_equal(data(1, seed=7), data(2, seed=7)), "data.seed fixes it"
    assert np.array_equal(data(7), data(2, seed=7)), "as the run's seed would"
    for bad, problem in (({"num_features": 20, "informative": 21}, "informative 21 is more than num_features 20"),
                         ({"num_features": 20, "informative": 3}, "10 classes need more than 3 informative"),
                         ({"num_features": 3}, "10 classes need more than 3 informative")):
        with pytest.raises(ValueError, match=problem):
            DataSpec(name="synthetic", **bad)


def test_unknown_dataset_and_bad_fraction():
    with pytest.raises(ValueError, match=", ".join(DATASETS)):
        load_dataset("imagenet")
    with pytest.raises(ValueError, match="test_fraction"):
        load_dataset("digits", test_fraction=1.0)


def _u8(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.integers(0, 256, shape, dtype=np.uint8)


@pytest.fixture
def keras_home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "kh"))
    (tmp_path / "kh" / "datasets").mkdir(parents=True)
    return tmp_path / "kh" / "datasets"


def _check_images(d: Dataset, x_train: np.ndarray, x_test: np.ndarray, y_train, y_test, classes: int) -> None:
    if x_train.ndim == 3:
        x_train, x_test = x_train[..., None], x_test[..., None]
    for got, want in ((d.x_train, x_train), (d.x_test, x_test)):
        assert got.dtype == np.float32 and got.shape == want.shape
        np.testing.assert_allclose(got, want / 255.0, rtol=1e-6)
    assert d.y_train.dtype == np.int32 and np.array_equal(d.y_train, np.ravel(y_train))
    assert np.array_equal(d.y_test, np.ravel(y_test)) and d.num_classes == classes


def test_mnist_from_keras_cache_and_path(keras_home, tmp_path):
    rng = np.random.default_rng(0)
    arrays = dict(x_train=_u8(rng, 6, 28, 28), y_train=rng.integers(0, 10, 6).astype(np.uint8),
                  x_test=_u8(rng, 2, 28, 28), y_test=rng.integers(0, 10, 2).astype(np.uint8))
    np.savez(keras_home / "mnist.npz", **arrays)
    d = load_dataset("mnist")
    _check_images(d, arrays["x_train"], arrays["x_test"], arrays["y_train"], arrays["y_test"], 10)
    assert d.input_shape == (28, 28, 1)
    np.savez(tmp_path / "elsewhere.npz", **arrays)
    assert load_dataset("mnist", path=str(tmp_path / "elsewhere.npz")).x_test.shape == (2, 28, 28, 1)


def _write_idx(file: Path, a: np.ndarray) -> None:
    header = bytes([0, 0, 8, a.ndim]) + np.asarray(a.shape, ">u4").tobytes()
    with gzip.open(file, "wb") as f:
        f.write(header + a.tobytes())


def test_fashion_mnist_idx_files(keras_home):
    rng = np.random.default_rng(1)
    x_train, x_test = _u8(rng, 5, 28, 28), _u8(rng, 3, 28, 28)
    y_train, y_test = _u8(rng, 5) % 10, _u8(rng, 3) % 10
    folder = keras_home / "fashion-mnist"
    folder.mkdir()
    for name, a in (("train-images-idx3-ubyte.gz", x_train), ("train-labels-idx1-ubyte.gz", y_train),
                    ("t10k-images-idx3-ubyte.gz", x_test), ("t10k-labels-idx1-ubyte.gz", y_test)):
        _write_idx(folder / name, a)
    _check_images(load_dataset("fashion_mnist"), x_train, x_test, y_train, y_test, 10)
    (folder / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataNotFoundError, match=str(folder / "t10k-labels-idx1-ubyte.gz")):
        load_dataset("fashion_mnist")


def _write_cifar(folder: Path, files: dict[str, tuple[np.ndarray, list[int]]], label_key: bytes) -> None:
    folder.mkdir(parents=True)
    for name, (x_hwc, labels) in files.items():
        rows = x_hwc.transpose(0, 3, 1, 2).reshape(len(x_hwc), 3072)  # the archive's CHW row layout
        with open(folder / name, "wb") as f:
            pickle.dump({b"batch_label": b"fake", label_key: labels, b"data": rows}, f)


def test_cifar10_batches(keras_home, tmp_path):
    rng = np.random.default_rng(2)
    files = {f"data_batch_{i}": (_u8(rng, 2, 32, 32, 3), [i, 9 - i]) for i in range(1, 6)}
    files["test_batch"] = (_u8(rng, 3, 32, 32, 3), [0, 1, 2])
    _write_cifar(keras_home / "cifar-10-batches-py", files, b"labels")
    x_train = np.concatenate([files[f"data_batch_{i}"][0] for i in range(1, 6)])
    y_train = [y for i in range(1, 6) for y in files[f"data_batch_{i}"][1]]
    d = load_dataset("cifar10")
    _check_images(d, x_train, files["test_batch"][0], y_train, [0, 1, 2], 10)
    assert d.input_shape == (32, 32, 3)
    # the Keras 3 cache layout and an explicit path work too
    (keras_home / "cifar-10-batches-py").rename(tmp_path / "c10")
    assert load_dataset("cifar10", path=str(tmp_path / "c10")).x_train.shape == (10, 32, 32, 3)
    (keras_home / "cifar-10-batches-py-target").mkdir()
    (tmp_path / "c10").rename(keras_home / "cifar-10-batches-py-target" / "cifar-10-batches-py")
    assert load_dataset("cifar10").x_test.shape == (3, 32, 32, 3)


def test_cifar100(keras_home):
    rng = np.random.default_rng(3)
    files = {"train": (_u8(rng, 4, 32, 32, 3), [0, 42, 99, 7]), "test": (_u8(rng, 2, 32, 32, 3), [5, 98])}
    _write_cifar(keras_home / "cifar-100-python", files, b"fine_labels")
    _check_images(load_dataset("cifar100"), files["train"][0], files["test"][0], files["train"][1],
                  files["test"][1], 100)


def test_npz(tmp_path):
    rng = np.random.default_rng(4)
    x_train, x_test = _u8(rng, 8, 5, 5), _u8(rng, 4, 5, 5)
    y_train, y_test = np.arange(8) % 3, np.array([[2], [1], [0], [2]])
    np.savez(tmp_path / "full.npz", x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
    _check_images(load_dataset("npz", path=str(tmp_path / "full.npz")), x_train, x_test, y_train, y_test, 3)

    feats = rng.normal(size=(50, 7)).astype(np.float64)
    labels = np.arange(50) % 5
    np.savez(tmp_path / "train_only.npz", x_train=feats, y_train=labels)
    d = load_dataset("npz", path=str(tmp_path / "train_only.npz"), test_fraction=0.2, seed=1)
    assert d.x_train.shape == (40, 7) and d.x_test.shape == (10, 7) and d.num_classes == 5
    assert d.x_train.dtype == np.float32 and np.bincount(d.y_test).tolist() == [2] * 5  # stratified
    merged = np.concatenate([d.x_train, d.x_test])  # float features are not rescaled
    np.testing.assert_allclose(np.sort(merged, axis=0), np.sort(feats.astype(np.float32), axis=0))

    np.savez(tmp_path / "bad.npz", x_train=feats, x_test=feats)
    with pytest.raises(ValueError, match="y_train, y_test"):
        load_dataset("npz", path=str(tmp_path / "bad.npz"))
    with pytest.raises(ValueError, match="path"):
        load_dataset("npz")


@pytest.mark.parametrize("name,expected", [
    ("mnist", "mnist.npz"),
    ("fashion_mnist", "fashion-mnist/train-images-idx3-ubyte.gz"),
    ("cifar10", "cifar-10-batches-py/data_batch_1"),
    ("cifar100", "cifar-100-python/train"),
])
def test_missing_files_say_where(keras_home, name, expected):
    with pytest.raises(DataNotFoundError) as e:
        load_dataset(name)
    assert isinstance(e.value, FileNotFoundError)
    assert str(keras_home / expected) in str(e.value) and "data.path" in str(e.value)


def test_missing_npz_and_default_cache(tmp_path, monkeypatch):
    with pytest.raises(DataNotFoundError, match=str(tmp_path / "nope.npz")):
        load_dataset("npz", path=str(tmp_path / "nope.npz"))
    monkeypatch.delenv("KERAS_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(DataNotFoundError, match=str(tmp_path / ".keras" / "datasets" / "mnist.npz")):
        load_dataset("mnist")
