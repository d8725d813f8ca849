"""Shard 0 of a sharded PS: the ordinary ``ParameterServer`` over part 0 of the model, plus the followers.

It differs from an unsharded PS only in overrides: a registration (and a pull) waits until every
follower is attached and, after a resume, restored; a registration names the partition the worker
splits its model by (refused, with one line, if it is not this PS's); the model's layout is the whole
model's, while this shard's store holds part 0 (``partition.part_layout``); a push or the initial
values reach the core only once every follower has accepted its part (``shards.Leader``); and every
action the core decides also goes, in order, to the followers (checkpoints too: the checkpointer's
``Parts.followers``). The followers are told to stop once every worker has been, and after the final
checkpoint (``run_ps``), so that they answer every last part and save the last state.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import grpc
import numpy as np

from switchps.security.auth import Caller
from switchps.errors import RunDirError, ShardLost
from switchps.protos import switchps_pb2 as pb
from switchps.protos.partition import Partition, of_layout, part_layout
from switchps.protos.segment import Segment
from switchps.ps_server.core.actions import Action
from switchps.ps_server.core.events import Push, StepReport
from switchps.ps_server.rejections import refuse
from switchps.ps_server.rpc.service import ParameterServer
from switchps.ps_server.shard.followers import INIT_STEP, Key, Leader, part_key
from switchps.ps_server.validate import check_grad_norm
from switchps.refusals import Rejected, precondition


class ShardZero(ParameterServer):
    """The deciding shard; ``leader`` holds the followers (see ``switchps.ps_server.shard.followers``)."""

    leader: Leader
    max_bytes: int
    """``runtime.shard_max_mb``: how finely the model is cut (the partition is a function of it)."""
    model_layout: pb.Layout | None = None
    partition: Partition | None = None
    failed: ShardLost | RunDirError | None = None
    """Why the run stopped before training was over: a follower left (the run can be resumed) or could
    not resume."""

    def sharded(self, leader: Leader, max_bytes: int) -> "ShardZero":
        self.leader, self.max_bytes = leader, max_bytes
        leader.on_lost = self._lost
        return self

    def _lost(self, why: str, resumable: bool) -> None:
        self.failed = ShardLost(f"{why}; resume the run (--resume) to go on from its last checkpoint") \
            if resumable else RunDirError(why)
        for ended in (self.finished, self.final_evaluated, self.all_told_stop):
            ended.set()

    def _adopt(self, req: pb.RegisterRequest) -> bool:
        """The first registration's layout and its partition become the model's; this shard's own layout
        is part 0's (after a resume, the one restored, which the worker's must then split into)."""
        self.leader.check_attached()
        shards = self.leader.followers + 1
        partition = self.partition or of_layout(req.layout, shards, self.max_bytes)
        model = self.model_layout or req.layout
        if req.layout.digest != model.digest or \
                (self.layout is not None and part_layout(model, partition, 0).digest != self.layout.digest):
            raise precondition("layout", f"worker {req.worker}: its model layout differs from the PS's "
                                         "(same model config on every worker?)")
        if not all(partition.sizes()):
            raise precondition("partition", f"the model has fewer pieces than the {shards} shards (sizes "
                                            f"{partition.sizes()}): lower runtime.shard_max_mb or list fewer shards")
        if req.shard_partition != partition.digest:
            raise precondition("partition", f"worker {req.worker}: its partition of the model over {shards} "
                                            "shards differs from the PS's (the same cluster.ps list and "
                                            "runtime.shard_max_mb on every role?)")
        first = self.layout is None
        if self.model_layout is None:
            self.model_layout, self.partition, self.layout = model, partition, part_layout(model, partition, 0)
            self.leader.adopt(model)
            self.rec.event("model_partitioned", digest=partition.digest, sizes=partition.sizes(),
                           pieces=partition.describe())
        return first

    async def pull(self, request: bytes, ctx: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        """As unsharded, once every follower is attached (a client retries UNAVAILABLE meanwhile)."""
        try:
            self.leader.check_attached()
        except Rejected as r:
            await self._reject(ctx, "pull", r)
        async for frame in super().pull(request, ctx):
            yield frame

    async def _receive_init(self, ctx: grpc.aio.ServicerContext) -> tuple[int, pb.Layout, np.ndarray]:
        worker, layout, values = await super()._receive_init(ctx)
        self.leader.broadcast(pb.ShardAction(initialize=part_key(_key(pb.InitHeader(worker=worker)))))
        return worker, layout, values

    async def _accepted(self, h: pb.PushHeader | pb.InitHeader, squares: float = 0.0) -> None:
        """Every follower's verdict on its part (awaited holding the worker's slot, so a worker that sends
        shard 0 pushes without parts holds at most ``model.EACH`` of them here); then the norm bound on the
        whole push (part 0 alone passed it): every part's squares, added up."""
        others = await self.leader.verdict(_key(h))
        if isinstance(h, pb.PushHeader):
            check_grad_norm(squares + others, h.samples, self.max_grad_norm)

    async def _receive_push(self, ctx: grpc.aio.ServicerContext, whole: bytes | None,
                            named: Callable[[pb.PushHeader], None] = lambda h: None,
                            ) -> tuple[Push, StepReport, np.ndarray, Segment | None]:
        """Part 0 of a push, once every follower has accepted its part; a push refused here or by a
        follower is dropped on every shard."""
        keys: list[Key] = []
        try:
            p, report, grad, segment = await super()._receive_push(ctx, whole, lambda h: keys.append(_key(h)))
        except BaseException as e:
            if keys:
                self.leader.drop(keys[0], str(e))
            raise
        p.arrived = self.clock()  # the PS has a push once every shard has its part
        self.leader.keys[p.id] = keys[0]
        return p, report, grad, segment

    def _execute(self, actions: list[Action]) -> None:
        self.leader.forward(actions)
        super()._execute(actions)

    async def _follow(self, request_iterator: object, ctx: grpc.aio.ServicerContext) -> AsyncIterator[pb.ShardAction]:
        """A follower's stream (``Leader.follow``); a refused one gets its status, counted as ``follow:...``."""
        caller: Caller | None = self.guard.admitted(ctx.invocation_metadata()) if self.guard else None
        try:
            async for action in self.leader.follow(ctx, caller):
                yield action
        except Rejected as r:
            refuse(ctx, self.count_rejection, "follow", r)

    def methods(self) -> dict[str, grpc.RpcMethodHandler]:
        # the follower's messages are parsed by ``Leader.follow`` (``codec.parse``), so garbage is refused, counted
        follow = grpc.stream_stream_rpc_method_handler(self._follow, None, pb.ShardAction.SerializeToString)
        return {**super().methods(), "Follow": follow}


def _key(h: pb.PushHeader | pb.InitHeader) -> Key:
    """The name every shard knows a payload by: a push's, or the initial values' (step -1)."""
    if isinstance(h, pb.InitHeader):
        return h.worker, 0, INIT_STEP, 0
    return h.worker, h.session, h.stats.step, h.attempt
