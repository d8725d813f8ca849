"""A worker's membership of a run, whatever computes its gradients: join, the work order, push, the reply.

``Session`` is what a switchps worker (``worker.main``) and a user's own training loop
(``worker.torch_loop``) both do with the PS: register (and send the initial values if the PS has none),
push through shared memory when the PS is on this host, pull, then push each step's Σ gradient with its
sample count b, header and statistics, and keep the reply's work order. Through an outage of the PS it
retries (``client.Reconnect``): it registers again and sends the same push, which the PS recognises by
its (worker, session, step). A push may also be ``send``t on the session's own thread and its reply
``receive``d later (``runtime.pipeline_depth`` 1: ``worker.main`` computes its next step meanwhile; a
user's own loop, ``worker.torch_loop``, pushes and waits). ``Batches`` cuts a user's data loader into the
micro-batches a work order allows (``steps.Budget``), so a loop it drives obeys the same budgets as a
switchps worker.
"""

from __future__ import annotations

import secrets
import logging
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np

from switchps.config.run import RunConfig
from switchps.protos import switchps_pb2 as pb
from switchps.protos.layout import with_wire
from switchps.protos.wire_dtype import wire_nbytes
from switchps.security.channels import client_security
from switchps.worker.client import PSClient, Reconnect, Reply
from switchps.worker.sharded import connect
from switchps.worker.steps import Budget, Clock, RealClock

log = logging.getLogger("switchps.worker")


class Session:
    """Worker ``index`` of the run ``cfg`` describes, registered with ``layout`` (``size`` float32 values)
    and ``partition_size`` training samples (what ``train.epochs`` counts); ``read`` gives the initial
    values if the PS asks for them. ``framework`` and ``device`` are said at registration: the PS refuses a
    worker of another framework than the run's; so is ``local_steps``, whether the caller's loop obeys a
    work order's local steps (the built-in worker loop and a user's own, ``worker.torch_loop``, both do), and
    the PS refuses one that does not while the protocol in force has them. Used from one thread; between
    ``send`` and ``receive`` the push runs on the session's thread, and the caller touches nothing of the
    session but ``receive``."""

    def __init__(self, cfg: RunConfig, index: int, layout: pb.Layout, size: int, partition_size: int,
                 read: Callable[[], np.ndarray], *, framework: str, device: str,
                 clock: Clock | None = None, local_steps: bool = False) -> None:
        layout = with_wire(layout, cfg.runtime.wire_dtype)  # what the PS checks at registration
        self.index, self.layout = index, layout
        self.clock = clock or RealClock()
        security = client_security(cfg, "worker", index)
        self.client = connect(cfg.cluster.shards, layout, cfg.runtime.shard_max_bytes, cfg.runtime.chunk_bytes,
                              security)
        self._leaving = lambda: PSClient(cfg.cluster.shards[0], timeout_s=2.0, security=security)
        self.session = 1 + secrets.randbelow(2**31 - 1)
        """This process, as it names itself to the PS: its registration and its pushes (never 0, unnamed)."""

        def join(wait: bool = True) -> None:  # ready: the PS starts the clock once every worker is
            if self.client.register(index, layout, partition_size, wait, framework=framework, device=device,
                                    local_steps=local_steps, session=self.session).send_init:  # the PS has no model yet
                self.client.init(index, layout, read())
            if cfg.runtime.shared_memory and self.client.attach(index, wire_nbytes(size, cfg.runtime.wire_dtype)):
                log.info("worker %d: pushes through shared memory (the PS is on this host)%s", index,
                         ", its headers through the PS's socket" if self.client.socket_path else "")

        self.retry = Reconnect(self.client.address, cfg.cluster.reconnect_s, rejoin=lambda: join(wait=False))
        self.retry(join)  # a sharded PS answers UNAVAILABLE until its shards have attached
        self.order = pb.WorkOrder()
        self.received_at = self.clock.now()
        """When the latest reply arrived: AMB's time budget counts from it."""
        self.step = 0
        self.send_s = self.wait_s = 0.0  # the latest push's, reported with the next one
        self._flight: tuple[Future[tuple[Reply, float]], float] | None = None  # a push sent, and when
        self._thread: ThreadPoolExecutor | None = None

    def pull(self, params: np.ndarray) -> Reply:
        """The model's values into ``params`` (once it is initialized), and the first work order."""
        reply = self.retry(lambda: self.client.pull(params, worker=self.index, wait_initialized=True))
        self.order, self.received_at = reply.order, self.clock.now()
        return reply

    @property
    def payload_area(self) -> np.ndarray | None:
        """Where a payload is pushed from without a copy (the shared-memory segment's), if anywhere."""
        return self.client.payload_area

    def push(self, grad: np.ndarray, samples: int, params: np.ndarray, *, base_version: int | None = None,
             **stats: Any) -> Reply:
        """Push Σ gradient ``grad`` over ``samples`` samples, computed on the values of ``base_version`` (by
        default the current order's), with the step's ``stats`` (``pb.StepStats`` fields); the reply's values
        land in ``params`` or the segment (``Reply.values``), its work order in ``order``."""
        header = self._header(samples, base_version, stats)
        sent = self.clock.now()
        return self._settle(*self._exchange(header, grad, params), sent)

    def send(self, grad: np.ndarray, samples: int, params: np.ndarray, *, base_version: int,
             **stats: Any) -> None:
        """``push``, on the session's thread: returns at once. Until ``receive`` the push reads ``grad`` and
        may write ``params`` and the segment's areas, so the caller must leave all three alone."""
        assert self._flight is None, "one push in flight at most"
        header = self._header(samples, base_version, stats)
        self._thread = self._thread or ThreadPoolExecutor(1, thread_name_prefix="switchps-push")
        self._flight = self._thread.submit(self._exchange, header, grad, params), self.clock.now()

    def receive(self, since: float) -> Reply:
        """The reply to the push ``send`` sent, once it arrives. Its ``send_s`` counts from ``since`` (when
        the caller's compute ended) or from the send, whichever is later: the time the worker waited."""
        assert self._flight is not None, "no push in flight"
        (future, sent), self._flight = self._flight, None
        return self._settle(*future.result(), max(sent, since))

    def _header(self, samples: int, base_version: int | None, stats: dict[str, Any]) -> pb.PushHeader:
        report = pb.StepStats(step=self.step, send_s=self.send_s, wait_s=self.wait_s, **stats)
        version = self.order.version if base_version is None else base_version
        return pb.PushHeader(worker=self.index, base_version=version, samples=samples,
                             layout_digest=self.layout.digest, stats=report, session=self.session)

    def _exchange(self, header: pb.PushHeader, grad: np.ndarray, params: np.ndarray) -> tuple[Reply, float]:
        """The push through outages, and when its reply arrived."""
        reply = self.retry(lambda: self.client.push(header, grad, params))
        return reply, self.clock.now()

    def _settle(self, reply: Reply, arrived: float, waited_from: float) -> Reply:
        """Keep a reply's order, and its times for the next push's report."""
        self.received_at = arrived
        self.send_s, self.wait_s = max(0.0, arrived - waited_from), reply.reply.wait_s
        self.order = reply.order
        self.step += 1
        return reply

    def leave(self) -> None:
        """Tell the PS this worker is ending (``Leave``), on a channel of its own (the session's may be in
        the middle of a call); a PS that is gone already is no error."""
        client = self._leaving()
        try:
            client.leave(self.index, self.session)
        except grpc.RpcError as e:
            log.info("worker %d: the PS did not hear it leave (%s)", self.index, e.code().name)
        finally:
            client.close()

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True, cancel_futures=True)
        self.client.close()


class Batches:
    """A data loader's batches, cut into the micro-batches each work order allows.

    A loader's batch is sliced (views, no copy) where the order's micro-batch, or what is left of its
    sample budget, is smaller; the rest of it opens the next step, so every sample counts once per pass.
    A pass that ends starts the next one (``iter(loader)`` again: a shuffling loader reshuffles). A batch
    is a tensor/array or a tuple, list or dict of them, all as long as one another.
    """

    def __init__(self, loader: Iterable[Any]) -> None:
        self.loader = loader
        self._it: Iterator[Any] = iter(loader)
        self._held: Any = None  # the part of a loader batch not yet handed out
        self.compute_s = 0.0
        """The time the caller spent on this step's micro-batches."""

    def step(self, budget: Budget, clock: Clock) -> Iterator[Any]:
        """Micro-batches until ``budget`` ends; counts them in ``budget.done``."""
        self.compute_s = 0.0
        while size := budget.next(clock.now()):
            batch = self._take(size)
            budget.done += _length(batch)  # counted when handed out: a loop that breaks after it pushes it
            t0 = clock.now()
            yield batch
            self.compute_s += clock.now() - t0

    def _take(self, size: int) -> Any:
        """At most ``size`` samples: the held batch's first ones, or the loader's next batch's."""
        if self._held is None:
            self._held = next(self._it, None)
            if self._held is None:  # the pass ended
                self._it = iter(self.loader)
                self._held = next(self._it, None)
                if self._held is None:
                    raise ValueError("the data loader yields no batch")
        n = _length(self._held)
        if n <= size:
            batch, self._held = self._held, None
            return batch
        batch, self._held = _slice(self._held, 0, size), _slice(self._held, size, n)
        return batch


def _length(batch: Any) -> int:
    """The number of samples in a batch: its first tensor's length."""
    if isinstance(batch, dict):
        return _length(next(iter(batch.values())))
    if isinstance(batch, (tuple, list)):
        return _length(batch[0])
    return len(batch)


def _slice(batch: Any, start: int, stop: int) -> Any:
    if isinstance(batch, dict):
        return {k: _slice(v, start, stop) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_slice(v, start, stop) for v in batch)
    return batch[start:stop]
