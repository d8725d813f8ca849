"""What a PS adds around its core besides its own checks: an unsharded PS (``Alone``) or shard 0 of a
sharded one (``shard.zero.ShardZero``), given to the ``ParameterServer`` at construction.

It decides the model's layout at a registration, whether the PS is ready for clients, when a payload
received whole and valid may go to the core (shard 0: once every follower accepted its part), and how the
core's actions are carried out (shard 0: here, and forwarded to the followers). All of it runs on the
PS's event loop, as the service's handlers do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import grpc

from switchps.protos import switchps_pb2 as pb
from switchps.protos.layout import layout_wire
from switchps.ps_server.checkpoint import Checkpoint
from switchps.ps_server.core.actions import Executor
from switchps.ps_server.rpc.guard import Guard
from switchps.ps_server.shard.followers import Leader
from switchps.refusals import Rejected, precondition

Header = pb.PushHeader | pb.InitHeader


def layout_differs(worker: int) -> Rejected:
    """A registration whose model is not the PS's."""
    return precondition("layout", f"worker {worker}: its model layout differs from the PS's "
                                  "(same model config on every worker?)")


def same_framework(req: pb.RegisterRequest, held: str) -> str:
    """The run's framework once ``req`` registers (``held``: the first registrant's, empty while unknown);
    ``Rejected`` if ``req`` names another, whose model could only differ by its digest. An older client
    names none: its layout's digest alone decides."""
    if held and req.framework and req.framework != held:
        raise precondition("framework", f"worker {req.worker} runs model.framework {req.framework}, the PS's "
                                        f"workers {held}: one framework per run (the same on every worker)")
    return held or req.framework


def same_wire(req: pb.RegisterRequest, wire: str) -> None:
    """``Rejected`` unless ``req``'s layout says the PS's ``runtime.wire_dtype`` (unset: float32, as an older
    client sends): pushes and replies in another type would be read as garbage."""
    said = layout_wire(req.layout)
    if said != wire:
        raise precondition("wire_dtype", f"worker {req.worker} sends runtime.wire_dtype {said}, the PS takes "
                                         f"{wire}: the same runtime.wire_dtype on every role")


class Served(Protocol):
    """What an admission's RPCs need of the service: its guard (set once it serves) and its refusals' count."""

    guard: Guard | None

    def count_rejection(self, rpc: str, r: Rejected) -> None: ...


class Admission(Protocol):
    """The one interface by which a ``ParameterServer`` is shard 0 or an unsharded PS."""

    @property
    def followers(self) -> Leader | None:
        """A sharded PS's other shards (they checkpoint and stop when shard 0 says); None: unsharded."""

    def bind(self, end: Callable[[Exception], None]) -> None:
        """``end(why)`` stops the run before training is over (the service's ``end``)."""

    def executor(self, local: Executor) -> Executor:
        """What carries out the core's actions, given the service's own executor ``local``."""

    def adopt(self, req: pb.RegisterRequest, held: pb.Layout | None) -> pb.Layout:
        """The layout the PS holds once ``req`` registers (``held``: the one it holds, if any); ``Rejected``
        if the worker's model does not fit it."""

    def check_ready(self) -> None:
        """``Rejected`` while the PS cannot serve clients yet."""

    async def accepted(self, h: Header) -> float:
        """Return once the payload ``h`` heads, received whole and valid, may go to the core (the slot and
        buffer are held meanwhile): the squared norm of its other parts, if any; ``Rejected`` if not."""

    def admitted(self, h: Header, push_id: int | None) -> None:
        """The payload ``h`` heads goes to the core (a push, as ``push_id``)."""

    def refused(self, h: pb.PushHeader, why: str) -> None:
        """The push ``h`` heads was refused after its header was read."""

    def resumed(self, ckpt: Checkpoint) -> None:
        """The PS was restored from ``ckpt``."""

    def methods(self, ps: Served) -> dict[str, grpc.RpcMethodHandler]:
        """RPCs served besides the PS's own (``ps``: the service, for its guard and its refusals)."""


class Alone:
    """An unsharded PS: the first registration's layout is the model's; a payload goes to the core as soon
    as it is received whole and valid; the core's actions are carried out here only."""

    followers: Leader | None = None

    def bind(self, end: Callable[[Exception], None]) -> None:
        pass

    def executor(self, local: Executor) -> Executor:
        return local

    def adopt(self, req: pb.RegisterRequest, held: pb.Layout | None) -> pb.Layout:
        adopted = held or req.layout
        if req.layout.digest != adopted.digest:
            raise layout_differs(req.worker)
        return adopted

    def check_ready(self) -> None:
        pass

    async def accepted(self, h: Header) -> float:
        return 0.0

    def admitted(self, h: Header, push_id: int | None) -> None:
        pass

    def refused(self, h: pb.PushHeader, why: str) -> None:
        pass

    def resumed(self, ckpt: Checkpoint) -> None:
        pass

    def methods(self, ps: Served) -> dict[str, grpc.RpcMethodHandler]:
        return {}
