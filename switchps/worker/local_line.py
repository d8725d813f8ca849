"""A worker's end of its PS's Unix socket for its segment and pushes (frames: ``protos/local_socket.py``)."""

from __future__ import annotations

import socket

import grpc

from switchps.protos.local_socket import LENGTH, OK, frame, status


class LocalRpcError(grpc.RpcError):
    """A failure found on the worker's side of a call (a push refused, or cut off, on the socket; a channel
    not connected in time) as a gRPC call's error (``code()``, ``details()``), so that whoever handles
    those (``Reconnect``, the re-attach after a restart of the PS) handles these too."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class LineBroken(LocalRpcError):
    """The socket itself failed (closed, the PS gone, no answer within the timeout): UNAVAILABLE, and the
    connection is closed. Any other ``LocalRpcError`` is the PS's own answer, over a line still open."""

    def __init__(self, details: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, details)


class LocalLine:
    """A connection to the PS's socket, its first frame the worker's token with its segment's descriptor,
    which the PS maps for this worker's pushes. Used from one thread.

    A connection that fails (the PS went away, no answer within ``timeout_s``) is closed: every push on
    it from then on is UNAVAILABLE, so the next one is not read against a late answer to this one."""

    def __init__(self, path: str, token: str, segment_fd: int, timeout_s: float | None) -> None:
        """``OSError`` if the socket cannot be reached (the PS is on another host); ``LocalRpcError`` if
        the PS refuses the segment."""
        self.path = path
        self._sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)
        try:
            self._sock.connect("\0" + path[1:] if path.startswith("@") else path)  # @: the abstract namespace
            first = frame(token.encode())
            sent = socket.send_fds(self._sock, [first], [segment_fd])
            self._sock.sendall(first[sent:])
            self._answer()
        except (OSError, LocalRpcError):
            self.close()
            raise

    def push(self, body: bytes) -> bytes:
        """The reply's bytes to a push's (a ``PushSmall`` request's); ``LocalRpcError`` if it has none."""
        if self._sock is None:
            raise LineBroken("the connection to the PS's socket is closed")
        try:
            self._sock.sendall(frame(body))
            return self._answer()
        except OSError as e:  # a timeout included
            self.close()
            raise LineBroken(f"the PS's socket: {e or type(e).__name__}") from None

    def _answer(self) -> bytes:
        """The body of an OK answer; ``LocalRpcError`` for any other."""
        (n,) = LENGTH.unpack(self._read(LENGTH.size))
        data = self._read(n)
        code = status(data[0]) if data else grpc.StatusCode.UNKNOWN
        if code.value[0] != OK:
            raise LocalRpcError(code, data[1:].decode("utf-8", "replace"))
        return data[1:]

    def _read(self, n: int) -> bytes:
        assert self._sock is not None
        data = self._sock.recv(n, socket.MSG_WAITALL)
        if len(data) < n:
            raise ConnectionResetError("the PS closed the connection")
        return data

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
