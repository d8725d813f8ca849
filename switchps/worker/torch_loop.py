"""Your own PyTorch training loop as a switchps worker, in five lines::

    from switchps.worker.torch_loop import join

    ps = join("run.yaml", worker=rank, model=model)   # register (the first sends its values), pull them into model
    while not ps.stop:                                 # until a work order says stop
        for x, y in ps.batches(loader):                # micro-batches until the order's sample or time budget ends
            F.cross_entropy(model(x), y, reduction="sum").backward()   # Σ per-sample gradients in p.grad
        ps.step()                                      # push Σg with b, load the reply's values, clear p.grad

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
next work order: ``ps.stop`` turns true, the model holds the final values, and the PS writes
``summary.json`` and exits after ``eval.final_timeout_s`` unless an evaluator (``switchps evaluator
run.yaml``, for a model the config builds) reported a final evaluation.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from switchps.config.run import ConfigError, load_config
from switchps.worker.session import Batches, Session
from switchps.worker.steps import Budget
from switchps.workload.data import configured_dataset, share_size
from switchps.workload.torch.weights import FlatParams, copy_all, host_tensor


class LocalStepsRefused(RuntimeError):
    """A work order asks for local steps (``protocol.local_steps``), which a user's own loop does not take."""


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
        self._load(session.pull(self.values).values)
        model.zero_grad(set_to_none=True)

    @property
    def stop(self) -> bool:
        """Whether the PS has ended the run."""
        return self.session.order.stop

    @property
    def steps(self) -> int:
        """The steps pushed so far."""
        return self.session.step

    def batches(self, loader: Iterable[Any]) -> Iterator[Any]:
        """This step's micro-batches from ``loader`` (its batches cut to the work order's micro-batch and
        sample budget; under AMB, they end when the time budget does, after at least one). An order for local
        steps cannot be obeyed here: it raises ``LocalStepsRefused``."""
        order = self.session.order
        if order.HasField("local"):
            raise LocalStepsRefused(
                f"the PS's work order asks for local steps (protocol {order.protocol!r} with protocol.local_steps "
                f"{order.local.steps}): a worker takes {order.local.steps} steps with its own inner optimizer, "
                "then pushes what its model moved, and a loop of your own (switchps.worker.torch_loop) pushes "
                "gradients; run switchps workers (switchps worker/run) for local SGD and DiLoCo, or a protocol "
                "without local_steps")
        if self._batches is None or self._batches.loader is not loader:
            self._batches = Batches(loader)
        self._budget = Budget.of(self.session.order, self.session.received_at)
        return self._batches.step(self._budget, self.session.clock)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, with ``loss`` (summed over the micro-batch) added to the step's training loss."""
        loss.backward()
        self._loss = self._loss + loss.detach()

    def step(self) -> None:
        """Push this step's Σ gradient (the parameters' ``grad``) with its sample count and the float buffers;
        load the reply's values into the model and clear the gradients."""
        if self.stop:
            raise RuntimeError("the run has ended (ps.stop): nothing to push")
        done = self._budget.done
        if not done:
            raise RuntimeError("ps.step() before any micro-batch of ps.batches(loader)")
        payload = self.session.payload_area
        if payload is None or payload.size != self.flat.size or payload.dtype != np.float32:  # narrowed by the client
            if self._payload is None:
                self._payload = np.empty(self.flat.size, np.float32)
            payload = self._payload
        self._gather(payload)
        assert self._batches is not None  # it handed out the samples counted
        exhausted = self._budget.exhausted(self.session.clock.now())
        reply = self.session.push(payload, done, self.values, compute_s=self._batches.compute_s,
                                  loss_sum=float(self._loss), batch_exhausted=exhausted)
        if reply.fresh:
            self._load(reply.values)
        self._budget, self._loss = Budget(0, 1, 0.0), 0.0
        self.model.zero_grad(set_to_none=True)
        if self.stop:
            self.session.close()

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

    def _load(self, values: np.ndarray) -> None:
        """The model's parameters and float buffers from a flat vector."""
        if self._staging is None:
            self.flat.assign(values)
            return
        with torch.no_grad():
            self._staging.copy_(host_tensor(values))
            copy_all([t.detach() for t in self.flat.tensors], self.flat.views(self._staging))


def join(config: str | os.PathLike[str], worker: int, model: nn.Module, *, samples: int | None = None,
         sets: Sequence[str] = ()) -> Worker:
    """Join the run ``config`` (a YAML file; ``sets``: ``--set`` overrides) as worker ``worker`` training
    ``model``; returns once the model holds the PS's values (the first worker to register sends its own).

    ``samples`` is this worker's share of the training set, what ``train.epochs`` counts (default: its
    share of the config's ``data``, as a switchps worker registers).
    """
    cfg = load_config(config, sets, role="worker")
    if not 0 <= worker < cfg.cluster.num_workers:
        raise ConfigError(f"worker {worker} outside [0, {cfg.cluster.num_workers}) (cluster.workers)")
    if samples is None:
        samples = share_size(len(configured_dataset(cfg).x_train), worker, cfg.cluster.num_workers)
    flat = FlatParams(model)
    device = str(next(model.parameters()).device)
    session = Session(cfg, worker, flat.layout(), flat.size, samples, flat.read, framework="torch", device=device)
    return Worker(session, model, flat)
