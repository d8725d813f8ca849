"""What a simulated step's samples are worth to the model: a ``Learner`` holds the parameters, scores steps
and sums their gradients. ``TimeOnly`` has no model at all (a model of size 0: every update is the
store's rule over empty arrays, so the optimizer still counts updates and learning rates); the real one
is ``gradients.Real``, kept in its own module so that a time-only run never imports TensorFlow."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from switchps.sim.workers import Work


@dataclass(frozen=True)
class Score:
    """An evaluation of one version on the test set (``runs.Score``)."""

    version: int
    test_loss: float
    test_accuracy: float


class Learner(Protocol):
    """The model's side of a simulation; ``values`` (trainable parameters first, then state) are what the
    driver's update rule changes, ``trainable`` how many of them the optimizer steps."""

    values: np.ndarray
    trainable: int

    def sent(self, version: int) -> None:
        """``version``'s parameters left for a worker (a pull or a reply): keep that version until the step
        they start is applied or dropped (the newer versions applied while they cross do not free it)."""

    def started(self, work: Work) -> None:
        """A step began on ``work.version`` (which ``sent`` kept)."""

    def loss(self, work: Work) -> float:
        """The step's summed loss (needed when it pushes)."""

    def gradient(self, works: list[Work]) -> np.ndarray:
        """The sum of the steps' gradients, then the sum of their workers' state: an aggregate's sum."""

    def done(self, work: Work) -> None:
        """The step's push was applied or dropped: its version may go."""

    def lost(self, work: Work) -> None:
        """The step never pushes (its worker departed while computing it): forget it; its version may go."""

    def unused(self, version: int) -> None:
        """``version``'s parameters, ``sent`` to a worker, started no step (it departed): the version may go."""

    def applied(self, version: int) -> None:
        """``values`` now hold ``version``, the newest."""

    def evaluate(self, version: int) -> Score | None:
        """``version`` (the newest) on the test set; None without a model."""


class TimeOnly:
    """No model, no data, no TensorFlow: every loss is 0 and every gradient empty."""

    def __init__(self) -> None:
        self.values = np.empty(0, np.float32)
        self.trainable = 0

    def sent(self, version: int) -> None:
        pass

    def started(self, work: Work) -> None:
        pass

    def loss(self, work: Work) -> float:
        return 0.0

    def gradient(self, works: list[Work]) -> np.ndarray:
        return np.empty(0, np.float32)

    def done(self, work: Work) -> None:
        pass

    def lost(self, work: Work) -> None:
        pass

    def unused(self, version: int) -> None:
        pass

    def applied(self, version: int) -> None:
        pass

    def evaluate(self, version: int) -> Score | None:
        return None
