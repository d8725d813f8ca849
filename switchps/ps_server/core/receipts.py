"""Which pushes the PS has received, so that a retried push is recognised and never applied twice.

A push is named by (worker, session, step): ``session`` is random per worker process and ``step``
counts that process's pushes; session 0 leaves a push unnamed (a client that never retries). A worker
whose reply was lost (a broken connection, a PS restart) sends the same push again; the core then either hands the retry the original's place in the round
it waits in, or, if the original was already applied or dropped, drops the copy and says so (``repeated``).
The receipts are part of the core's checkpoint, saved with the model they describe.
"""

from __future__ import annotations

from typing import Any

from switchps.ps_server.events import Push
from switchps.refusals import invalid


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
