"""Which pushes the PS has received, so that a retried push is recognised and never applied twice.

A push is named by (worker, session, step): ``session`` is random per worker process and ``step``
counts that process's pushes; session 0 leaves a push unnamed (a client that never retries). A worker whose reply was lost (a broken connection, a PS restart)
sends the same push again; the core then either hands the retry the original's place in the round
it waits in, or, if the original was already applied or dropped, drops the copy and says so (``repeated``).
The receipts are part of the core's checkpoint, saved with the model they describe.
"""

from __future__ import annotations

from typing import Any

from switchps.ps_server.events import Push


class Receipts:
    """The newest push received from each worker."""

    def __init__(self) -> None:
        self.last: dict[int, tuple[int, int]] = {}  # worker -> (session, step)

    def seen(self, p: Push) -> bool:
        """Whether ``p`` repeats a push already received (same session, a step not newer)."""
        last = self.last.get(p.worker)
        return p.session != 0 and last is not None and last[0] == p.session and p.step <= last[1]

    def note(self, p: Push) -> None:
        if p.session != 0:  # session 0: an unnamed push (a client that does not retry)
            self.last[p.worker] = (p.session, p.step)

    def state_dict(self) -> dict[str, Any]:
        return {str(w): list(v) for w, v in self.last.items()}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.last = {int(w): (int(v[0]), int(v[1])) for w, v in d.items()}
