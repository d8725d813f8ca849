"""The seam between the roles and a deep-learning framework: a worker, the evaluator, ``switchps export``
and the simulator ask the run's framework (``model.framework``) for the same six things, and never
import TensorFlow or PyTorch themselves. Each framework's package is imported only when a role asks
for it (``framework(name)``): the PS and the launcher load neither.

Whatever the framework, the wire sees one flat float32 vector per model: the trainable parameters in a
fixed order, then the float32 state a training step advances (BatchNorm's running statistics), named
and shaped by the layout (``protos.layout``), whose digest the PS checks at registration.
"""

from __future__ import annotations

from importlib import import_module
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np

from switchps.config.run import RunConfig
from switchps.protos import switchps_pb2 as pb
from switchps.workload.data import Dataset

FRAMEWORKS = ("tensorflow", "torch")


class Weights(Protocol):
    """A model's parameters and state as the flat float32 vector that crosses the wire."""

    size: int
    trainable_size: int
    """The trainable parameters lead the vector; the state follows them."""

    def layout(self) -> pb.Layout: ...

    def read(self) -> np.ndarray: ...

    def assign(self, flat: np.ndarray) -> None: ...


class Computer(Protocol):
    """Σ per-sample gradients of the summed cross-entropy over a worker's samples, named by row; see the
    TF ``GradientComputer`` for the contract every framework keeps."""

    samples: int
    size: int
    payload_to: np.ndarray | None

    @property
    def device(self) -> object:
        """Where it computes; its ``str`` (cpu, cuda:K) is what the worker tells the PS at registration."""

    @property
    def weights(self) -> Weights: ...

    def warm_up(self, batch: int, micro_batch: int) -> None: ...

    def compute(self, rows: np.ndarray, micro_batch: int) -> tuple[np.ndarray, float]: ...

    def accumulate(self, rows: np.ndarray) -> None: ...

    def finish(self) -> tuple[np.ndarray, float]: ...

    def losses(self, rows: np.ndarray) -> np.ndarray: ...

    def assign(self, flat: np.ndarray) -> None: ...

    def stage(self, flat: np.ndarray) -> None: ...

    def settle(self) -> bool:
        """Wait until the values last staged (if any) have left their host vector, where the computer copies
        them away (a GPU's upload): True, the caller may rewrite that vector; False, always, where the
        computer reads them in place, so the caller keeps them until it stages another."""
        ...

    def buffer(self) -> np.ndarray: ...

    def read(self) -> np.ndarray: ...

    def close(self) -> None:
        """Release what the computer holds beyond memory (a GPU's page-locked registrations)."""
        ...


class Framework(Protocol):
    """What the roles need of a framework."""

    name: str
    model_suffix: str
    """The final model file's suffix (``model`` + it, in the run directory)."""

    def prepare(self, cfg: RunConfig, worker: int = 0) -> tuple[Dataset, Any]:
        """The run's dataset and its model, built from the seed on the role's device, threads limited."""

    def computer(self, cfg: RunConfig, model: Any, x: np.ndarray, y: np.ndarray) -> Computer:
        """A gradient computer over the samples ``x``/``y`` (held on the model's device from now on)."""

    def weights(self, model: Any) -> Weights: ...

    def scorer(self, model: Any, data: Dataset) -> Callable[[], tuple[float, float]]:
        """Test loss and accuracy of the model's current values on ``data``'s test split."""

    def save(self, model: Any, path: Path) -> Path:
        """Write the model's file(s) at ``path`` (its suffix: ``model_suffix``) atomically; the main file."""


def framework(name: str) -> Framework:
    """The framework ``name`` (one of ``FRAMEWORKS``), its package imported now."""
    if name not in FRAMEWORKS:
        raise ValueError(f"unknown framework {name!r}; expected one of {', '.join(FRAMEWORKS)}")
    found: Framework = import_module(f"switchps.workload.{name}.role").FRAMEWORK
    return found
