"""Reading requests on the PS: a unary request's message, frame 0's header, the payload to the end of its
stream, and the confirmation that the stream really ended (see ``fill``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TypeVar

import grpc
from google.protobuf.message import DecodeError

from switchps.protos import switchps_pb2 as pb
from switchps.protos.codec import FrameError, PayloadWriter, decode_header
from switchps.refusals import Rejected, invalid

H = TypeVar("H", pb.InitHeader, pb.PushHeader, pb.PullRequest)
U = TypeVar("U", pb.RegisterRequest, pb.StatusRequest, pb.EvalReport)


def parse(body: bytes, message_type: type[U]) -> U:
    """A unary request's body as ``message_type``. Bytes that are no such message are the caller's error
    (INVALID_ARGUMENT, counted), not the server's: grpc's own deserializer would answer UNKNOWN and log a
    traceback for each one."""
    message = message_type()
    try:
        message.ParseFromString(body)
    except DecodeError:
        raise invalid("malformed", f"the request is not a valid {message_type.__name__}") from None
    return message


def decode(frame0: bytes, header_type: type[H]) -> tuple[H, memoryview]:
    """Frame 0's header and inline payload; a malformed frame is rejected."""
    try:
        return decode_header(frame0, header_type)
    except FrameError as e:
        raise invalid("malformed", str(e)) from None


async def first_frame(frames: AsyncIterator[bytes]) -> bytes:
    try:
        return await anext(frames)
    except StopAsyncIteration:
        raise invalid("empty", "the stream ended before its first frame") from None


async def fill(writer: PayloadWriter, first: memoryview, frames: AsyncIterator[bytes],
                ctx: grpc.aio.ServicerContext, stream: bool = True) -> bool:
    """Receive the whole payload; returns whether it is finite. It counts only if the stream ended cleanly:
    grpc reports a stream that broke (a frame over the size cap, the client's deadline) as a plain end of
    stream, so the end of a ``stream`` is confirmed by sending the reply's initial metadata, which fails on
    a broken call. A unary request arrives whole or not at all."""
    try:
        if len(first):
            writer.add(first)
        async for frame in frames:
            writer.add(frame)
        finite = writer.finish()
    except FrameError as e:
        raise invalid("size", str(e)) from None
    remaining = ctx.time_remaining()
    try:
        if remaining is not None and remaining <= 0:
            raise TimeoutError
        if stream:
            await ctx.send_initial_metadata(())
    except Exception:
        raise Rejected("CANCELLED", "broken_stream", "the stream broke before its end") from None
    return finite


async def one(frame: bytes) -> AsyncIterator[bytes]:
    yield frame

