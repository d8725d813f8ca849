"""Which cores the roles of a one-host run (``switchps run``'s local backend) run on, and at which priority.

On one host, the PS's event loop is on every push's path, and the workers compete with it for the
cores. Measured at 784k parameters, 2 workers on 2 cores: about a fifth of the CPU time sat idle while
runnable threads queued for a core (``/proc/*/schedstat``); the kernel moves workers between cores, and
can run a worker the PS has just answered ahead of the PS's own unfinished work. So the launcher gives
each worker its own block of ``intra_op_threads`` cores (one more with ``runtime.pipeline_depth`` 1, for
the thread that pushes while the worker computes) when all the blocks fit on the cores it may use
(no worker then shares a core with another, and its data stays in that core's caches), and makes the
workers and the evaluator ``worker_nice`` nicer than the PS, so that the PS runs first when both are
ready. The PS itself floats at the default priority. Workers that do not fit one per block float too:
a pinned worker could not move off a core that two workers share.

The launcher hands a role its ``CpuBinding`` in the environment (``ENV``, JSON); the role applies it
first thing (``apply_env``), before it starts a thread: Linux keeps the affinity and the niceness per
thread, and a thread starts with its creator's.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pydantic import Field

from switchps.config.schema import Section

ENV = "SWITCHPS_CPU_BINDING"
MAX_NICE = 19
"""Linux's lowest priority: a process may raise its niceness up to it without privileges."""
log = logging.getLogger("switchps")


class CpuBindingSpec(Section):
    pin_workers: bool = True
    """A one-host run: each worker on ``intra_op_threads`` cores of its own, when all fit (else they float)."""
    worker_nice: int = Field(5, ge=0, le=MAX_NICE)
    """A one-host run: workers and the evaluator run this much nicer than the PS (0: the same priority)."""


@dataclass(frozen=True)
class CpuBinding:
    """A role's cores (empty: any the launcher may use) and how much nicer than the launcher it runs."""

    cores: tuple[int, ...] = ()
    nice: int = 0

    def to_env(self) -> str:
        return json.dumps({"cores": list(self.cores), "nice": self.nice})

    @classmethod
    def from_env(cls, text: str) -> "CpuBinding":
        """``ValueError`` for anything ``to_env`` does not write."""
        try:
            raw = json.loads(text)
        except ValueError:
            raw = None
        cores, nice = (raw.get("cores"), raw.get("nice")) if isinstance(raw, dict) else (None, None)
        if not (isinstance(raw, dict) and set(raw) == {"cores", "nice"} and isinstance(cores, list)
                and all(type(c) is int and c >= 0 for c in cores) and type(nice) is int and 0 <= nice <= MAX_NICE):
            raise ValueError(f"{ENV} is not a CPU binding: {text[:80]!r}")
        return cls(tuple(cores), nice)

    def apply(self) -> None:
        """Pin the calling thread (and every thread it starts later) to ``cores``, and lower its priority."""
        if self.cores:
            try:
                os.sched_setaffinity(0, self.cores)
            except OSError as e:  # a core the process may no longer use: it floats
                log.warning("cannot pin to cores %s (%s): running on any core", list(self.cores), e)
        if self.nice:
            os.nice(self.nice)


def local_bindings(workers: int, threads: int, spec: CpuBindingSpec,
                   cores: Sequence[int]) -> dict[str, CpuBinding]:
    """Each role's binding by its name (``worker-<i>``, ``evaluator``; the PS has none), given the
    ``cores`` the launcher may use: worker i gets the i-th block of ``threads`` of them if all
    ``workers`` blocks fit."""
    pin = spec.pin_workers and workers * threads <= len(cores)
    ordered = sorted(cores)
    bindings = {f"worker-{i}": CpuBinding(tuple(ordered[i * threads:(i + 1) * threads]) if pin else (),
                                          spec.worker_nice) for i in range(workers)}
    bindings["evaluator"] = CpuBinding((), spec.worker_nice)
    return bindings


def apply_env(env: Mapping[str, str] = os.environ) -> CpuBinding | None:
    """Apply the binding the launcher gave this process, if any; returns it."""
    text = env.get(ENV)
    if not text:
        return None
    binding = CpuBinding.from_env(text)
    binding.apply()
    return binding
