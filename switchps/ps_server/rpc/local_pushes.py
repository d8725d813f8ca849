"""The PS's Unix socket for the segments and pushes of workers on its host (frames: ``protos/local_socket.py``).

A connection's first frame is the worker's token, checked as the gRPC guard checks a call's, and comes
with its shared-memory segment's descriptor, which the PS maps for the worker whose ``Attach`` sent the
nonce it holds (``Attachments.adopt``) and answers. Each later frame is handed to the same
``push_small`` handler as a ``PushSmall`` call, with a ``LocalContext`` in place of gRPC's, so a push
through the socket meets every check a gRPC push meets (the handler's ``as_worker`` included) and is
counted the same way when refused. A refused push is answered with its status and the connection stays;
a refused segment (counted as ``attach``), a frame that breaks the format (longer than ``MAX_FRAME``,
cut short), a bad token, a first frame not whole within ``receive_timeout_s`` of the connection, or a
peer of another user ends the connection, counted too. Between pushes a worker may stay silent as long
as it likes: only a process of the PS's user is served, and only with a worker's token past its first
frame.

The first frame is read off the socket itself, since asyncio's streams drop the descriptors that come
with what they read; the connection becomes a stream once it is in.

Concurrency: everything here runs on the server's event loop, as the gRPC handlers do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import struct
from typing import Any, Protocol

import grpc

from switchps.security.auth import METADATA_KEY, authorize
from switchps.protos.local_socket import LENGTH, MAX_FRAME, answer
from switchps.ps_server.rpc.guard import Guard
from switchps.refusals import Rejected, invalid

log = logging.getLogger("switchps.ps")
PEER = struct.Struct("3i")
"""``SO_PEERCRED``: the peer's pid, uid and gid."""


class Pushes(Protocol):
    """What the socket needs of the PS (``ParameterServer``)."""

    guard: Guard | None
    receive_timeout_s: float

    async def push_small(self, frame: bytes, ctx: Any) -> bytes: ...

    def adopt_segment(self, fds: list[int], ctx: Any) -> None: ...

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
        listener.setblocking(False)
        local = cls(ps, listener, name)
        local._task = asyncio.get_running_loop().create_task(local._serve())
        return local

    async def _serve(self) -> None:
        """Serve each connection on a task of its own until cancelled (the server stops)."""
        loop = asyncio.get_running_loop()
        connections: set[asyncio.Task[None]] = set()
        try:
            while True:
                try:
                    conn, _ = await loop.sock_accept(self._listener)
                except OSError as e:  # out of descriptors, say: as asyncio's own servers do, pause and go on
                    log.warning("the PS's socket cannot accept a connection (%s): trying again in 1 s", e)
                    await asyncio.sleep(1.0)
                    continue
                task = loop.create_task(self._connection(conn))
                connections.add(task)
                task.add_done_callback(connections.discard)
        finally:
            self._listener.close()
            for task in connections:
                task.cancel()

    async def _connection(self, conn: socket.socket) -> None:
        writer: asyncio.StreamWriter | None = None
        fds: list[int] = []  # the descriptors that came with the first frame: closed here whatever happens
        rpc = "push"
        try:
            self._same_user(conn)
            token = await _first_frame(conn, self.ps.receive_timeout_s, fds)
            if token is None:
                return  # closed without a word
            reader, writer = await asyncio.open_unix_connection(sock=conn, limit=2**16)
            metadata = self._admit(token)
            rpc = "attach"
            self.ps.adopt_segment(fds, LocalContext(metadata))
            rpc = "push"
            writer.write(answer(grpc.StatusCode.OK, b""))
            while (body := await _frame(reader)) is not None:
                ctx = LocalContext(metadata)
                reply = await self.ps.push_small(body, ctx)
                writer.write(answer(ctx.code, reply if ctx.code == grpc.StatusCode.OK else ctx.details.encode()))
                await writer.drain()
        except Rejected as r:
            self.ps.count_rejection(rpc, r)
            await _say(conn, writer, answer(getattr(grpc.StatusCode, r.code), str(r).encode()))
        except (ConnectionError, asyncio.CancelledError):
            pass  # the worker went away (what it sent whole was answered), or the server stops
        except Exception as e:  # as gRPC answers a handler's exception (a failed update): end, say so
            log.exception("local push failed")
            await _say(conn, writer, answer(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}".encode()))
        finally:
            for fd in fds:
                os.close(fd)
            if writer is not None:
                writer.close()
            else:
                conn.close()

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


async def _first_frame(conn: socket.socket, timeout_s: float, fds: list[int]) -> bytes | None:
    """The first frame's body, read off the socket itself, and (into ``fds``) the descriptors that came
    with it; None if the worker closed without a word. ``Rejected`` if it breaks the format or is not
    whole within ``timeout_s``."""
    loop, data = asyncio.get_running_loop(), b""
    try:
        async with asyncio.timeout(timeout_s):
            while len(data) < (end := _frame_end(data)):
                try:
                    chunk, more, _, _ = socket.recv_fds(conn, end - len(data), 2)  # 2: to see "more than one"
                except BlockingIOError:
                    await _readable(loop, conn)
                    continue
                fds += more
                while len(fds) > 2:  # two show "more than one"; the rest go at once, so no flood of them stays
                    os.close(fds.pop())
                if not chunk:
                    if data:
                        raise _broken()
                    return None
                data += chunk
    except TimeoutError:
        raise Rejected("DEADLINE_EXCEEDED", "idle", f"no whole first frame within {timeout_s:g}s") from None
    return data[LENGTH.size:]


def _frame_end(data: bytes) -> int:
    """Where a frame that starts ``data`` ends: after its length prefix, until that is in."""
    return LENGTH.size if len(data) < LENGTH.size else LENGTH.size + _length(data[:LENGTH.size])


async def _readable(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> None:
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(conn.fileno(), wake)
    try:
        await ready
    finally:
        loop.remove_reader(conn.fileno())


async def _frame(reader: asyncio.StreamReader) -> bytes | None:
    """A later frame's body (None: the worker closed between frames); ``Rejected`` if it breaks the format."""
    try:
        head = await reader.readexactly(LENGTH.size)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise _broken() from None
    try:
        return await reader.readexactly(_length(head))
    except asyncio.IncompleteReadError:
        raise _broken() from None


def _length(head: bytes) -> int:
    (n,) = LENGTH.unpack(head)
    if n > MAX_FRAME:
        raise invalid("size", f"a frame of {n} bytes exceeds {MAX_FRAME}")
    return n


async def _say(conn: socket.socket, writer: asyncio.StreamWriter | None, data: bytes) -> None:
    """Answer the worker, through the stream if the connection has become one."""
    if writer is not None:
        writer.write(data)
        return
    with contextlib.suppress(OSError):  # the worker has gone: nobody to tell
        await asyncio.get_running_loop().sock_sendall(conn, data)


def _broken() -> Rejected:
    return Rejected("CANCELLED", "broken_stream", "the connection closed before a whole frame")
