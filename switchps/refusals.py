"""A refused request: the one exception every layer that checks a call raises, and the driver reports.

The core, the model store, the frame reader, the guard and the token checks (``auth``) all refuse
requests; only the gRPC driver turns a refusal into a status. Holding the type here, below all of
them, lets a worker-side module such as ``auth`` refuse without importing the PS.
"""

from __future__ import annotations


class Rejected(Exception):
    """A request that must not touch the model: the gRPC status name and the reason it is counted under."""

    def __init__(self, code: str, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason = code, reason


def invalid(reason: str, message: str) -> Rejected:
    return Rejected("INVALID_ARGUMENT", reason, message)


UNKNOWN_WORKER = "unknown worker id"
"""What a refusal of a worker the PS does not count says first: one that left an elastic run may register again."""


def unknown_worker(worker: int) -> Rejected:
    return invalid("unknown_worker", f"{UNKNOWN_WORKER} {worker}")


def precondition(reason: str, message: str) -> Rejected:
    return Rejected("FAILED_PRECONDITION", reason, message)
