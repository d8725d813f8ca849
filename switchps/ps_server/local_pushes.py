"""The PS's Unix socket for the pushes of workers on its host (frames: ``protos/local_socket.py``).

A connection's first frame is the worker's token, checked as the gRPC guard checks a call's; each later
frame is handed to the same ``push_small`` handler as a ``PushSmall`` call, with a ``LocalContext`` in
place of gRPC's, so a push through the socket meets every check a gRPC push meets (the handler's
``as_worker`` included) and is counted the same way when refused. A refused push is answered with its
status and the connection stays; a frame that breaks the format (longer than ``MAX_FRAME``, cut short),
a bad token, no token within ``receive_timeout_s``, or a peer of another user ends the connection,
counted too. Between pushes a worker may stay silent as long as it likes: only a process of the PS's
user is served, and only with a worker's token past its first frame.

Concurrency: everything here runs on the server's event loop, as the gRPC handlers do.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import struct
from typing import Any, Protocol

import grpc

from switchps.auth import METADATA_KEY, authorize
from switchps.protos.local_socket import LENGTH, MAX_FRAME, answer
from switchps.ps_server.guard import Guard
from switchps.refusals import Rejected, invalid

log = logging.getLogger("switchps.ps")
PEER = struct.Struct("3i")
"""``SO_PEERCRED``: the peer's pid, uid and gid."""


class Pushes(Protocol):
    """What the socket needs of the PS (``ParameterServer``)."""

    guard: Guard | None
    receive_timeout_s: float

    async def push_small(self, frame: bytes, ctx: Any) -> bytes: ...

    def count_rejection(self, rpc: str, r: Rejected) -> None: ...


class LocalContext:
    """The part of ``grpc.aio.ServicerContext`` a one-message push's handler uses."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.metadata, self.code, self.details = metadata, grpc.StatusCode.OK, ""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata

    def time_remaining(self) -> None:
        return None

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details


class LocalPushes:
    """Listens at ``path`` from ``open`` until the event loop stops: ``@switchps-ps-<32 hex>``, a name in
    Linux's abstract socket namespace (``@`` for its leading NUL byte), so a crash leaves no file behind.
    Only a process of the PS's own user (``uid``) is served, as a directory of mode 0700 would allow."""

    def __init__(self, ps: Pushes, listener: socket.socket, name: str) -> None:
        self.ps, self.uid, self.path = ps, os.geteuid(), "@" + name
        self._listener = listener
        self._task: asyncio.Task[None] | None = None  # serving, until the loop's tasks are cancelled

    @classmethod
    def open(cls, ps: Pushes) -> "LocalPushes | None":
        """Listen now (on the running loop); None, logged, where no Unix socket can be made."""
        listener, name = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), f"switchps-ps-{secrets.token_hex(16)}"
        try:
            listener.bind("\0" + name)
            listener.listen(128)
        except OSError as e:
            listener.close()
            log.warning("no Unix socket for local pushes (%s): they go through gRPC", e)
            return None
        local = cls(ps, listener, name)
        local._task = asyncio.get_running_loop().create_task(local._serve())
        return local

    async def _serve(self) -> None:
        server = await asyncio.start_unix_server(self._connection, sock=self._listener, limit=2**16)
        async with server:  # closed when the server stops and cancels this
            await server.serve_forever()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            self._same_user(writer.get_extra_info("socket"))
            token = await self._frame(reader, self.ps.receive_timeout_s)
            if token is None:
                return  # closed without a word
            metadata = self._admit(token)
            while (body := await self._frame(reader, None)) is not None:
                ctx = LocalContext(metadata)
                reply = await self.ps.push_small(body, ctx)
                writer.write(answer(ctx.code, reply if ctx.code == grpc.StatusCode.OK else ctx.details.encode()))
                await writer.drain()
        except Rejected as r:
            self.ps.count_rejection("push", r)
            writer.write(answer(getattr(grpc.StatusCode, r.code), str(r).encode()))
        except (ConnectionError, asyncio.CancelledError):
            pass  # the worker went away (what it sent whole was answered), or the server stops
        except Exception as e:  # as gRPC answers a handler's exception (a failed update): end, say so
            log.exception("local push failed")
            writer.write(answer(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}".encode()))
        finally:
            writer.close()

    async def _frame(self, reader: asyncio.StreamReader, timeout_s: float | None) -> bytes | None:
        """The next frame's body (None: the worker closed between frames); ``Rejected`` if it breaks the
        format or (``timeout_s``) does not come in time."""
        try:
            head = await asyncio.wait_for(reader.readexactly(LENGTH.size), timeout_s)
        except asyncio.IncompleteReadError as e:
            if not e.partial:
                return None
            raise _broken() from None
        except TimeoutError:
            raise Rejected("DEADLINE_EXCEEDED", "idle", f"no frame within {timeout_s:g}s") from None
        (n,) = LENGTH.unpack(head)
        if n > MAX_FRAME:
            raise invalid("size", f"a frame of {n} bytes exceeds {MAX_FRAME}")
        try:
            return await reader.readexactly(n)
        except asyncio.IncompleteReadError:
            raise _broken() from None

    def _same_user(self, sock: Any) -> None:
        """``Rejected`` (PERMISSION_DENIED) unless the peer runs as the PS's user (its credentials, from
        the kernel)."""
        _, uid, _ = PEER.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEER.size))
        if uid != self.uid:
            raise Rejected("PERMISSION_DENIED", "other_user", f"a process of user {uid}, not the PS's")

    def _admit(self, token: bytes) -> tuple[tuple[str, str], ...]:
        """The metadata the connection's pushes carry: its token, verified (if the PS has a guard)."""
        metadata = ((METADATA_KEY, token.decode("utf-8", "replace")),) if token else ()
        if self.ps.guard is not None:
            authorize(self.ps.guard.caller(metadata), "PushSmall")
        return metadata


def _broken() -> Rejected:
    return Rejected("CANCELLED", "broken_stream", "the connection closed before a whole frame")
