"""Datasets, loaded from local files only (never downloaded).

``digits`` ships with scikit-learn and ``synthetic`` is generated, so both
always work offline. The image datasets are read from the files Keras keeps
in its cache (``$KERAS_HOME/datasets``, default ``~/.keras/datasets``) or
from ``path``; a missing file raises ``DataNotFoundError`` naming it and where
to put it. ``locate_files`` finds them without loading anything, so a config
check can say so before any process starts.
Features come back float32 (pixels scaled to [0, 1]), labels int32.
"""

from __future__ import annotations

import gzip
import math
import os
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from switchps.config.run import RunConfig
from switchps.config.workload import informative_features
from switchps.names import DATASETS

_FASHION_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                  "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")
# name -> (cache dirs of the pre-Keras-3 and Keras 3 downloaders, train files, test files, label key, classes)
_CIFAR = {
    "cifar10": (("cifar-10-batches-py", "cifar-10-batches-py-target/cifar-10-batches-py"),
                [f"data_batch_{i}" for i in range(1, 6)], ["test_batch"], b"labels", 10),
    "cifar100": (("cifar-100-python", "cifar-100-python-target/cifar-100-python"),
                 ["train"], ["test"], b"fine_labels", 100),
}


class DataNotFoundError(FileNotFoundError):
    """A dataset file is not where it should be; the message says where to put it."""


@dataclass
class Dataset:
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    def partition(self, index: int, num_partitions: int) -> tuple[np.ndarray, np.ndarray]:
        """Worker ``index``'s disjoint, strided share of the training set."""
        rows = share(len(self.x_train), index, num_partitions, "partition")
        return self.x_train[rows], self.y_train[rows]


def share(n: int, index: int, num_workers: int, sampling: str) -> slice:
    """The rows of ``n`` training samples worker ``index`` draws from (a slice: a view, never a copy):
    every ``num_workers``-th (``partition``), or all of them (``replacement``)."""
    if num_workers < 1 or not 0 <= index < num_workers:
        raise ValueError(f"need 0 <= index < num_partitions, got index={index}, num_partitions={num_workers}")
    if sampling == "replacement":
        return slice(None)
    if num_workers > n:
        raise ValueError(f"{num_workers} partitions but only {n} training samples "
                         "(data.sampling: replacement draws from all of them)")
    return slice(index, None, num_workers)


def share_size(n: int, index: int, num_workers: int) -> int:
    """The samples worker ``index`` registers, which the epochs count: its strided share of ``n`` (at
    least one), whether it draws from that share or from all ``n``."""
    return max(1, len(range(index, n, num_workers)))


def registered_size(n: int, index: int, cfg: RunConfig) -> int:
    """The samples worker ``index`` registers: its share of ``n`` (``share_size``); in an elastic run, where
    every member draws from the whole set and N moves, all ``n`` (an epoch is the set once, whoever is in)."""
    return n if cfg.cluster.elastic else share_size(n, index, cfg.cluster.num_workers)


def cache_dir() -> Path:
    """Keras' dataset cache: ``$KERAS_HOME/datasets`` or ``~/.keras/datasets``."""
    return Path(os.environ.get("KERAS_HOME", "~/.keras")).expanduser() / "datasets"


def load_dataset(name: str, *, path: str | None = None, seed: int = 0, test_fraction: float = 0.2,
                 num_samples: int = 10000, num_features: int = 20, num_classes: int = 10,
                 shape: tuple[int, ...] | None = None, informative: int | None = None,
                 class_sep: float = 1.0) -> Dataset:
    """Load dataset ``name`` (one of ``DATASETS``).

    ``path`` overrides the file (mnist, npz) or directory (fashion_mnist,
    cifar10, cifar100). ``seed`` and ``test_fraction`` drive the splits of
    digits, synthetic and npz files without a test set; ``num_*`` size the
    synthetic data (``informative``: the features that carry the class; ``class_sep``: how far apart the
    classes lie), and ``shape`` (of
    ``num_features`` elements) shapes each sample.
    """
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    if name == "digits":
        return _digits(seed, test_fraction)
    if name == "synthetic":
        return _synthetic(seed, test_fraction, num_samples, num_features, num_classes, shape, informative,
                          class_sep)
    files = locate_files(name, path)
    if name == "mnist":
        return _mnist(files[0])
    if name == "fashion_mnist":
        return _fashion_mnist(files)
    if name in _CIFAR:
        return _cifar(name, files)
    if name == "npz":
        return _npz(files[0], seed, test_fraction)
    raise ValueError(f"unknown dataset {name!r}; expected one of {', '.join(DATASETS)}")


def configured_dataset(cfg: RunConfig) -> Dataset:
    """The dataset ``cfg.data`` names, split (and generated) by its seed, by default the run's."""
    d = cfg.data
    return load_dataset(d.name, path=d.path, seed=cfg.seed if d.seed is None else d.seed,
                        test_fraction=d.test_fraction, num_samples=d.num_samples, num_features=d.num_features, num_classes=d.num_classes,
                        shape=tuple(d.shape) if d.shape else None, informative=d.informative,
                        class_sep=d.class_sep)


def locate_files(name: str, path: str | None) -> list[Path]:
    """The files dataset ``name`` reads, in the order its loader reads them, checked to exist.

    Nothing is loaded. ``digits`` and ``synthetic`` need none. The first missing
    file raises ``DataNotFoundError`` naming it and where to put it.
    """
    if name == "mnist":
        return [_present(name, Path(path) if path else cache_dir() / "mnist.npz")]
    if name == "fashion_mnist":
        directory = Path(path) if path else cache_dir() / "fashion-mnist"
        hint = (f"put the 4 files {', '.join(_FASHION_FILES)} in {directory} (keras.datasets.fashion_mnist"
                ".load_data() downloads them on a machine with internet), or point data.path at their folder")
        return [_present(name, directory / f, hint) for f in _FASHION_FILES]
    if name in _CIFAR:
        dirs, train_files, test_files, _, _ = _CIFAR[name]
        candidates = [Path(path)] if path else [cache_dir() / d for d in dirs]
        directory = next((d for d in candidates if d.is_dir()), candidates[0])
        return [_present(name, directory / f) for f in (*train_files, *test_files)]
    if name == "npz":
        if not path:
            raise ValueError("npz: data.path is required")
        return [_present(name, Path(path), "check data.path")]
    return []


def _present(name: str, file: Path, hint: str | None = None) -> Path:
    if not file.is_file():
        hint = hint or (f"put it there (keras.datasets.{name}.load_data() downloads it on a machine with internet), "
                        "or point data.path at a copy")
        raise DataNotFoundError(f"{name}: {file} not found; {hint}")
    return file


def _split(x: np.ndarray, y: np.ndarray, seed: int, test_fraction: float, num_classes: int) -> Dataset:
    """Seeded shuffled split, stratified whenever the class counts allow it."""
    from sklearn.model_selection import train_test_split

    counts = np.unique(y, return_counts=True)[1]
    n_test = math.ceil(test_fraction * len(y))
    stratify = y if counts.min() >= 2 and len(counts) <= min(n_test, len(y) - n_test) else None
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=test_fraction, random_state=seed, stratify=stratify)
    return Dataset(x_tr, y_tr, x_te, y_te, num_classes)


def _digits(seed: int, test_fraction: float) -> Dataset:
    from sklearn.datasets import load_digits

    d = load_digits()
    return _split((d.data / 16).astype(np.float32), d.target.astype(np.int32), seed, test_fraction, 10)


def _synthetic(seed: int, test_fraction: float, num_samples: int, num_features: int, num_classes: int,
               shape: tuple[int, ...] | None, informative: int | None, class_sep: float) -> Dataset:
    from sklearn.datasets import make_classification
    from sklearn.preprocessing import StandardScaler

    informative = informative_features(num_features, informative)
    if num_classes > 2**informative:
        raise ValueError(f"synthetic: {num_classes} classes need more than {informative} informative features")
    x, y = make_classification(
        n_samples=num_samples, n_features=num_features, n_informative=informative,
        n_redundant=min(2, num_features - informative), n_repeated=0, n_classes=num_classes,
        n_clusters_per_class=2 if 2 * num_classes <= 2**informative else 1, class_sep=class_sep, random_state=seed)
    d = _split(x, y.astype(np.int32), seed, test_fraction, num_classes)
    scaler = StandardScaler().fit(d.x_train)
    d.x_train, d.x_test = (scaler.transform(a).astype(np.float32).reshape(-1, *(shape or (num_features,)))
                           for a in (d.x_train, d.x_test))
    return d


def _pixels(x: np.ndarray) -> np.ndarray:
    """uint8 pixels to float32 in [0, 1]; anything else just to float32."""
    out = x.astype(np.float32)
    if x.dtype == np.uint8:
        out /= 255
    return out


def _images(x_train: np.ndarray, y_train, x_test: np.ndarray, y_test, num_classes: int) -> Dataset:
    """Add a channel axis to (N, H, W) images, normalize, flatten labels to int32."""
    if x_train.ndim == 3:
        x_train, x_test = x_train[..., None], x_test[..., None]
    return Dataset(_pixels(x_train), np.asarray(y_train, np.int32).reshape(-1),
                   _pixels(x_test), np.asarray(y_test, np.int32).reshape(-1), num_classes)


def _mnist(file: Path) -> Dataset:
    with np.load(file) as f:
        return _images(f["x_train"], f["y_train"], f["x_test"], f["y_test"], 10)


def _read_idx(file: Path) -> np.ndarray:
    """An unsigned-byte IDX array (the MNIST file format), gzipped."""
    with gzip.open(file, "rb") as f:
        raw = f.read()
    if raw[:3] != b"\x00\x00\x08":
        raise ValueError(f"{file}: not an unsigned-byte IDX file")
    ndim = raw[3]
    shape = tuple(int(d) for d in np.frombuffer(raw, ">u4", count=ndim, offset=4))
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(shape)


def _fashion_mnist(files: list[Path]) -> Dataset:
    x_train, y_train, x_test, y_test = (_read_idx(f) for f in files)
    return _images(x_train, y_train, x_test, y_test, 10)


def _cifar(name: str, files: list[Path]) -> Dataset:
    """CIFAR python pickles: (N, 3072) uint8 rows in CHW order; ``files`` are the train then the test ones."""
    _, train_files, _, label_key, classes = _CIFAR[name]

    def load(paths: list[Path]) -> tuple[np.ndarray, np.ndarray]:
        xs, ys = [], []
        for file in paths:
            with open(file, "rb") as f:
                batch = pickle.load(f, encoding="bytes")
            xs.append(np.asarray(batch[b"data"], np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
            ys.append(np.asarray(batch[label_key]))
        return np.concatenate(xs), np.concatenate(ys)

    n = len(train_files)
    return _images(*load(files[:n]), *load(files[n:]), classes)


def _npz(file: Path, seed: int, test_fraction: float) -> Dataset:
    """An .npz with x_train, y_train and optionally x_test, y_test (else split off).

    (N, H, W) arrays get a channel axis; uint8 ones are scaled to [0, 1].
    """
    with np.load(file) as f:
        arrays = {k: f[k] for k in f.files}
    missing = [k for k in ("x_train", "y_train") if k not in arrays]
    if ("x_test" in arrays) != ("y_test" in arrays):
        missing.append("y_test" if "x_test" in arrays else "x_test")
    if missing:
        raise ValueError(f"npz: {file} lacks {', '.join(missing)} (has {', '.join(arrays) or 'nothing'})")
    y_train = arrays["y_train"].astype(np.int32).reshape(-1)
    y_test = arrays["y_test"].astype(np.int32).reshape(-1) if "y_test" in arrays else None
    splits = [("train", y_train)] + ([("test", y_test)] if y_test is not None else [])
    for split, y in splits:
        if len(arrays[f"x_{split}"]) != len(y):
            raise ValueError(f"npz: {file} has {len(arrays[f'x_{split}'])} x_{split} but {len(y)} y_{split}")
    if y_test is None:
        d = _split(arrays["x_train"], y_train, seed, test_fraction, int(y_train.max()) + 1)
        return _images(d.x_train, d.y_train, d.x_test, d.y_test, d.num_classes)
    return _images(arrays["x_train"], y_train, arrays["x_test"], y_test, int(max(y_train.max(), y_test.max())) + 1)
