"""The shared-memory segments of the workers on the PS's host (``protos/segment.py``), one per worker:
attaching again (after a restart of either side) replaces it; and the Unix socket their pushes come
through (``local_pushes``). Used on the event loop only."""

from __future__ import annotations

from functools import partial

import numpy as np

from switchps.protos.codec import COPIES, PayloadWriter
from switchps.protos import switchps_pb2 as pb
from switchps.protos.segment import NOT_ATTACHED, Segment
from switchps.ps_server.local_pushes import LocalPushes, Pushes
from switchps.ps_server.model import Snapshot
from switchps.refusals import invalid, precondition


class Attachments:
    """Who attached which segment; ``Rejected`` for a request no worker of this PS would make."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._segments: dict[int, Segment] = {}
        self.socket = ""
        """Where attached workers send their pushes instead of gRPC calls ('' if nowhere: ``listen``)."""
        self._local: LocalPushes | None = None

    def listen(self, ps: Pushes) -> None:
        """Open ``ps``'s Unix socket for the pushes of attached workers (on the running event loop)."""
        self._local = LocalPushes.open(ps)  # held here: it holds its serving task
        self.socket = self._local.path if self._local is not None else ""

    def attach(self, req: pb.AttachRequest, registered: bool) -> pb.AttachReply:
        if not registered:
            raise invalid("unknown_worker", f"unknown worker id {req.worker}")
        if req.nbytes > self.max_bytes:
            raise invalid("size", f"a segment of {req.nbytes} bytes exceeds the model limit")
        segment = Segment.open(req.name, req.nonce, req.nbytes)
        if segment is None:
            return pb.AttachReply(attached=False, note="the segment is not on the PS's host")
        self._segments[req.worker] = segment
        return pb.AttachReply(attached=True, socket=self.socket)

    def payload(self, worker: int, inline: memoryview) -> tuple[Segment, memoryview]:
        """A shared push's segment and its payload (read by the caller's copy, then checked there)."""
        segment = self._segments.get(worker)
        if segment is None:
            raise precondition("not_attached", f"worker {worker} {NOT_ATTACHED}")
        if len(inline):
            raise invalid("size", "a push through a segment carries no bytes of its own")
        return segment, segment.grad.data.cast("B")


async def write_values(segment: Segment, snapshot: Snapshot) -> None:
    """A version's values into the segment's values area: straight from the model's if the snapshot is
    still deferred, else chunk by chunk as they are published."""
    if snapshot.deferred(partial(_copy, segment.values)):
        return
    writer = PayloadWriter(segment.values)
    async for chunk in snapshot.achunks():
        writer.add(chunk)
    writer.finish()


def _copy(out: np.ndarray, values: np.ndarray) -> bool:
    np.copyto(out, values)
    COPIES.add(out.nbytes)
    return True
