"""A running PS server: grpc.aio with the health service, on an event-loop thread of its own."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Protocol, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from threadpoolctl import threadpool_limits

from switchps.security.channels import ServerSecurity
from switchps.protos.codec import grpc_options, receive_limit
from switchps.protos.heap import tune_allocator
from switchps.ps_server.rpc.guard import Guard
from switchps.ps_server.store import ModelStore
from switchps.ps_server.rpc.service import SERVICE
from switchps.refusals import Rejected

T = TypeVar("T")


class Servable(Protocol):
    """What a server serves: an unsharded PS or shard 0 (``ParameterServer``), or a follower shard."""

    store: ModelStore
    guard: Guard | None

    def methods(self) -> dict[str, grpc.RpcMethodHandler]: ...

    def on_serving(self) -> None: ...

    def count_rejection(self, rpc: str, r: Rejected) -> None: ...


class Server:
    """A running PS: grpc.aio with the health service, on an event-loop thread of its own.

    Callers stay synchronous: the training loop in ``ps_server.main`` and the tests
    start and stop it from their own threads. With ``security``, every RPC but the health service needs
    a token (``ps_server.guard``) and the port speaks TLS if it has a certificate. A message larger than
    one chunk and a header is refused by gRPC from its length prefix (``codec.receive_limit``).
    """

    def __init__(self, ps: Servable, address: str, security: ServerSecurity = ServerSecurity()) -> None:
        self.ps, self.security = ps, security
        # the PS's BLAS passes (finiteness check, SGD's axpy) on one thread: with OpenBLAS's threads on
        # 2 cores, a 100 MB round trip took 120-131 ms against 85-92 (``bench/transport.py``)
        threadpool_limits(1, user_api="blas")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="switchps-grpc", daemon=True)
        self._thread.start()
        try:
            self.port = self._call(self._start(address))
        except BaseException:
            self._close_loop()
            raise

    def _call(self, coro: Coroutine[object, object, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _start(self, address: str) -> int:
        tune_allocator()
        interceptors = []
        if self.security.secret is not None:
            self.ps.guard = Guard(self.security.secret, self.ps.count_rejection)
            interceptors.append(self.ps.guard)
        # no SO_REUSEPORT (gRPC's default on Linux): with it a second server binds a port in use and the
        # two split its connections; without it a port in use is an error, and a PS can fall back to another
        options = [*grpc_options(max_receive_bytes=receive_limit(self.ps.store.chunk_bytes)), ("grpc.so_reuseport", 0)]
        self._server = grpc.aio.server(options=options, interceptors=interceptors)
        self._server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, self.ps.methods())])
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        creds = self.security.credentials()
        try:
            port = self._server.add_secure_port(address, creds) if creds else self._server.add_insecure_port(address)
        except RuntimeError:  # grpc: "Failed to bind to address"
            port = 0
        if port == 0:
            raise OSError(f"cannot bind the PS to {address}")
        await self._server.start()
        self.ps.on_serving()
        for service in (SERVICE, ""):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        return port

    def call(self, fn: Callable[[], T], timeout: float | None = 10.0) -> T:
        """Run ``fn`` on the server's loop (from another thread) and return its result."""
        async def run() -> T:
            return fn()
        return self._call(run(), timeout)

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop serving (in-flight RPCs get ``grace`` seconds), then the loop; again: nothing."""
        if not self._thread.is_alive():
            return
        self._call(self._stop(grace))
        self._close_loop()

    def _close_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)

    async def _stop(self, grace: float | None) -> None:
        await self.health.enter_graceful_shutdown()
        await self._server.stop(grace)
        # what the served object started on this loop (a follower shard's stream to shard 0) ends with it
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
