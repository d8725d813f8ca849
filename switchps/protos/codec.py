"""Frame codec for tensor RPCs: a protobuf header plus raw values (float32, or ``runtime.wire_dtype``'s).

Frame 0 is ``u32 little-endian header length || header || inline payload``;
every later frame is raw payload. A reply's payload no larger than ``INLINE_BYTES``
rides inside frame 0, and so does a push's no larger than ``WHOLE_BYTES`` or a chunk
(``whole_limit``): such a push is one unary message each way, which costs gRPC's
synchronous client no thread (a streamed call starts two). Larger payloads follow as
``chunk_bytes`` frames, which keeps each message under gRPC's limits however large the
model is, and lets the PS check and apply one chunk while the next is in flight.

Decoding never builds an intermediate copy of the payload: frames are viewed
with ``np.frombuffer`` and copied once, straight into their destination.

A server reads a request with ``protos/requests.py``.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import AsyncIterator, Iterable, Iterator, TypeVar

import numpy as np
from google.protobuf.message import DecodeError, Message

from switchps.protos import wire_dtype


LENGTH = struct.Struct("<I")
"""The length prefix of frame 0's header (and of each frame through a PS's Unix socket)."""
INLINE_BYTES = 64 * 1024
SQUARES_BLOCK = 2**20
"""Values per float64 block when a float32 sum of squares overflows (``sum_squares``): 8 MB."""
DEFAULT_CHUNK_BYTES = 2 * 1024 * 1024
# A push this large (or a chunk, if larger) is one message: at 3 MB, streamed 3.6 ms and 4.8 ms of CPU
# on both sides, one message 2.5 and 3.1 ms; streamed in 4 MiB chunks instead of 2, 100 MB took 10-15 %
# longer (``bench/transport.py``), so the two sizes are separate.
WHOLE_BYTES = 4 * 1024 * 1024
# What a client accepts (replies are one PS chunk of at most 32 MiB, plus a header).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Room for a header (or a Register's layout) beside one chunk in a message the PS receives.
HEADER_BYTES = 1024 * 1024
ALIGN = 64
"""A cache line, and the boundary on which TensorFlow reads a host array in place (``aligned_empty``)."""

M = TypeVar("M", bound=Message)


def aligned_empty(size: int) -> np.ndarray:
    """An uninitialized float32 vector of ``size`` starting on an ``ALIGN``-byte boundary (NumPy's own
    start on 16): TF takes such a vector as a tensor without copying it (``workload/tensorflow/gradients``)."""
    raw = np.empty(4 * size + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start : start + 4 * size].view(np.float32)


class FrameError(ValueError):
    """A frame stream that does not follow the format."""


@dataclass
class CopyCounter:
    """Counts payload bytes copied, so benchmarks can report copies per byte."""

    bytes_copied: int = 0

    def add(self, n: int) -> None:
        self.bytes_copied += n


COPIES = CopyCounter()


def array_chunks(flat: np.ndarray, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
    """Cut a 1-D array (float32, or wire values) into bytes chunks of whole values lazily, as the sender asks
    for them.

    One copy per byte, unavoidable because gRPC sends ``bytes``; cutting lazily
    overlaps it with sending.
    """
    raw = flat.view(np.uint8)
    if flat.dtype != np.float32:  # a narrow payload's frames hold whole values (a float32 value may be split)
        chunk_bytes -= chunk_bytes % flat.itemsize
    for i in range(0, raw.size, chunk_bytes):
        chunk = raw[i : i + chunk_bytes].tobytes()
        COPIES.add(len(chunk))
        yield chunk


def _frame0(header: Message) -> bytes:
    head = header.SerializeToString()
    return LENGTH.pack(len(head)) + head


def encode(header: Message, chunks: Iterable[bytes] = (), nbytes: int = 0) -> Iterator[bytes]:
    """Frames for ``header`` and a payload of ``nbytes`` given as ``chunks``.

    A payload of at most ``INLINE_BYTES`` rides inside frame 0, so it is one message.
    """
    if 0 < nbytes <= INLINE_BYTES:
        COPIES.add(nbytes)
        yield _frame0(header) + b"".join(chunks)
        return
    yield _frame0(header)
    yield from chunks


async def aencode(header: Message, chunks: AsyncIterator[bytes], nbytes: int) -> AsyncIterator[bytes]:
    """``encode`` for chunks that arrive asynchronously (an asyncio server's replies)."""
    if 0 < nbytes <= INLINE_BYTES:
        COPIES.add(nbytes)
        yield _frame0(header) + b"".join([c async for c in chunks])
        return
    yield _frame0(header)
    async for chunk in chunks:
        yield chunk


def encode_array(header: Message, flat: np.ndarray, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
    return encode(header, array_chunks(flat, chunk_bytes), flat.nbytes)


def whole_frame(header: Message, flat: np.ndarray) -> bytes:
    """Frame 0 carrying all of ``flat`` (a payload of at most ``whole_limit``): one copy per byte."""
    COPIES.add(flat.nbytes)
    return b"".join((_frame0(header), flat.data))


def joined(frames: list[bytes]) -> bytes:
    """Frames as one message: a lone frame as it is, more joined into a copy (counted)."""
    if len(frames) == 1:
        return frames[0]
    message = b"".join(frames)
    COPIES.add(len(message))
    return message


def whole_limit(chunk_bytes: int) -> int:
    """The largest payload a push sends inside frame 0, as one message: ``WHOLE_BYTES``, or a chunk if larger."""
    return max(chunk_bytes, WHOLE_BYTES)


def decode_header(frame0: bytes, header_type: type[M]) -> tuple[M, memoryview]:
    """Parse frame 0 into its header and the payload bytes inlined after it."""
    if len(frame0) < LENGTH.size:
        raise FrameError("frame 0 is shorter than its length prefix")
    (n,) = LENGTH.unpack_from(frame0)
    if LENGTH.size + n > len(frame0):
        raise FrameError(f"header length {n} exceeds frame 0 ({len(frame0)} bytes)")
    header = header_type()
    try:
        header.ParseFromString(frame0[LENGTH.size : LENGTH.size + n])
    except DecodeError as e:
        raise FrameError(f"header is not a valid {header_type.__name__}: {e}") from None
    return header, memoryview(frame0)[LENGTH.size + n :]


class PayloadWriter:
    """Copies payload frames, one by one as they arrive, straight into ``out``.

    ``wire``: the payload's type (``protos/wire_dtype``) when ``out`` is float32 and the payload narrower:
    each frame is widened as it is copied (frames hold whole values), in the same pass as the check. With
    ``check_finite`` each frame's values are checked for NaN/inf right after they land, so the check
    overlaps with the next frame's transfer; the same pass sums their squares (``squares``: the payload's
    squared L2 norm, which a PS bounds per sample, ``validate``).
    """

    def __init__(self, out: np.ndarray, check_finite: bool = False, wire: str = "float32") -> None:
        self.out, self.check_finite = out, check_finite
        self._item = wire_dtype.itemsize(wire) if out.dtype == np.float32 else out.itemsize
        self._wire = wire if self._item != out.itemsize else ""  # '': bytes copied as they are
        self._dest = out.view(np.uint8)
        self.nbytes = out.size * self._item
        """The payload's bytes."""
        self.pos = 0
        self.squares = 0.0
        """The sum of squares of the values checked so far (``check_finite``); not finite once one is not."""
        self._checked = 0  # values checked: each once, a value split between two frames with the second

    @property
    def finite(self) -> bool:
        return math.isfinite(self.squares)

    def add(self, frame: bytes | memoryview) -> None:
        n, pos = len(frame), self.pos
        if pos + n > self.nbytes:
            raise FrameError(f"payload exceeds the expected {self.nbytes} bytes")
        if not self._wire:
            self._dest[pos : pos + n] = np.frombuffer(frame, np.uint8)
        elif n % self._item:
            raise FrameError(f"a frame of a {self._wire} payload holds whole {self._item}-byte values, not {n} bytes")
        else:
            wire_dtype.widen(wire_dtype.view(frame, self._wire), self.out[pos // self._item : (pos + n) // self._item])
        self.pos += n
        if self.check_finite and self.finite:
            end = self.pos // self._item
            self.squares += sum_squares(self.out[self._checked : end])
            self._checked = end

    def finish(self) -> bool:
        """Check the payload filled ``out`` exactly; returns whether it is all finite (if checked)."""
        COPIES.add(self.pos)
        if self.pos != self.nbytes:
            raise FrameError(f"payload has {self.pos} bytes, expected {self.nbytes}")
        return self.finite


def receive_into(first: memoryview, rest: Iterable[bytes], out: np.ndarray, check_finite: bool = False,
                 wire: str = "float32") -> bool:
    """Copy the payload (``first`` then the ``rest`` frames, of ``wire`` values) into float32 ``out``, exactly
    filling it.

    Returns whether every value is finite when ``check_finite``, else True.
    """
    writer = PayloadWriter(out, check_finite, wire)
    for frame in _frames(first, rest):
        writer.add(frame)
    return writer.finish()


def all_finite(x: np.ndarray) -> bool:
    """Whether every float32 value is finite, without a full-size temporary."""
    return math.isfinite(sum_squares(x))


def sum_squares(x: np.ndarray) -> float:
    """``x·x`` of float32 ``x``: finite exactly when every value is, so it is the finiteness check too.

    A NaN or inf makes the sum of squares non-finite; a finite one proves all values finite. BLAS
    computes it in one pass, 2.2-3.6x faster than NumPy's pairwise ``sum`` (31 KB to 100 MB,
    ``bench/transport.py``'s ``ps_finite_check``). Only a non-finite result, which can also be an
    overflow of finite values above ~1.8e19, needs the exact element-wise check, and then, if every
    value is finite, the sum again in float64 (blocks of ``SQUARES_BLOCK``: no full-size temporary).
    """
    with np.errstate(over="ignore", invalid="ignore"):
        s = float(np.dot(x, x))
    if math.isfinite(s) or not np.isfinite(x).all():
        return s
    blocks = (x[i : i + SQUARES_BLOCK].astype(np.float64) for i in range(0, x.size, SQUARES_BLOCK))
    return sum(float(np.dot(b, b)) for b in blocks)


def _frames(first: memoryview, rest: Iterable[bytes]) -> Iterator[memoryview | bytes]:
    if len(first):
        yield first
    yield from rest


def receive_limit(chunk_bytes: int) -> int:
    """The largest message the PS accepts: one chunk (or an inline payload) and a header.

    gRPC refuses a larger message from its length prefix, before allocating for it, so no frame
    bigger than this is ever allocated on the PS.
    """
    return whole_limit(chunk_bytes) + HEADER_BYTES


def grpc_options(max_message_bytes: int = MAX_MESSAGE_BYTES,
                 max_receive_bytes: int | None = None) -> list[tuple[str, int]]:
    """Channel/server options raising gRPC's 4 MiB default (receiving: ``max_receive_bytes`` if given)."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_receive_bytes or max_message_bytes),
    ]
