"""How a server reads a request (``parse``, ``decode``, ``first_frame``, ``fill``): a malformed message or
frame is the caller's error, raised as ``Rejected`` (INVALID_ARGUMENT), and a streamed request is read
frame by frame with ``ctx.read``, each frame within a timeout, until the client ends it. The frames are
the codec's (``protos/codec.py``)."""

from __future__ import annotations

import asyncio
from typing import Protocol, TypeVar

from google.protobuf.message import DecodeError, Message

from switchps.protos.codec import FrameError, PayloadWriter, decode_header
from switchps.refusals import Rejected, invalid

M = TypeVar("M", bound=Message)


class Call(Protocol):
    """What reading a request needs of a server call (``grpc.aio.ServicerContext``)."""

    async def read(self) -> object: ...  # a frame (bytes), or grpc.aio.EOF

    def time_remaining(self) -> float | None: ...

    async def send_initial_metadata(self, initial_metadata: tuple) -> None: ...


def parse(body: bytes, message_type: type[M]) -> M:
    """A unary request's body as ``message_type``. Bytes that are no such message are the caller's error
    (INVALID_ARGUMENT, counted), not the server's: grpc's own deserializer would answer UNKNOWN and log a
    traceback for each one."""
    message = message_type()
    try:
        message.ParseFromString(body)
    except DecodeError:
        raise invalid("malformed", f"the request is not a valid {message_type.__name__}") from None
    return message


def decode(frame0: bytes, header_type: type[M]) -> tuple[M, memoryview]:
    """Frame 0's header and inline payload; a malformed frame is rejected."""
    try:
        return decode_header(frame0, header_type)
    except FrameError as e:
        raise invalid("malformed", str(e)) from None


async def _read(ctx: Call, timeout_s: float) -> bytes | None:
    """The next request frame within ``timeout_s``, or None once the client half-closed."""
    try:
        frame = await asyncio.wait_for(ctx.read(), timeout_s)
    except asyncio.TimeoutError:
        raise Rejected("DEADLINE_EXCEEDED", "idle", f"no frame within {timeout_s:g}s") from None
    return frame if isinstance(frame, bytes) else None  # grpc.aio.EOF is the one thing read that is not bytes


async def first_frame(ctx: Call, timeout_s: float) -> bytes:
    frame = await _read(ctx, timeout_s)
    if frame is None:
        raise invalid("empty", "the stream ended before its first frame")
    return frame


async def fill(writer: PayloadWriter, first: memoryview, ctx: Call, timeout_s: float | None) -> bool:
    """Receive the whole payload: ``first``, then (``timeout_s`` given: a streamed request) the frames
    that follow; returns whether it is finite. It counts only if the stream ended cleanly: grpc reports a
    stream that broke (a frame over the size cap, the client's deadline) as a plain end of stream, so the
    end of a stream is confirmed by sending the reply's initial metadata, which fails on a broken call. A
    unary request (``timeout_s`` None) arrives whole or not at all."""
    try:
        if len(first):
            writer.add(first)
        while timeout_s is not None and (frame := await _read(ctx, timeout_s)) is not None:
            writer.add(frame)
        finite = writer.finish()
    except FrameError as e:
        raise invalid("size", str(e)) from None
    remaining = ctx.time_remaining()
    try:
        if remaining is not None and remaining <= 0:
            raise TimeoutError
        if timeout_s is not None:
            await ctx.send_initial_metadata(())
    except Exception:
        raise Rejected("CANCELLED", "broken_stream", "the stream broke before its end") from None
    return finite
