"""The frames of pushes through a Unix socket, when a worker and its PS share a host.

A worker whose pushes go through a shared-memory segment (``protos/segment.py``) sends only a header,
and through gRPC that header costs a call: 0.38 ms of CPU on both sides alone against 0.05 ms over a
Unix socket (``bench/ceiling.py``), and about 2 ms of a 784k step's 6.4 under load. So the PS also
listens on a Unix socket, named in ``AttachReply.socket`` (``@name``: in Linux's abstract namespace).

Each frame, either way, is ``u32 little-endian length || body``, at most ``MAX_FRAME`` bytes. The
worker's first frame is its token (empty on a PS without authentication), sent with its segment's
descriptor (``SCM_RIGHTS``: one descriptor, ``protos/segment.py``); it must be whole within the PS's
``receive_timeout_s`` of the connection, and is answered: OK once the PS has mapped the segment, else the
refusal, and the connection ends. Each later frame is a push, the very bytes a ``PushSmall`` call would
carry. Each answer is one frame: ``u8 status`` (a gRPC status code's value, 0 for OK), then the
``PushSmall`` reply's bytes (OK; none for the first frame's) or the error's details (UTF-8).
"""

from __future__ import annotations

import grpc

from switchps.protos.codec import HEADER_BYTES, LENGTH

MAX_FRAME = HEADER_BYTES
"""A push through a segment is a header; a longer frame is refused from its length prefix."""
OK = grpc.StatusCode.OK.value[0]
_CODES = {code.value[0]: code for code in grpc.StatusCode}


def frame(body: bytes) -> bytes:
    return LENGTH.pack(len(body)) + body


def answer(code: grpc.StatusCode, body: bytes) -> bytes:
    """The frame of an answer: OK and a reply's bytes, or an error's code and its details."""
    return frame(bytes([code.value[0]]) + body)


def status(value: int) -> grpc.StatusCode:
    """The gRPC status of an answer's first byte (UNKNOWN for a value gRPC has not)."""
    return _CODES.get(value, grpc.StatusCode.UNKNOWN)
