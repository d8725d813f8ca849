"""Your own PyTorch training loop as a switchps worker, in five lines::

    from switchps.worker.torch_loop import join

    ps = join("run.yaml", worker=rank, model=model)   # register (the first sends its values), pull them into model
    while not ps.stop:                                 # until a work order says stop
        for x, y in ps.batches(loader):                # micro-batches until the order's sample or time budget ends
            F.cross_entropy(model(x), y, reduction="sum").backward()   # Σ per-sample gradients in p.grad
        ps.step()                                      # push Σg with b, load the reply's values, clear p.grad
                                                       # (under local steps: a local step; every H-th pushes)

The PS holds the optimizer, as BytePS's ``DistributedOptimizer`` holds the reduction and hivemind's
``Optimizer`` the global batch: there is no local ``optimizer.step()``. The gradient pushed is the sum over
the step's samples, not their mean (``reduction="sum"``), because the protocols weigh each push by its
sample count b; ``ps.backward(loss)`` does ``loss.backward()`` and also reports the loss (``workers.csv``,
policies that read the training loss). The wire layout is ``FlatParams``': the parameters that require
grad, then the float32 buffers (BatchNorm's running statistics, pushed as the worker's state).

How a run goes. The user starts the PS, ``switchps ps run.yaml`` (it writes the run's record, as in any
run, to its run directory), then one process per worker, each calling ``join`` with its own index in
``[0, cluster.workers)``: it reads ``cluster.ps`` and ``security`` from the same YAML as ``switchps
worker`` does, and pushes through shared memory when the PS is on its host. Training starts once every
worker has joined. The PS ends the run (``train.steps``, ``epochs`` or ``seconds``) with a stop in the
next work order: ``ps.stop`` turns true, the model holds the run's final values (the stop's reply brings
them), and the PS writes ``summary.json`` and exits after ``eval.final_timeout_s`` unless an evaluator
(``switchps evaluator run.yaml``, for a model the config builds) reported a final evaluation.

Local steps (local SGD, DiLoCo, their asynchronous forms, anytime local SGD: an order whose ``local`` is set)
need no change to the loop. ``ps.batches(loader)`` then yields one local step's micro-batches (the order's
``local.batch`` samples), and ``ps.step()`` applies the order's inner optimizer to a private float32 copy θ
of the round's start values, loads θ into the model and clears the gradients; only the call that ends the
round pushes, ``samples * (θ_start - θ_end)`` over the trainable part then the buffers, as a switchps worker
does (``worker.local_steps``). So under local orders ``ps.step()`` pushes every H-th call (``ps.steps``
counts pushes), or, under a time budget T, the first call after T ended (at least one local step, at most
H). The reply's values are loaded (a reply without values: the PS is still at the round's start values), and
its order may be another round or, after a live switch, a gradient step. The inner optimizer's state
persists across rounds unless the order resets it. The inner step runs on the host: on a GPU each local
step copies the gradient down and θ up once (the current cost).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from switchps.config.optimizer import OptimizerSpec
from switchps.config.run import ConfigError, load_config
from switchps.protos.codec import COPIES
from switchps.protos.layout import variable_sizes
from switchps.worker.local_steps import Inner, Taken, local_stats, moved
from switchps.worker.session import Batches, Session
from switchps.worker.steps import Budget
from switchps.workload.data import configured_dataset, registered_size
from switchps.workload.torch.weights import FlatParams, copy_all, host_tensor


@dataclass
class OpenRound:
    """A round of local steps in progress: where its start values are (a reply's, which nothing rewrites
    until the round's push), when its time budget ends, and what its local steps took."""

    start: np.ndarray
    end: float
    taken: Taken = field(default_factory=Taken)


class Worker:
    """One worker of a run, training ``model`` (on one device) in the caller's loop; made by ``join``, it
    starts from the PS's values."""

    def __init__(self, session: Session, model: nn.Module, flat: FlatParams) -> None:
        self.session, self.model, self.flat = session, model, flat
        self.values = np.empty(flat.size, np.float32)
        """Where replies' values land when they do not come through shared memory."""
        self._payload: np.ndarray | None = None  # where a payload is gathered when not in shared memory
        device = flat.tensors[0].device if flat.tensors else torch.device("cpu")
        self._staging = None if device.type == "cpu" else torch.empty(flat.size, device=device)
        """On a GPU, the flat vector on the device: one copy each way per step, as ``TorchComputer``'s."""
        self._budget = Budget(0, 1, 0.0)
        self._batches: Batches | None = None
        self._loss: torch.Tensor | float = 0.0
        self._inner = Inner(flat.trainable_size, variable_sizes(flat.layout()))
        """The inner optimizer of local steps, across rounds."""
        self._round: OpenRound | None = None
        self._theta: np.ndarray | None = None  # a round's θ, moved by its local steps
        self._pulled = self._load(session.pull(self.values).values)
        """Where the values the PS last sent (those the model holds between rounds) are."""
        model.zero_grad(set_to_none=True)

    @property
    def stop(self) -> bool:
        """Whether the PS has ended the run."""
        return self.session.order.stop

    def leave(self) -> None:
        """Tell the PS this worker ends before the run does (a preemption's notice, a scale-down): an elastic
        run counts it gone at once, a fixed-size one stops waiting for it until it pushes again. Push nothing
        after it."""
        self.session.leave()

    @property
    def steps(self) -> int:
        """The steps pushed so far (under local orders, rounds: one push each)."""
        return self.session.step

    def batches(self, loader: Iterable[Any]) -> Iterator[Any]:
        """This step's micro-batches from ``loader`` (its batches cut to the work order's micro-batch and
        sample budget; under AMB, they end when the time budget does, after at least one). Under an order
        for local steps, one local step's: ``local.batch`` samples."""
        if self._batches is None or self._batches.loader is not loader:
            self._batches = Batches(loader)
        order = self.session.order
        if order.HasField("local"):
            self._budget = Budget(order.local.batch, order.micro_batch, math.inf)
        else:
            self._budget = Budget.of(order, self.session.received_at)
        return self._batches.step(self._budget, self.session.clock)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, with ``loss`` (summed over the micro-batch) added to the step's training loss."""
        loss.backward()
        self._loss = self._loss + loss.detach()

    def step(self) -> None:
        """Push this step's Σ gradient (the parameters' ``grad``) with its sample count and the float buffers;
        load the reply's values into the model and clear the gradients. Under an order for local steps,
        take a local step, and push only when it ends the round (see the module's docstring)."""
        if self.stop:
            raise RuntimeError("the run has ended (ps.stop): nothing to push")
        if not self._budget.done:
            raise RuntimeError("ps.step() before any micro-batch of ps.batches(loader)")
        assert self._batches is not None  # it handed out the samples counted
        if self.session.order.HasField("local"):
            self._local_step()
        else:
            area = self._area()
            payload = self._scratch() if area is None else area
            self._gather(payload)
            exhausted = self._budget.exhausted(self.session.clock.now())
            self._push(payload, self._budget.done, None, compute_s=self._batches.compute_s,
                       loss_sum=float(self._loss), batch_exhausted=exhausted)
        self._budget, self._loss = Budget(0, 1, 0.0), 0.0
        self.model.zero_grad(set_to_none=True)
        if self.stop:
            self.session.close()

    def _local_step(self) -> None:
        """One local step by the inner optimizer on θ (the round begun from the values pulled if none is in
        progress), the model loaded with θ; when the round ends (``Taken.more``), its push."""
        order, clock = self.session.order, self.session.clock
        if self._round is None:
            self._round = OpenRound(self._pulled, Budget.of(order, self.session.received_at).end)
            self._inner.begin(OptimizerSpec.model_validate_json(order.local.inner_optimizer),
                              order.local.reset_inner_state)
            self._theta = self._theta if self._theta is not None else np.empty(self.flat.size, np.float32)
            np.copyto(self._theta, self._pulled)
            COPIES.add(self._theta.nbytes)  # a round's one host copy, as ``LocalRunner``'s
        r, theta, n, grad = self._round, self._theta, self._inner.trainable, self._scratch()
        assert theta is not None and self._batches is not None
        self._gather(grad)
        self._inner.step(theta, grad, self._budget.done)
        theta[n:] = grad[n:]  # the state the step's forward passes left
        self._load(theta)
        r.taken.samples.append(self._budget.done)
        r.taken.loss_sums.append(float(self._loss))
        r.taken.compute_s += self._batches.compute_s
        if r.taken.more(order.local.steps, clock.now(), r.end):
            return
        self._round, samples = None, sum(r.taken.samples)
        area = self._area()
        self._push(moved(r.start, theta, samples, n, theta if area is None else area), samples, r.start,
                   **local_stats(r.taken))

    def _push(self, payload: np.ndarray, samples: int, back: np.ndarray | None, **stats: Any) -> None:
        """Push ``payload`` over ``samples`` with ``stats``; load the reply's values, or (``back``, if given
        and the reply brings none) the values the model ran at before."""
        reply = self.session.push(payload, samples, self.values, **stats)
        if reply.fresh:
            self._pulled = self._load(reply.values)
        elif back is not None:
            self._load(back)

    def _area(self) -> np.ndarray | None:
        """The session's payload area, if a float32 payload of the model's size is written there."""
        area = self.session.payload_area
        if area is None or area.size != self.flat.size or area.dtype != np.float32:  # narrowed by the client
            return None
        return area

    def _scratch(self) -> np.ndarray:
        """A private float32 vector of the model's size, made once: a gradient gathered when there is no
        payload area, a local step's gradient (the inner optimizer's scratch)."""
        if self._payload is None:
            self._payload = np.empty(self.flat.size, np.float32)
        return self._payload

    def _gather(self, out: np.ndarray) -> None:
        """The gradients (zeros where a parameter has none), then the float buffers, into ``out``: one pass
        (on a GPU, into the device vector, then one copy to the host)."""
        k = self.flat.count
        grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in self.flat.tensors[:k]]
        target = torch.from_numpy(out) if self._staging is None else self._staging
        with torch.no_grad():
            copy_all(self.flat.views(target), [*grads, *(t.detach() for t in self.flat.tensors[k:])])
            if self._staging is not None:
                torch.from_numpy(out).copy_(self._staging)

    def _load(self, values: np.ndarray) -> np.ndarray:
        """The model's parameters and float buffers from a flat vector; returns ``values``."""
        if self._staging is None:
            self.flat.assign(values)
            return values
        with torch.no_grad():
            self._staging.copy_(host_tensor(values))
            copy_all([t.detach() for t in self.flat.tensors], self.flat.views(self._staging))
        return values


def join(config: str | os.PathLike[str], worker: int, model: nn.Module, *, samples: int | None = None,
         sets: Sequence[str] = ()) -> Worker:
    """Join the run ``config`` (a YAML file; ``sets``: ``--set`` overrides) as worker ``worker`` training
    ``model``; returns once the model holds the PS's values (the first worker to register sends its own).

    ``samples`` is this worker's share of the training set, what ``train.epochs`` counts (default: its
    share of the config's ``data``, as a switchps worker registers).
    """
    cfg = load_config(config, sets, role="worker")
    if not 0 <= worker < cfg.cluster.max_workers:
        raise ConfigError(f"worker {worker} outside [0, {cfg.cluster.max_workers}) (cluster.workers)")
    if samples is None:
        samples = registered_size(len(configured_dataset(cfg).x_train), worker, cfg)
    flat = FlatParams(model)
    device = str(next(model.parameters()).device)
    session = Session(cfg, worker, flat.layout(), flat.size, samples, flat.read, framework="torch", device=device,
                      local_steps=True)
    return Worker(session, model, flat)
