"""What is trained: the model and the dataset. Whether they build is asked of the command's checks."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from switchps import names
from switchps.config.schema import Section, checks_of, one_of, role_of
from switchps.problems import Problems


class ModelSpec(Section):
    framework: Literal["tensorflow", "torch"] = "tensorflow"
    """Which framework the workers, the evaluator and the simulator compute with (Keras models, or PyTorch
    `nn.Module`s); the PS is the same for both."""
    name: str = "mlp"
    """A zoo name (logreg, mlp, cnn, resnet20, resnet32; torch also resnet18, CIFAR stem) or an import
    path `module:function` returning the framework's model (a module in the working directory is found
    without PYTHONPATH)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Passed to the builder; checked against its signature."""
    state_dict: str | None = None
    """torch: a `state_dict` file (`torch.save`, or `.safetensors`) loaded into the built model, strictly,
    before the first push: training starts from it (fine-tuning)."""

    @model_validator(mode="after")
    def _builds(self, info: ValidationInfo) -> "ModelSpec":
        if self.state_dict is not None and self.framework != "torch":
            raise Problems([("state_dict", "is for model.framework torch; a TensorFlow model starts from "
                                           "its seed")])
        if (checks := checks_of(info)) and (problems := checks.model(self.framework, self.name, self.kwargs, role_of(info))):
            raise Problems(problems)
        return self


class DataSpec(Section):
    name: str = "digits"
    """One of ``switchps.names.DATASETS``."""
    path: str | None = None
    test_fraction: float = Field(0.2, gt=0, lt=1)
    seed: int | None = Field(None, ge=0)
    """The seed of the data's split (digits, npz) and generation (synthetic); default the run's ``seed``. A
    study that repeats arms over seeds fixes it to vary only the model's start and the sampling order."""
    num_samples: int = Field(10000, gt=0, le=10**7)
    """synthetic (generated in memory): at most 10**7 samples, and 10**4 features and classes."""
    num_features: int = Field(20, gt=0, le=10**4)
    num_classes: int = Field(10, gt=1, le=10**4)
    informative: int | None = Field(None, gt=0, le=10**4)
    """synthetic: how many features carry the class (make_classification's informative ones; default
    min(num_features, 10)); the rest are 2 redundant combinations of them and noise."""
    class_sep: float = Field(1.0, gt=0, le=100)
    """synthetic: how far apart the classes' clusters lie (make_classification's class_sep): larger is easier."""
    shape: list[int] | None = Field(None, min_length=1, max_length=3)
    """synthetic: each sample's features as an array of this shape, e.g. [32, 32, 3] for a CIFAR-shaped task
    (image models read (H, W, C) as an image); num_features is then their product."""
    sampling: Literal["partition", "replacement"] = "partition"
    """partition: worker i draws reshuffled epochs of every N-th sample; replacement: each worker draws
    from the whole training set with replacement (seeded per worker), for more workers than a partition
    of the data can feed (1,024 workers on digits)."""

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        return one_of(v, names.DATASETS, "dataset")

    @model_validator(mode="after")
    def _files(self, info: ValidationInfo) -> "DataSpec":
        """npz needs a path; processes that load the data need its files, checked before anything starts."""
        if self.name == "npz" and not self.path:
            raise ValueError("path is required when name is npz")
        if self.shape is not None:
            if self.name != "synthetic" or min(self.shape) < 1:
                raise ValueError("shape: positive sizes, for name synthetic only")
            if "num_features" in self.model_fields_set and self.num_features != math.prod(self.shape):
                raise ValueError(f"num_features {self.num_features} is not the product of shape {self.shape}; "
                                 "give one of them")
            self.num_features = math.prod(self.shape)
        if self.informative is not None and self.informative > self.num_features:
            raise ValueError(f"informative {self.informative} is more than num_features {self.num_features}")
        informative = informative_features(self.num_features, self.informative)
        if self.name == "synthetic" and self.num_classes > 2**informative:
            raise ValueError(f"{self.num_classes} classes need more than {informative} informative features "
                             "(at most 2**informative classes)")
        if (checks := checks_of(info)) and (problems := checks.data(self.name, self.path, role_of(info))):
            raise Problems(problems)
        return self


def informative_features(num_features: int, informative: int | None) -> int:
    """How many of synthetic data's features carry the class: ``data.informative``, by default
    min(num_features, 10)."""
    return min(num_features, 10) if informative is None else informative
