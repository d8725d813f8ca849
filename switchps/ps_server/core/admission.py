"""The core's admission: what a worker's next push may claim (``Orders``), and which of its pushes arrived
(``Receipts``), so that a push claims no more than its work order allowed and none is applied twice.

**Orders.** The work orders the core has issued, and what they allow a push to claim.

A worker computes a step under the work order it was last given, so the order bounds what its push may
report: no more samples than the budget, and no more compute (with injected delays) than the time since
the order was issued. A push resent after a lost reply was computed under the order before, so each
bound spans the last two orders. A re-registration or a pull is not a step boundary and only widens the
bounds. Orders issued before a restart have no time in this process: their pushes are bounded by the
run's span plus ``RESTART_SLACK_S`` (the checkpoint's clock leaves out the work the crash lost).

**Receipts.** Which pushes the PS has received, so that a retried push is recognised and never applied twice.

A push is named by (worker, session, step): ``session`` is random per worker process and ``step``
counts that process's pushes; session 0 leaves a push unnamed (a client that never retries). A worker
whose reply was lost (a broken connection, a PS restart) sends the same push again; the core then either hands the retry the original's place in the round
it waits in, or, if the original was already applied or dropped, drops the copy and says so (``repeated``).
The receipts are part of the core's checkpoint, saved with the model they describe.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from switchps.ps_server.core.events import Push, StepReport, WorkOrder, absolute, relative
from switchps.refusals import invalid

RATE = 1.05
"""Another host's clock may run this much faster than the PS's."""
SLACK_S = 1.0
"""Added to every time bound: timer resolution, and a reply's time on the wire."""
RESTART_SLACK_S = 3600.0
"""What a push computed before a PS restart may claim beyond the resumed run's span."""
MAX_FACTOR = 1e6
"""The largest slowdown factor a step may report (the straggler config's factors are >= 1)."""


@dataclass
class Order:
    """What a worker's next push may claim: at most ``samples``, computed since ``since`` (None: before a
    restart)."""

    samples: int
    since: float | None
    budget: int  # the newest order's sample budget
    issued_at: float | None  # when the newest order was issued
    local_steps: int = 0  # at most this many local steps (0: a gradient)
    local_budget: int = 0  # the newest order's local steps


class Orders:
    """Per worker, the bounds its latest work orders set (see the module docstring)."""

    def __init__(self) -> None:
        self.current: dict[int, Order] = {}

    def issue(self, worker: int, order: WorkOrder, now: float, step: bool = True) -> WorkOrder:
        """Note ``order`` given to ``worker`` at ``now``, for a new step (``step``) or the same step again (a
        registration, a pull), which only widens the bounds; a reader (-1) computes nothing."""
        if worker < 0:
            return order
        samples, old = order.sample_budget, self.current.get(worker)
        steps = order.local.steps if order.local else 0
        if old is None:
            self.current[worker] = Order(samples, now, samples, now, steps, steps)
        elif step:
            self.current[worker] = Order(max(samples, old.budget), old.issued_at, samples, now,
                                         max(steps, old.local_budget), steps)
        else:
            self.current[worker] = Order(max(samples, old.samples), old.since, max(samples, old.budget),
                                         old.issued_at, max(steps, old.local_steps), max(steps, old.local_budget))
        return order

    def check(self, worker: int, samples: int, report: StepReport, now: float, span_s: float) -> None:
        """Raise ``Rejected`` (INVALID_ARGUMENT) unless a push's claims fit its orders; ``span_s`` is how long
        the run has gone on, which bounds every duration."""
        values = (report.step, report.compute_s, report.sleep_s, report.send_s, report.wait_s,
                  report.delay_sleep_s, report.delay_comm_s, report.delay_factor, abs(report.loss_sum))
        if not all(math.isfinite(x) and x >= 0 for x in values):
            raise invalid("stats", "step statistics must be finite, with durations and step >= 0")
        order = self.current.get(worker)
        allowed = order.samples if order else 0
        if not 0 < samples <= allowed:
            raise invalid("samples", f"sample count {samples} is not in [1, {allowed}], the budget of this "
                                     "worker's work order")
        local = order.local_steps if order else 0
        if not 0 <= report.local_steps <= local:
            raise invalid("stats", f"local_steps {report.local_steps} is not in [0, {local}], what this "
                                   "worker's work orders asked")
        losses = report.local_loss_sums
        if len(losses) not in (0, report.local_steps) or not all(math.isfinite(x) and x >= 0 for x in losses):
            raise invalid("stats", "local_loss_sums must hold one finite loss >= 0 per local step, or none")
        busy = report.compute_s + report.sleep_s
        since = order.since if order is not None else None
        if since is not None and busy > RATE * (now - since) + SLACK_S:
            raise invalid("stats", f"compute_s + sleep_s = {busy:.6g} s exceeds the "
                                   f"{RATE * (now - since) + SLACK_S:.6g} s since the work order was issued")
        limit = RATE * span_s + SLACK_S + (RESTART_SLACK_S if since is None else 0.0)
        durations = {"send_s": report.send_s, "wait_s": report.wait_s, "delay_sleep_s": report.delay_sleep_s,
                     "delay_comm_s": report.delay_comm_s, "compute_s + sleep_s": busy}
        for name, value in durations.items():
            if value > limit:
                raise invalid("stats", f"{name} = {value:.6g} s exceeds the run's {limit:.6g} s")
        if report.delay_factor > MAX_FACTOR:
            raise invalid("stats", f"delay_factor {report.delay_factor:.6g} exceeds {MAX_FACTOR:g}")

    def state_dict(self, now: float) -> dict[str, Any]:
        return {str(w): [o.samples, relative(o.since, now), o.budget, relative(o.issued_at, now), o.local_steps,
                         o.local_budget] for w, o in self.current.items()}

    def load_state_dict(self, d: dict[str, Any], now: float) -> None:
        self.current = {int(w): Order(int(o[0]), absolute(o[1], now), int(o[2]), absolute(o[3], now), *o[4:])
                        for w, o in d.items()}

    def restarted(self) -> None:
        """The orders' times belong to the crashed process's clock (a checkpoint's clock leaves out the
        outage and the work it lost): only the run's span bounds their pushes now."""
        self.current = {w: Order(o.samples, None, o.budget, None, o.local_steps, o.local_budget)
                        for w, o in self.current.items()}


class Receipts:
    """The newest push received from each worker."""

    def __init__(self) -> None:
        self.last: dict[int, tuple[int, int]] = {}  # worker -> (session, step)
        self.restored: set[int] = set()  # workers whose last receipt predates a restart

    def check(self, worker: int, session: int, step: int) -> None:
        """Raise ``Rejected`` if ``step`` skips ahead of the worker's last push of the same session (a worker
        process pushes once per step). After a restart the pushes the crash lost may be missing, so a
        worker's first receipt since then is taken as it comes."""
        last = self.last.get(worker)
        if session != 0 and last is not None and last[0] == session and worker not in self.restored \
                and step > last[1] + 1:
            raise invalid("stats", f"step {step} skips ahead of this worker's last step {last[1]}")

    def seen(self, p: Push) -> bool:
        """Whether ``p`` repeats a push already received (same session, a step not newer)."""
        last = self.last.get(p.worker)
        return p.session != 0 and last is not None and last[0] == p.session and p.step <= last[1]

    def note(self, p: Push) -> None:
        if p.session != 0:  # session 0: an unnamed push (a client that does not retry)
            self.last[p.worker] = (p.session, p.step)
            self.restored.discard(p.worker)

    def state_dict(self, now: float) -> dict[str, Any]:  # no times
        return {str(w): list(v) for w, v in self.last.items()}

    def load_state_dict(self, d: dict[str, Any], now: float) -> None:
        self.last = {int(w): (int(v[0]), int(v[1])) for w, v in d.items()}

    def restarted(self) -> None:
        """The pushes received after the checkpoint are unknown: each worker's next receipt anchors anew."""
        self.restored = set(self.last)
