"""Shard 0 of a sharded PS: the ordinary ``ParameterServer`` over part 0 of the model, given ``ShardZero``
as its admission (``rpc.admission``).

A registration (and a pull) waits until every follower is attached and, after a resume, restored; a
registration names the partition the worker splits its model by (refused, with one line, if it is not
this PS's); the model's layout is the whole model's, while this shard's store holds part 0
(``partition.part_layout``); a push or the initial values reach the core only once every follower has
accepted its part (``followers.Leader``); and every action the core decides also goes, in order, to the
followers (``Forwarding``; checkpoints too: the checkpointer's ``Parts.followers``). The followers are
told to stop once every worker has been, and after the final checkpoint (``run_ps``), so that they answer
every last part and save the last state.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from switchps.errors import RunDirError, ShardLost
from switchps.protos import switchps_pb2 as pb
from switchps.protos.partition import Partition, of_layout, part_layout
from switchps.ps_server.checkpoint import Checkpoint
from switchps.ps_server.core.actions import (Action, Apply, Count, Executor, Free, Join, Record, Release,
                                             SetOptimizer)
from switchps.ps_server.records import RunRecorder
from switchps.ps_server.rejections import refuse
from switchps.ps_server.rpc.admission import Header, Served, layout_differs
from switchps.ps_server.shard.action_wire import to_wire
from switchps.ps_server.shard.followers import INIT_STEP, Key, Leader, part_key
from switchps.refusals import Rejected, precondition


class ShardZero:
    """The deciding shard's admission; ``leader`` holds the followers (``switchps.ps_server.shard.followers``)."""

    def __init__(self, leader: Leader, max_bytes: int, rec: RunRecorder) -> None:
        """``max_bytes``: ``runtime.shard_max_mb``, how finely the model is cut (the partition is a function
        of it)."""
        self.leader, self.max_bytes, self.rec = leader, max_bytes, rec
        self.model_layout: pb.Layout | None = None
        self.partition: Partition | None = None

    @property
    def followers(self) -> Leader:
        return self.leader

    def bind(self, end: Callable[[Exception], None]) -> None:
        """A follower that leaves stops the run (it can be resumed); one that cannot resume, too."""
        self.leader.on_lost = lambda why, resumable: end(
            ShardLost(f"{why}; resume the run (--resume) to go on from its last checkpoint") if resumable
            else RunDirError(why))

    def executor(self, local: Executor) -> Executor:
        return Forwarding(local, self.leader)

    def adopt(self, req: pb.RegisterRequest, held: pb.Layout | None) -> pb.Layout:
        """The first registration's layout and its partition become the model's; this shard's own layout
        is part 0's (after a resume, the one restored, ``held``, which the worker's must then split into)."""
        self.leader.check_attached()
        shards = self.leader.followers + 1
        partition = self.partition or of_layout(req.layout, shards, self.max_bytes)
        model = self.model_layout or req.layout
        if req.layout.digest != model.digest or \
                (held is not None and part_layout(model, partition, 0).digest != held.digest):
            raise layout_differs(req.worker)
        if not all(partition.sizes()):
            raise precondition("partition", f"the model has fewer pieces than the {shards} shards (sizes "
                                            f"{partition.sizes()}): lower runtime.shard_max_mb or list fewer shards")
        if req.shard_partition != partition.digest:
            raise precondition("partition", f"worker {req.worker}: its partition of the model over {shards} "
                                            "shards differs from the PS's (the same cluster.ps list and "
                                            "runtime.shard_max_mb on every role?)")
        if self.model_layout is None:
            self.model_layout, self.partition = model, partition
            self.leader.adopt(model)
            self.rec.event("model_partitioned", digest=partition.digest, sizes=partition.sizes(),
                           pieces=partition.describe())
            return part_layout(model, partition, 0)
        assert held is not None
        return held

    def check_ready(self) -> None:
        """``Rejected`` (UNAVAILABLE: a client retries) until every follower is attached."""
        self.leader.check_attached()

    async def accepted(self, h: Header) -> float:
        """Every follower's verdict on its part (awaited holding the worker's slot, so a worker that sends
        shard 0 pushes without parts holds at most ``receiving.EACH`` of them here): the sum of their parts'
        squared norms, which the service adds to part 0's to bound the whole push's."""
        return await self.leader.verdict(_key(h))

    def admitted(self, h: Header, push_id: int | None) -> None:
        """The followers' parts are named: a push's by its push id (``Leader.keys``), the initial values'
        become every part's values."""
        if push_id is None:
            self.leader.broadcast(pb.ShardAction(initialize=part_key(_key(h))))
        else:
            self.leader.keys[push_id] = _key(h)

    def refused(self, h: pb.PushHeader, why: str) -> None:
        """A push refused here is dropped on every shard."""
        self.leader.drop(_key(h), why)

    def resumed(self, ckpt: Checkpoint) -> None:
        """Each follower restores the part whose digest shard 0's checkpoint lists."""
        self.leader.resume = (ckpt.version, shard_manifest(ckpt, self.leader.followers))

    def methods(self, ps: Served) -> dict[str, grpc.RpcMethodHandler]:
        async def follow(request_iterator: object, ctx: grpc.aio.ServicerContext) -> AsyncIterator[pb.ShardAction]:
            """A follower's stream (``Leader.follow``); a refused one gets its status, counted as ``follow:...``."""
            caller = ps.guard.admitted(ctx.invocation_metadata()) if ps.guard else None
            try:
                async for action in self.leader.follow(ctx, caller):
                    yield action
            except Rejected as r:
                refuse(ctx, ps.count_rejection, "follow", r)

        # the follower's messages are parsed by ``Leader.follow`` (``requests.parse``), so garbage is refused, counted
        return {"Follow": grpc.stream_stream_rpc_method_handler(follow, None, pb.ShardAction.SerializeToString)}


@dataclass
class Forwarding:
    """Shard 0's executor: each action goes to the followers (``action_wire``) and is carried out here
    (``local``), in the order the core decided them; a push's name is forgotten at its release."""

    local: Executor
    leader: Leader

    def _send(self, a: Action) -> None:
        msg = to_wire(a, self.leader.keys)
        if msg is not None:
            self.leader.broadcast(msg)

    def join(self, a: Join) -> None:
        self._send(a)
        self.local.join(a)

    def free(self, a: Free) -> None:
        self._send(a)
        self.local.free(a)

    def apply(self, a: Apply) -> None:
        self._send(a)
        self.local.apply(a)

    def release(self, a: Release) -> None:
        self._send(a)
        self.leader.keys.pop(a.push_id, None)
        self.local.release(a)

    def set_optimizer(self, a: SetOptimizer) -> None:
        self._send(a)
        self.local.set_optimizer(a)

    def record(self, a: Record) -> None:
        self._send(a)
        self.local.record(a)

    def count(self, a: Count) -> None:
        self._send(a)
        self.local.count(a)


def shard_manifest(ckpt: Checkpoint, followers: int) -> dict[str, str]:
    """The followers' part digests in shard 0's checkpoint; ``RunDirError`` if it was made by a PS with
    another number of shards."""
    manifest = ckpt.state.get("shards") or {}
    if sorted(manifest) != [str(k) for k in range(1, followers + 1)]:
        raise RunDirError(f"{ckpt.path}: made by a PS of {len(manifest) + 1} shards; cluster.ps lists "
                          f"{followers + 1} (a resume keeps the number of shards)")
    return dict(manifest)


def _key(h: Header) -> Key:
    """The name every shard knows a payload by: a push's, or the initial values' (step -1)."""
    if isinstance(h, pb.InitHeader):
        return h.worker, 0, INIT_STEP, 0
    return h.worker, h.session, h.stats.step, h.attempt
