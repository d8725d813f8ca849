"""A core ``WorkOrder`` as the wire's ``pb.WorkOrder``, and back (a follower hears shard 0's releases): the
one translation, for the service's replies and for shard 0's forwarded releases."""

from __future__ import annotations

from switchps.config.optimizer import OptimizerSpec
from switchps.protos import orders, switchps_pb2 as pb
from switchps.ps_server.core.events import Local, WorkOrder


def to_wire(o: WorkOrder) -> pb.WorkOrder:
    """``o`` as a worker receives it."""
    local = None if o.local is None else pb.LocalSteps(
        steps=o.local.steps, batch=o.local.batch, inner_optimizer=o.local.inner.model_dump_json(),
        reset_inner_state=o.local.reset)
    return pb.WorkOrder(protocol=o.protocol, version=o.version, sample_budget=o.sample_budget,
                        time_budget_s=orders.to_wire(o.time_budget_s), micro_batch=o.micro_batch, stop=o.stop,
                        pipeline=o.pipeline, local=local)


def from_wire(w: pb.WorkOrder) -> WorkOrder:
    """The order ``w`` says (``to_wire``'s inverse)."""
    local = Local(w.local.steps, w.local.batch, OptimizerSpec.model_validate_json(w.local.inner_optimizer),
                  w.local.reset_inner_state) if w.HasField("local") else None
    return WorkOrder(w.protocol, w.version, w.sample_budget, orders.from_wire(w.time_budget_s), w.micro_batch,
                     w.stop, w.pipeline, local)
