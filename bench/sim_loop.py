"""Events per second of the simulator's event loop (``switchps.sim.loop.Loop``, a heap of timed callbacks)
against SimPy's environment doing the same work, if SimPy is importable (it is not a dependency).

The work is the simulator's shape: N workers, each repeatedly busy for a random time and then scheduling
its next step; every event is one worker finishing a step. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, Iterator

import numpy as np

from switchps.sim.loop import Loop


def heap_loop(durations: np.ndarray) -> float:
    """Seconds to run ``durations.size`` step ends on ``Loop``; ``durations[w]`` are worker w's steps."""
    loop, steps = Loop(), durations.shape[1]
    left = [iter(durations[w].tolist()) for w in range(durations.shape[0])]

    def step_done(w: int) -> None:
        d = next(left[w], None)
        if d is not None:
            loop.at(loop.now + d, step_done, w)

    t0 = time.perf_counter()
    for w in range(durations.shape[0]):
        step_done(w)
    while loop.run(10_000):
        pass
    assert loop.events == durations.shape[0] * steps
    return time.perf_counter() - t0


def simpy_loop(durations: np.ndarray) -> float | None:
    """The same on SimPy: one process per worker yielding timeouts; None without SimPy."""
    try:
        import simpy  # type: ignore[import-not-found]
    except ImportError:
        return None
    env = simpy.Environment()

    def worker(steps: list[float]) -> Iterator[Any]:
        for d in steps:
            yield env.timeout(d)

    t0 = time.perf_counter()
    for w in range(durations.shape[0]):
        env.process(worker(durations[w].tolist()))
    env.run()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=1024)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3, help="the best of this many runs counts")
    args = p.parse_args()
    durations = np.random.default_rng(0).exponential(1.0, (args.workers, args.steps))
    events = durations.size
    out: dict[str, Any] = {"workers": args.workers, "steps": args.steps, "events": events}
    for name, run in (("heap", heap_loop), ("simpy", simpy_loop)):
        times = [run(durations) for _ in range(args.repeats)]
        best = None if times[0] is None else min(t for t in times if t is not None)
        out[f"{name}_events_per_s"] = None if best is None else round(events / best)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
