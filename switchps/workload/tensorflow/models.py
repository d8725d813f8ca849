"""The model zoo: Keras models that output logits, built and seeded on return.

``build_model`` takes a zoo name (``MODELS``) or an import path
``package.module:function`` (found from the working directory too); the latter
is called as ``function(input_shape=..., num_classes=..., **kwargs)``. Weights
depend only on the seed, so every process building the same model gets the
same ones. Zoo layers are named explicitly, so variable paths (the wire layout)
do not depend on what else the process has built.

Keras is imported inside the builders, not here: ``check_model`` validates a
config's model from the builders' signatures in processes that must not load
TensorFlow (the PS, the launcher).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

from switchps.problems import Problem
from switchps.workload.builders import Load, check_builder, resolve

if TYPE_CHECKING:
    import keras


def _inputs(input_shape: tuple[int, ...]) -> keras.KerasTensor:
    import keras

    return keras.Input(shape=input_shape, name="x")


def _as_image(x: keras.KerasTensor, input_shape: tuple[int, ...], model: str) -> keras.KerasTensor:
    """Images pass through; a flat square vector becomes (s, s, 1) and (H, W) becomes (H, W, 1)."""
    from keras import layers

    if len(input_shape) == 3:
        return x
    if len(input_shape) == 2:
        return layers.Reshape((*input_shape, 1), name="to_image")(x)
    if len(input_shape) == 1 and math.isqrt(input_shape[0]) ** 2 == input_shape[0]:
        side = math.isqrt(input_shape[0])
        return layers.Reshape((side, side, 1), name="to_image")(x)
    raise ValueError(f"{model} needs image inputs (H, W, C) or a flat square size, got input_shape={input_shape}")


def logreg(input_shape: tuple[int, ...], num_classes: int) -> keras.Model:
    """Multinomial logistic regression."""
    import keras
    from keras import layers

    x = _inputs(input_shape)
    out = layers.Dense(num_classes, name="logits")(layers.Flatten(name="flatten")(x))
    return keras.Model(x, out, name="logreg")


def mlp(input_shape: tuple[int, ...], num_classes: int, hidden: list[int] | tuple[int, ...] = (128,)) -> keras.Model:
    """Fully connected ReLU network with the given hidden widths."""
    import keras
    from keras import layers

    x = _inputs(input_shape)
    h = layers.Flatten(name="flatten")(x)
    for i, width in enumerate(hidden):
        h = layers.Dense(int(width), activation="relu", name=f"hidden{i}")(h)
    return keras.Model(x, layers.Dense(num_classes, name="logits")(h), name="mlp")


def cnn(input_shape: tuple[int, ...], num_classes: int, filters: list[int] | tuple[int, ...] = (32, 64),
        dense: int = 128) -> keras.Model:
    """(conv3x3 + ReLU + 2x2 max-pool) per entry of ``filters``, then a dense ReLU layer."""
    import keras
    from keras import layers

    x = _inputs(input_shape)
    h = _as_image(x, input_shape, "cnn")
    for i, f in enumerate(filters):
        h = layers.Conv2D(int(f), 3, padding="same", activation="relu", name=f"conv{i}")(h)
        h = layers.MaxPooling2D(2, padding="same", name=f"pool{i}")(h)
    h = layers.Dense(dense, activation="relu", name="dense")(layers.Flatten(name="flatten")(h))
    return keras.Model(x, layers.Dense(num_classes, name="logits")(h), name="cnn")


def _conv_bn(h: keras.KerasTensor, filters: int, kernel: int, stride: int, name: str) -> keras.KerasTensor:
    from keras import layers

    h = layers.Conv2D(filters, kernel, strides=stride, padding="same", use_bias=False,
                      kernel_initializer="he_normal", name=f"{name}_conv")(h)
    return layers.BatchNormalization(name=f"{name}_bn")(h)


def _resnet(input_shape: tuple[int, ...], num_classes: int, blocks: int, name: str) -> keras.Model:
    """CIFAR ResNet v1 (He et al. 2016): 3 stages of ``blocks`` basic blocks with 16/32/64 filters.

    Downsampling blocks use a strided 1x1 conv + BN projection shortcut.
    """
    import keras
    from keras import layers

    x = _inputs(input_shape)
    h = layers.ReLU(name="stem_relu")(_conv_bn(_as_image(x, input_shape, name), 16, 3, 1, "stem"))
    for stage, filters in enumerate((16, 32, 64)):
        for block in range(blocks):
            tag = f"s{stage}b{block}"
            stride = 2 if stage > 0 and block == 0 else 1
            r = layers.ReLU(name=f"{tag}_relu1")(_conv_bn(h, filters, 3, stride, f"{tag}_1"))
            r = _conv_bn(r, filters, 3, 1, f"{tag}_2")
            shortcut = _conv_bn(h, filters, 1, stride, f"{tag}_proj") if stride > 1 else h
            h = layers.ReLU(name=f"{tag}_relu2")(layers.Add(name=f"{tag}_add")([shortcut, r]))
    h = layers.GlobalAveragePooling2D(name="pool")(h)
    return keras.Model(x, layers.Dense(num_classes, name="logits")(h), name=name)


def resnet20(input_shape: tuple[int, ...], num_classes: int) -> keras.Model:
    """ResNet-20 (n=3)."""
    return _resnet(input_shape, num_classes, 3, "resnet20")


def resnet32(input_shape: tuple[int, ...], num_classes: int) -> keras.Model:
    """ResNet-32 (n=5)."""
    return _resnet(input_shape, num_classes, 5, "resnet32")


MODELS: dict[str, Callable[..., keras.Model]] = {
    "logreg": logreg,
    "mlp": mlp,
    "cnn": cnn,
    "resnet20": resnet20,
    "resnet32": resnet32,
}


def check_model(name: str, kwargs: dict[str, Any], load: Load) -> list[Problem]:
    """Why ``build_model(name, ..., **kwargs)`` would fail, found without building (so without TF)."""
    return check_builder(MODELS, name, kwargs, load)


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, seed: int = 0, **kwargs) -> keras.Model:
    """Build model ``name`` for ``input_shape`` (no batch dim) with weights drawn from ``seed``.

    Seeds Python, NumPy, TF and Keras globally (``keras.utils.set_random_seed``)
    so that import-path models are deterministic too.
    """
    fn = resolve(MODELS, name)
    import keras

    input_shape = tuple(int(d) for d in input_shape)
    keras.utils.set_random_seed(seed)
    model = fn(input_shape=input_shape, num_classes=num_classes, **kwargs)
    if not isinstance(model, keras.Model):
        hint = "; set model.framework: torch" if type(model).__module__.split(".")[0] == "torch" else ""
        raise TypeError(f"model {name!r} returned {type(model).__name__}, not a keras.Model{hint}")
    if not model.built:
        model.build((None, *input_shape))
    return model
