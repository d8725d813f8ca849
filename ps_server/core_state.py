"""What a checkpoint holds of the core: everything it and its policy know, as plain data.

Times are saved relative to the moment of saving and restored relative to the moment of loading,
so a resumed run's clock continues from the checkpoint (the outage and the work lost in it are not
counted as training time). Arrays (a round's gradient sum in flight) are copied: the round goes on
changing after the checkpoint is taken.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from switchps.config import ProtocolSpec
from switchps.ps_server import observer
from switchps.ps_server.events import load_membership, membership_state
from switchps.ps_server.overhead import SwitchRecord
from switchps.ps_server.protocols import make_protocol

if TYPE_CHECKING:  # the core calls these two functions; they never call it
    from switchps.ps_server.core import Core


def save(core: Core, now: float) -> dict[str, Any]:
    """The core's state at ``now``."""
    return _copied({
        "spec": core.spec.model_dump(), "protocol": core.protocol.state_dict(),
        "members": membership_state(core.members),
        "version": core.version, "samples": core.samples,
        "batches": {str(w): b for w, b in core.batches.items()},
        "orders": core.orders.state_dict(),
        "lr_scale": core.lr_scale, "momentum": core.momentum, "since": core._since,
        "initialized": core.initialized, "finished": core.done,
        "elapsed_s": None if core.started_at is None else now - core.started_at,
        "recent": observer.state(core.recent),
        "policy": None if core.policy is None else core.policy.state_dict(),
        "receipts": core.receipts.state_dict(),
        "switches": [[s.decided_at - now, s.to, s.step_s, None if s.first_update_at is None
                      else s.first_update_at - now] for s in core.switches],
        "update_times": [[t - now, p] for t, p in core.update_times],
        "switched_at": core.switched_at, "restore": core.restore,
    })


def load(core: Core, d: dict[str, Any], now: float) -> None:
    """Continue ``core`` from ``save``'s data at time ``now``."""
    load_membership(core.members, d["members"], now)
    core.spec = ProtocolSpec.model_validate(d["spec"])
    core.protocol = make_protocol(core.spec, core.recycle)
    core.protocol.enter(None, core.members, now)
    core.protocol.load_state_dict(d["protocol"])
    core.version, core.samples = d["version"], d["samples"]
    core.batches = {int(w): b for w, b in d["batches"].items()}
    core.orders.load_state_dict(d["orders"])
    core.lr_scale, core.momentum, core._since = d["lr_scale"], d["momentum"], d["since"]
    core.initialized = d["initialized"]
    core.started_at = None if d["elapsed_s"] is None else now - d["elapsed_s"]
    core.first_register = core.started_at
    core.finished_at = now if d["finished"] else None
    observer.restore(core.recent, d["recent"])
    if core.policy is not None and d["policy"] is not None:
        core.policy.load_state_dict(d["policy"])
    core.receipts.load_state_dict(d["receipts"])
    core.switches = [SwitchRecord(now + at, to, step_s, None if first is None else now + first)
                     for at, to, step_s, first in d["switches"]]
    core.update_times = [(now + t, p) for t, p in d["update_times"]]
    core.switched_at, core.restore = d["switched_at"], d["restore"]
    core.resumed = True


def _copied(x: Any) -> Any:
    """``x`` with every array copied (dicts and lists rebuilt, other values shared)."""
    if isinstance(x, np.ndarray):
        return x.copy()
    if isinstance(x, dict):
        return {k: _copied(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_copied(v) for v in x]
    return x
