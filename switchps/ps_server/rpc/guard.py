"""The PS's gate: every RPC but the health service needs a valid token whose role may call it.

``Guard`` is a grpc.aio server interceptor, so a refused call never reaches its handler: it gets
UNAUTHENTICATED (no token, a wrong one) or PERMISSION_DENIED (a role calling outside its rights), is
counted through ``on_reject`` under the name its handler counts under (``rejections.rpc_name``), and
nothing of its request is read. RPCs that name a worker are checked once more in the handler, where the
worker id is known (``as_worker``), on shard 0 and on a follower shard alike.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

from switchps.security.auth import METADATA_KEY, Caller, admitted, authorize, authorize_worker, verify
from switchps.ps_server.rejections import rpc_name
from switchps.refusals import Rejected

OPEN_SERVICES = ("/grpc.health.v1.Health/",)
"""Reachable without a token: the launcher and load balancers probe health before anything else."""
_HANDLERS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


class Guard(grpc.aio.ServerInterceptor):
    """Authenticates and authorizes each call; ``on_reject(rpc, rejected)`` counts a refusal."""

    def __init__(self, secret: bytes, on_reject: Callable[[str, Rejected], None]) -> None:
        self._secret, self._on_reject = secret, on_reject

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method: str = details.method
        if handler is None or method.startswith(OPEN_SERVICES):
            return handler
        rpc = method.rsplit("/", 1)[-1]
        try:
            authorize(self.caller(details.invocation_metadata), rpc)
        except Rejected as r:
            self._on_reject(rpc_name(rpc), r)
            return _refusal(handler, r)
        return handler

    def caller(self, md: Sequence[tuple[str, Any]] | None) -> Caller:
        """Who the call's token proves the caller is; ``Rejected`` (UNAUTHENTICATED) if it proves nothing."""
        return verify(self._secret, _header(md))

    @staticmethod
    def admitted(md: Sequence[tuple[str, Any]] | None) -> Caller:
        """The caller of a call this guard let through: its token was verified on the way in, so a
        handler learns who called without a second HMAC on the push path."""
        return admitted(_header(md))


def as_worker(guard: Guard | None, ctx: grpc.aio.ServicerContext, worker: int, rpc: str) -> None:
    """With a guard, ``Rejected`` (PERMISSION_DENIED) unless the caller's token is worker ``worker``'s
    (-1: the caller must not be a worker)."""
    if guard is not None:
        authorize_worker(guard.admitted(ctx.invocation_metadata()), worker, rpc)


def _header(md: Sequence[tuple[str, Any]] | None) -> str | None:
    """The call's one ``authorization`` value (None if absent, repeated or not text)."""
    values = [v for k, v in md or () if k == METADATA_KEY]
    return values[0] if len(values) == 1 and isinstance(values[0], str) else None


def _refusal(handler: grpc.RpcMethodHandler, r: Rejected) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s shape that reads nothing and ends the call with ``r``'s status."""

    async def refuse(request: object, ctx: grpc.aio.ServicerContext) -> None:
        await ctx.abort(getattr(grpc.StatusCode, r.code), str(r))

    return _HANDLERS[handler.request_streaming, handler.response_streaming](refuse)
