"""The PyTorch model zoo: ``nn.Module``s that output logits, the twins of ``workload/tensorflow/models``.

``build_model`` takes a zoo name (``MODELS``) or an import path ``package.module:function``, called as
``function(input_shape=..., num_classes=..., **kwargs)``; the weights depend only on the seed. Samples
arrive as the Keras models get them: float32 rows of ``input_shape``, images channels-last (H, W, C); a
model that needs an image converts inside ``forward`` (``ToImage``). Every submodule is named explicitly
(``nn.Sequential`` over an ``OrderedDict``), so the ``state_dict`` keys, which are the wire layout's names,
depend on nothing else, and a plain-torch user can re-declare a zoo model and load its file.

torch is imported inside the builders, not here: ``check_model`` validates a config's model from the
builders' signatures in processes that must not load torch (the PS, the launcher).
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable

from switchps.problems import Problem
from switchps.workload.builders import Load, check_builder, resolve

if TYPE_CHECKING:
    import torch
    from torch import nn


def _image_shape(input_shape: tuple[int, ...], model: str) -> tuple[int, int, int]:
    """(H, W, C) of the image ``input_shape`` stands for: itself, (H, W, 1), or a flat square (s, s, 1)."""
    if len(input_shape) == 3:
        return input_shape[0], input_shape[1], input_shape[2]
    if len(input_shape) == 2:
        return input_shape[0], input_shape[1], 1
    if len(input_shape) == 1 and math.isqrt(input_shape[0]) ** 2 == input_shape[0]:
        side = math.isqrt(input_shape[0])
        return side, side, 1
    raise ValueError(f"{model} needs image inputs (H, W, C) or a flat square size, got input_shape={input_shape}")


def _to_image(input_shape: tuple[int, ...], model: str) -> nn.Module:
    """A module turning rows of ``input_shape`` into (N, C, H, W) images (no parameters, no state)."""
    from torch import nn

    h, w, c = _image_shape(input_shape, model)

    class ToImage(nn.Module):
        """(N, *input_shape), channels-last, to (N, C, H, W), as TF's ``_as_image`` then a layout change."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.reshape(-1, h, w, c).permute(0, 3, 1, 2)

    return ToImage()


def logreg(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Multinomial logistic regression."""
    from torch import nn

    return nn.Sequential(OrderedDict(flatten=nn.Flatten(), logits=nn.Linear(math.prod(input_shape), num_classes)))


def mlp(input_shape: tuple[int, ...], num_classes: int, hidden: list[int] | tuple[int, ...] = (128,)) -> nn.Module:
    """Fully connected ReLU network with the given hidden widths."""
    from torch import nn

    layers: OrderedDict[str, nn.Module] = OrderedDict(flatten=nn.Flatten())
    width = math.prod(input_shape)
    for i, out in enumerate(int(w) for w in hidden):
        layers[f"hidden{i}"] = nn.Linear(width, out)
        layers[f"relu{i}"] = nn.ReLU()
        width = out
    layers["logits"] = nn.Linear(width, num_classes)
    return nn.Sequential(layers)


def cnn(input_shape: tuple[int, ...], num_classes: int, filters: list[int] | tuple[int, ...] = (32, 64),
        dense: int = 128) -> nn.Module:
    """(conv3x3 + ReLU + 2x2 max-pool) per entry of ``filters``, then a dense ReLU layer."""
    from torch import nn

    h, w, channels = _image_shape(input_shape, "cnn")
    layers: OrderedDict[str, nn.Module] = OrderedDict(to_image=_to_image(input_shape, "cnn"))
    for i, f in enumerate(int(f) for f in filters):
        layers[f"conv{i}"] = nn.Conv2d(channels, f, 3, padding=1)
        layers[f"relu{i}"] = nn.ReLU()
        layers[f"pool{i}"] = nn.MaxPool2d(2, ceil_mode=True)  # Keras's padding="same"
        channels, h, w = f, -(-h // 2), -(-w // 2)
    layers["flatten"] = nn.Flatten()
    layers["dense"] = nn.Linear(channels * h * w, dense)
    layers["dense_relu"] = nn.ReLU()
    layers["logits"] = nn.Linear(dense, num_classes)
    return nn.Sequential(layers)


def _conv_bn(channels: int, filters: int, kernel: int, stride: int) -> nn.Module:
    from torch import nn

    conv = nn.Conv2d(channels, filters, kernel, stride=stride, padding=kernel // 2, bias=False)
    nn.init.kaiming_normal_(conv.weight, nonlinearity="relu")  # Keras's he_normal
    return nn.Sequential(OrderedDict(conv=conv, bn=nn.BatchNorm2d(filters)))


def _block(channels: int, filters: int, stride: int) -> nn.Module:
    """A basic block: two 3x3 conv + BN, the shortcut a strided 1x1 conv + BN where the shape changes."""
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = _conv_bn(channels, filters, 3, stride)
            self.conv2 = _conv_bn(filters, filters, 3, 1)
            self.proj = _conv_bn(channels, filters, 1, stride) if stride > 1 or channels != filters else None
            self.relu = nn.ReLU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            r = self.conv2(self.relu(self.conv1(x)))
            return self.relu(r + (x if self.proj is None else self.proj(x)))

    return Block()


def _resnet(input_shape: tuple[int, ...], num_classes: int, widths: tuple[int, ...], blocks: int,
            name: str) -> nn.Module:
    """A CIFAR ResNet v1 (He et al. 2016): a 3x3 stem at ``widths[0]`` (stride 1, no max-pool), then one
    stage of ``blocks`` basic blocks per width, each after the first halving the resolution; global average
    pooling and the logits. BatchNorm keeps torch's defaults (momentum 0.1, eps 1e-5; Keras's twin's are
    0.01 and 1e-3 in torch's terms), the convolutions are He-normal as Keras's."""
    from torch import nn

    _, _, channels = _image_shape(input_shape, name)
    layers: OrderedDict[str, nn.Module] = OrderedDict(to_image=_to_image(input_shape, name))
    layers["stem"] = _conv_bn(channels, widths[0], 3, 1)
    layers["stem_relu"] = nn.ReLU()
    channels = widths[0]
    for stage, filters in enumerate(widths):
        for block in range(blocks):
            stride = 2 if stage > 0 and block == 0 else 1
            layers[f"s{stage}b{block}"] = _block(channels, filters, stride)
            channels = filters
    layers["pool"] = nn.AdaptiveAvgPool2d(1)
    layers["flatten"] = nn.Flatten()
    layers["logits"] = nn.Linear(channels, num_classes)
    return nn.Sequential(layers)


def resnet20(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """ResNet-20 (n=3): 16/32/64 filters."""
    return _resnet(input_shape, num_classes, (16, 32, 64), 3, "resnet20")


def resnet32(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """ResNet-32 (n=5): 16/32/64 filters."""
    return _resnet(input_shape, num_classes, (16, 32, 64), 5, "resnet32")


def resnet18(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """ResNet-18 with the CIFAR stem: basic blocks [2, 2, 2, 2] at 64/128/256/512 filters (11.17M
    parameters for 10 classes)."""
    return _resnet(input_shape, num_classes, (64, 128, 256, 512), 2, "resnet18")


MODELS: dict[str, Callable[..., Any]] = {
    "logreg": logreg,
    "mlp": mlp,
    "cnn": cnn,
    "resnet20": resnet20,
    "resnet32": resnet32,
    "resnet18": resnet18,
}


def check_model(name: str, kwargs: dict[str, Any], load: Load) -> list[Problem]:
    """Why ``build_model(name, ..., **kwargs)`` would fail, found without building (so without torch)."""
    return check_builder(MODELS, name, kwargs, load)


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, seed: int = 0, **kwargs: Any) -> nn.Module:
    """Build model ``name`` for ``input_shape`` (no batch dim) on the CPU, its weights drawn from ``seed``.

    Seeds Python, NumPy and torch globally, so that import-path models are deterministic too. Refuses what
    the wire cannot carry: a model that is no ``nn.Module``, floating tensors other than float32, and a
    BatchNorm with ``momentum=None`` (its cumulative average counts ``num_batches_tracked``, an integer the
    PS does not keep).
    """
    fn = resolve(MODELS, name)
    import numpy as np
    import torch
    from torch import nn

    input_shape = tuple(int(d) for d in input_shape)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model = fn(input_shape=input_shape, num_classes=num_classes, **kwargs)
    if type(model).__module__.split(".")[0] in ("keras", "tf_keras", "tensorflow"):
        raise TypeError(f"model {name!r} returned a Keras model ({type(model).__name__}), not a torch.nn.Module: "
                        "set model.framework: tensorflow")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model {name!r} returned {type(model).__name__}, not a torch.nn.Module")
    for key, tensor in model.state_dict(keep_vars=True).items():
        if tensor.is_floating_point() and tensor.dtype != torch.float32:
            raise TypeError(f"model {name!r}: {key} is {tensor.dtype}; the wire carries float32 only "
                            "(build it in float32)")
    for module_name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.momentum is None:
            raise ValueError(f"model {name!r}: BatchNorm {module_name or '(root)'} has momentum=None (a cumulative "
                             "average over num_batches_tracked, which the PS does not carry); give it a momentum")
    return model
