"""The PS as one client when the model is spread over several shards (``cluster.ps`` lists them).

``ShardedClient`` has ``PSClient``'s calls. It splits what it sends by the partition of the model
(``switchps.protos.partition``: a pure function of the layout, the shard count and
``runtime.shard_max_mb``, so every role computes the same one), sends part 0 to shard 0 (the PS that
decides) and part k to follower shard k, all at once, and joins the parts of the reply. A push's parts
carry its name (worker, session, step), by which shard 0 and the followers agree on what they apply.
A step is complete when every shard has answered; the reply's work order is shard 0's. Once attached
(``attach``), a push's part for a shard on this host, shard 0 or a follower, goes through a
shared-memory segment of that shard's own, and so does that shard's part of the reply. With one
address, ``connect`` returns a plain ``PSClient``: an unsharded PS pays nothing for this.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

import numpy as np

from switchps.security.channels import ClientSecurity
from switchps.protos import switchps_pb2 as pb
from switchps.protos.layout import layout_wire
from switchps.protos.wire_dtype import wire_nbytes
from switchps.protos.partition import of_layout, part_layout
from switchps.worker.client import PSClient, Reply

T = TypeVar("T")
INIT_STEP = -1
"""The step in the name of the initial values' parts."""
FOLLOWER_READY_S = 10.0
"""How long a registration waits for a follower's channel to connect (then UNAVAILABLE: retried)."""


class ShardedClient:
    """One ``PSClient`` per shard; see the module docstring. Used from one thread at a time."""

    payload_area = None
    """A payload is split into the shards' parts first, so none is sent from where it was written."""

    def __init__(self, addresses: list[str], layout: pb.Layout, max_bytes: int, chunk_bytes: int,
                 security: ClientSecurity = ClientSecurity(), timeout_s: float | None = None) -> None:
        self.address = addresses[0]
        self.wire = layout_wire(layout)
        self.clients = [PSClient(a, chunk_bytes, timeout_s, security, self.wire) for a in addresses]
        self.partition = of_layout(layout, len(addresses), max_bytes)
        self.layouts = [part_layout(layout, self.partition, k) for k in range(len(addresses))]
        self.parts = [np.empty(n, np.float32) for n in self.partition.sizes()]
        """Where each shard's part of a reply lands, before it is joined into the caller's buffer."""
        self._pool = ThreadPoolExecutor(len(addresses) - 1, thread_name_prefix="switchps-shard")

    def register(self, worker: int, layout: pb.Layout, partition_size: int, wait: bool = True,
                 framework: str = "", device: str = "", local_steps: bool = False,
                 session: int = 0) -> pb.RegisterReply:
        """Shard 0's registration; it answers once every follower has attached, so each follower is serving,
        and its channel is waited for here: after an outage, gRPC would fail a part sent before the channel
        reconnects at once, and shard 0 would wait ``receive_timeout_s`` for it."""
        reply = self.clients[0].register(worker, layout, partition_size, wait, shard_partition=self.partition.digest,
                                         framework=framework, device=device, local_steps=local_steps,
                                         session=session)
        for c in self.clients[1:]:
            c.wait_ready(FOLLOWER_READY_S)
        return reply

    def attach(self, worker: int, nbytes: int) -> bool:
        """Each shard's part of a push through a segment of its own, sized for that part in the wire's type,
        if that shard is on this host (the others' go as gRPC bytes); whether every shard's does."""
        return all([c.attach(worker, wire_nbytes(part.size, self.wire)) for c, part in zip(self.clients, self.parts)])

    @property
    def socket_path(self) -> str:
        """Shard 0's socket, if its part's pushes go through it."""
        return self.clients[0].socket_path

    def init(self, worker: int, layout: pb.Layout, values: np.ndarray) -> pb.WorkOrder:
        parts = self.partition.split(values)
        key = pb.PartKey(worker=worker, session=0, step=INIT_STEP)
        followers = self._each("InitPart", key, parts)
        return _together(lambda: self.clients[0].init(worker, self.layouts[0], np.ascontiguousarray(parts[0])),
                         followers)

    def push(self, header: pb.PushHeader, grad_sum: np.ndarray, params: np.ndarray) -> Reply:
        """Every shard's part of the push at once; ``params`` gets every shard's part of the reply."""
        areas = [c.payload_area for c in self.clients] if self.wire == "float32" else []  # else narrowed there
        parts = self.partition.split(grad_sum, areas)  # into the segments
        header.attempt = secrets.randbits(62)
        followers = self._each("PushPart", pb.PartKey(worker=header.worker, session=header.session,
                                                      step=header.stats.step, attempt=header.attempt), parts)
        header.layout_digest = self.layouts[0].digest
        reply = _together(lambda: self.clients[0].push(header, np.ascontiguousarray(parts[0]), self.parts[0]),
                          followers)
        if reply.fresh:  # a shard's part is in its segment if it came through shared memory
            self.partition.join([reply.values, *(f.result()[1] for f in followers)], out=params)
        return Reply(reply.reply, reply.fresh, params)

    def pull(self, params: np.ndarray, worker: int = -1, have_version: int = -1,
             wait_initialized: bool = False, master: bool = False) -> Reply:
        """Shard 0's part and order, then every follower's part at that version (or newer); ``master``: the
        shards' float32 values, whatever the wire's type (the evaluator's)."""
        reply = self.clients[0].pull(self.parts[0], worker, have_version, wait_initialized, master)
        if reply.fresh:
            version = reply.order.version
            _results([self._pool.submit(c.pull_part, out, worker, version, master)
                      for c, out in zip(self.clients[1:], self.parts[1:])])
            self.partition.join(self.parts, out=params)
        return reply

    def _each(self, rpc: str, key: pb.PartKey, parts: list[np.ndarray]) -> list[Future[Any]]:
        """Send part k to follower k, each on a pool thread."""
        return [self._pool.submit(c.part, rpc, pb.PartHeader(key=key, layout_digest=layout.digest),
                                  np.ascontiguousarray(part), out)
                for c, layout, part, out in zip(self.clients[1:], self.layouts[1:], parts[1:], self.parts[1:])]

    def status(self) -> pb.Status:
        return self.clients[0].status()

    def report_eval(self, version: int, test_loss: float, test_accuracy: float, final: bool = False) -> pb.Status:
        return self.clients[0].report_eval(version, test_loss, test_accuracy, final)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for c in self.clients:
            c.close()


def _results(futures: list[Future[Any]]) -> None:
    """Wait for every call; then raise the first error, if any."""
    errors = [f.exception() for f in futures]
    for e in errors:
        if e is not None:
            raise e


def _together(first: Callable[[], T], followers: list[Future[Any]]) -> T:
    """Shard 0's call, made while the followers' run; shard 0's error wins (it is the one counted)."""
    try:
        result = first()
    except BaseException:
        wait(followers)
        raise
    _results(followers)
    return result


def connect(addresses: list[str], layout: pb.Layout, max_bytes: int, chunk_bytes: int,
            security: ClientSecurity) -> PSClient | ShardedClient:
    """A client of the PS at ``addresses`` (``cluster.shards``): one shard, a plain ``PSClient`` whose pushes
    and replies carry the type ``layout`` says (``Layout.wire_dtype``)."""
    if len(addresses) == 1:
        return PSClient(addresses[0], chunk_bytes, security=security, wire=layout_wire(layout))
    return ShardedClient(addresses, layout, max_bytes, chunk_bytes, security)  # its parts in ``layout``'s type
