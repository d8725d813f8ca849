"""Random draws that are a pure function of (seed, worker, stream, step).

A counter-based generator (Philox) keyed by ``(seed, worker, stream)`` with the step in its counter: a
step's draws never depend on which other steps, workers or streams drew before, so one kind of delay
never changes another's, a worker restarted mid-run draws what it would have drawn, and a simulation
draws what a real run does. The generator is positioned, not seeded, per step (3 us instead of 22: a
10,000-worker simulation draws a million times).
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np
import numpy.typing as npt

_NO_BUFFER = np.zeros(4, np.uint64)


class Stream(IntEnum):
    """One stream per kind of draw. Ids are nonzero: SeedSequence pads short keys with zeros, so a
    run-wide key ``(seed, stream)`` can never equal a per-worker key ``(seed, worker, stream)``."""

    MIXTURE = 1
    COMM = 2
    TRANSIENT = 3
    SHIFTED_EXP = 4
    PUSH_JITTER = 5


class StepRandom:
    """The generators of one run's seed: ``at(worker, stream, step)``. Not thread-safe (one generator
    is repositioned per call); give each thread its own."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._bits = np.random.Philox(0)
        self._gen = np.random.Generator(self._bits)
        self._keys: dict[tuple[int, int], npt.NDArray[np.uint64]] = {}  # (worker, stream) -> Philox key

    def at(self, worker: int, stream: Stream, step: int) -> np.random.Generator:
        """The generator of ``stream`` for ``worker`` at ``step``, valid until the next call: its key,
        with the step in the counter's second word (the first counts the blocks one step draws, so two
        steps' draws never overlap)."""
        key = self._keys.get((worker, stream))
        if key is None:
            words = np.random.SeedSequence([self.seed, worker, int(stream)]).generate_state(2, np.uint64)
            key = self._keys[(worker, stream)] = np.asarray(words, np.uint64)
        self._bits.state = {"bit_generator": "Philox", "state": {"counter": np.array([0, step, 0, 0], np.uint64),
                            "key": key}, "buffer": _NO_BUFFER, "buffer_pos": 4, "has_uint32": 0, "uinteger": 0}
        return self._gen
