"""Real losses and gradients for simulated steps, with the worker's own gradient computer (either
framework's, ``workload.frameworks``), lazily and batched by base version (a time-only run never builds one).

A step only draws its sample rows; its worth is computed when it is needed, at the parameters of the
version it started on, which are kept until no step refers to them:
- its summed loss when it pushes (the core and ``workers.csv`` read it): one forward pass over every
  step started on that version and not yet scored, split per step by segment sums;
- the gradient of an aggregate when the core applies it: the sum of the gradients of pushes with the same
  base version is the gradient of their summed loss over their concatenated samples, so one backward
  pass per (aggregate, base version) — a BSP round is one call, an ASP update one small call;
- a step alone on its version (as under ASP, where every update is a version) is scored by the call
  that computes its gradient too, kept until its push is applied or dropped: one call, not two.

The non-trainable state (BatchNorm statistics) a batched call leaves is taken as each of its steps'
state: the update's state is then the mean over its versions' calls, weighted by their pushes.

A push of local steps (``Work.local``) cannot be batched with others: each worker's trajectory is its own.
When it pushes, its local steps run one after another from its base version (``local_trajectory``: one
call and one step of the worker's inner optimizer each, kept per worker across rounds unless the order
resets it), and its payload, ``samples x (start - end)`` over the trainable part then the state it ended
with (``moved``), is kept as its ``grad`` until the push is applied or dropped.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from itertools import groupby

from typing import Callable

import numpy as np

from switchps.config.run import RunConfig
from switchps.protos.layout import variable_sizes
from switchps.sim.learner import Score
from switchps.sim.workers import Work
from switchps.worker.local_steps import Inner, moved
from switchps.workload.data import Dataset
from switchps.workload.frameworks import Computer, framework

def real_learner(cfg: RunConfig) -> Real:
    """The run's model, built by its framework, over the whole training set."""
    fw = framework(cfg.model.framework)
    data, model = fw.prepare(cfg)
    return Real(fw.computer(cfg, model, data.x_train, data.y_train), fw.scorer(model, data), data)


def local_trajectory(gc: Computer, inner: Inner, theta: np.ndarray, batches: np.ndarray) -> tuple[float, ...]:
    """Local steps from ``theta`` (trainable parameters, then state; moved in place), as a worker takes them
    (``worker.local_steps``): per row of ``batches``, the Σ gradient over its samples at ``theta``, then one
    step of ``inner``; the state becomes what the call left. Each local step's summed loss. ``theta`` should be
    ``gc.buffer()``'s (read in place)."""
    n, losses = inner.trainable, []
    for rows in batches:
        gc.stage(theta)
        grad, loss = gc.compute(rows, len(rows))
        inner.step(theta, grad, len(rows))
        theta[n:] = grad[n:]
        losses.append(loss)
    return tuple(losses)


CALL_BYTES = 64 * 2**20
"""Input bytes per batched call: larger groups are computed in several (the same sums)."""


class Real:
    """The model's parameters per referenced version, and the steps' losses and gradients at them."""

    def __init__(self, gc: Computer, evaluator: Callable[[], tuple[float, float]], data: Dataset) -> None:
        self.gc = gc  # over the whole training set
        self.values = self.gc.weights.read().copy()
        self.trainable = self.gc.weights.trainable_size
        self.variables = variable_sizes(self.gc.weights.layout())  # the inner optimizers' clipping boundaries
        self.evaluator = evaluator
        self.rows_per_call = max(1, CALL_BYTES // (4 * math.prod(data.input_shape)))
        self.latest = 0
        self.params: dict[int, np.ndarray] = {0: self.values.copy()}
        self.refs: Counter[int] = Counter()
        self.unscored: dict[int, list[Work]] = defaultdict(list)
        self._loaded: int | None = None  # the version in the model, if no call has changed it since
        self._stateless = self.gc.weights.size == self.trainable  # a training call changes no variable but the ones we set
        self.inner: dict[int, Inner] = {}  # per worker, its inner optimizer
        self._theta = self.gc.buffer()  # a local trajectory's values (read by the computer in place)
        self._grad = np.empty(self.values.size, np.float32)  # a local step's gradient (the optimizer's scratch)

    def sent(self, version: int) -> None:
        self.refs[version] += 1

    def started(self, work: Work) -> None:
        if work.local is None:  # a local trajectory is scored when it runs
            self.unscored[work.version].append(work)

    def loss(self, work: Work) -> float:
        if work.loss_sum is None:
            self._local(work) if work.local is not None else self._score(work.version)
        assert work.loss_sum is not None
        return work.loss_sum

    def _local(self, work: Work) -> None:
        """Run ``work``'s local steps from its base version: its losses, and its payload as its ``grad``."""
        assert work.local is not None
        inner = self.inner.setdefault(work.worker, Inner(self.trainable, self.variables))
        inner.begin(work.local.inner, work.local.reset)
        start, theta = self.params[work.version], self._theta
        np.copyto(theta, start)
        payload_to, self.gc.payload_to = self.gc.payload_to, self._grad
        try:
            losses = local_trajectory(self.gc, inner, theta, work.rows.reshape(work.local_steps, -1))
        finally:
            self.gc.payload_to = payload_to
        self._loaded = None  # the model runs at the trajectory's end now
        work.grad = moved(start, theta, work.samples, self.trainable, np.empty_like(theta))
        work.local_losses = losses
        work.loss_sum = math.fsum(losses)

    def _score(self, version: int) -> None:
        """Score every step started on ``version`` and not scored yet: one forward pass, summed by step
        (a step alone: its gradient too, in the same call)."""
        group = self.unscored.pop(version)
        self._load(version)
        if len(group) == 1 and len(group[0].rows) <= self.rows_per_call:
            w = group[0]
            flat, loss = self.gc.compute(w.rows, len(w.rows))
            self._used()
            w.grad, w.loss_sum = flat, loss
            return
        rows = np.concatenate([w.rows for w in group])
        losses = np.concatenate([self.gc.losses(r) for r in self._calls(rows)])
        self._used()
        starts = np.cumsum([0] + [len(w.rows) for w in group[:-1]])
        for w, total in zip(group, np.add.reduceat(losses.astype(np.float64), starts)):
            w.loss_sum = float(total)

    def gradient(self, works: list[Work]) -> np.ndarray:
        total = np.zeros(self.values.size, np.float32)
        n = self.trainable
        for version, same in groupby(sorted(works, key=lambda w: w.version), key=lambda w: w.version):
            group = []
            for w in same:  # a payload computed already: a local-steps push, or a gradient scored alone
                if w.grad is not None:
                    total += w.grad
                else:
                    group.append(w)
            if not group:
                continue
            rows = np.concatenate([w.rows for w in group])
            self._load(version)
            for r in self._calls(rows):
                flat, _ = self.gc.compute(r, len(r))
                total[:n] += flat[:n]
            total[n:] += flat[n:] * np.float32(len(group))
            self._used()
        return total

    def done(self, work: Work) -> None:
        work.grad = None
        self.unused(work.version)

    def lost(self, work: Work) -> None:
        group = self.unscored.get(work.version, [])
        if work in group:  # by identity (``Work`` compares so)
            group.remove(work)
            if not group:
                del self.unscored[work.version]
        self.done(work)

    def unused(self, version: int) -> None:
        self.refs[version] -= 1
        if self.refs[version] == 0:
            del self.refs[version]
            if version != self.latest:
                del self.params[version]

    def applied(self, version: int) -> None:
        old, self.latest = self.latest, version
        self.params[version] = self.values.copy()
        if old not in self.refs:
            del self.params[old]

    def evaluate(self, version: int) -> Score:
        self._load(version)
        loss, accuracy = self.evaluator()
        return Score(version, loss, accuracy)

    def _calls(self, rows: np.ndarray) -> list[np.ndarray]:
        return [rows[i:i + self.rows_per_call] for i in range(0, len(rows), self.rows_per_call)]

    def _load(self, version: int) -> None:
        if self._loaded != version:
            self.gc.assign(self.params[version])
            self._loaded = version

    def _used(self) -> None:
        """A training call ran: with state (BatchNorm's statistics), the model no longer holds a version."""
        if not self._stateless:
            self._loaded = None
