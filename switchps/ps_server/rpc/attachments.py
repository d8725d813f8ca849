"""The shared-memory segments of the workers on the PS's host (``protos/segment.py``), one per worker:
attaching again (after a restart of either side) replaces it; and the Unix socket their segments and
pushes come through (``local_pushes``). Used on the event loop only."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from functools import partial

import numpy as np

from switchps.protos.codec import COPIES, PayloadWriter
from switchps.protos import switchps_pb2 as pb
from switchps.protos.wire_dtype import narrow
from switchps.protos.segment import NONCE_BYTES, NOT_ATTACHED, Segment, sealed_nonce
from switchps.ps_server.rpc.local_pushes import LocalPushes, Pushes
from switchps.ps_server.snapshot import Snapshot
from switchps.refusals import invalid, precondition, unknown_worker


class Attachments:
    """Who attached which segment; ``Rejected`` for a request no worker of this PS would make."""

    def __init__(self, wire: str = "float32") -> None:
        self.wire = wire  # the type of the segments' areas (``runtime.wire_dtype``)
        self._segments: dict[int, Segment] = {}
        self._expected: dict[int, tuple[bytes, int]] = {}
        """Per worker, its last ``Attach`` whose segment has not come yet: the nonce and the areas' size."""
        self.socket = ""
        """Where attached workers send their segments and pushes ('' if nowhere: ``listen``)."""
        self._local: LocalPushes | None = None

    def listen(self, ps: Pushes) -> None:
        """Open ``ps``'s Unix socket for the segments and pushes of workers on this host (on the running
        event loop)."""
        self._local = LocalPushes.open(ps)  # held here: it holds its serving task
        self.socket = self._local.path if self._local is not None else ""

    def attach(self, req: pb.AttachRequest, registered: bool, nbytes: int) -> pb.AttachReply:
        """Expect ``req.worker``'s segment through the socket; ``nbytes``: the model's payload (a PS shard's
        part), which its areas must hold."""
        if not registered:
            raise unknown_worker(req.worker)
        if req.name:
            raise invalid("segment", "a segment has no name: its descriptor comes through the PS's socket")
        if req.nbytes != nbytes:
            raise invalid("size", f"a segment of {req.nbytes}-byte areas for a payload of {nbytes} bytes")
        if len(req.nonce) != NONCE_BYTES or not any(req.nonce):
            raise invalid("segment", f"a segment's nonce is {NONCE_BYTES} random bytes, not {len(req.nonce)} "
                                     "or all zero")
        if not self.socket:
            return pb.AttachReply(attached=False, note="the PS has no Unix socket to take a segment through")
        self._expected[req.worker] = (req.nonce, req.nbytes)
        return pb.AttachReply(attached=True, socket=self.socket)

    def adopt(self, fds: list[int], authorize: Callable[[int], None]) -> None:
        """Map the segment whose descriptor came with a socket connection's first frame, for the worker whose
        ``Attach`` sent the nonce it holds; ``authorize(worker)``: ``Rejected`` unless the connection's token
        is that worker's. The descriptors stay the caller's to close."""
        if len(fds) != 1:
            raise invalid("segment", f"the first frame carries one descriptor, its segment's, not {len(fds)}")
        nonce = sealed_nonce(fds[0])
        worker = next((w for w, (n, _) in self._expected.items() if hmac.compare_digest(n, nonce)), None)
        if worker is None:
            raise invalid("segment", "no Attach sent the nonce this segment holds")
        authorize(worker)
        self._segments[worker] = Segment.adopt(fds[0], nonce, self._expected[worker][1], self.wire)
        del self._expected[worker]

    def payload(self, worker: int, inline: memoryview) -> tuple[Segment, memoryview]:
        """A shared push's segment and its payload (read by the caller's copy, then checked there)."""
        segment = self._segments.get(worker)
        if segment is None:
            raise precondition("not_attached", f"worker {worker} {NOT_ATTACHED}")
        if len(inline):
            raise invalid("size", "a push through a segment carries no bytes of its own")
        return segment, segment.grad.data.cast("B")


async def write_values(segment: Segment, snapshot: Snapshot) -> None:
    """A version's values into the segment's values area (of wire values): straight from the model's
    (narrowed as copied) if the snapshot is still deferred, else chunk by chunk as they are published."""
    if snapshot.deferred(partial(_copy, segment.values)):
        return
    writer = PayloadWriter(segment.values)
    async for chunk in snapshot.achunks():
        writer.add(chunk)
    writer.finish()


def _copy(out: np.ndarray, values: np.ndarray) -> bool:
    narrow(values, out)
    COPIES.add(out.nbytes)
    return True
