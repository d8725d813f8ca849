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


INDEX_IN_USE = "worker index in use"
"""What a refusal of a second live process at a worker's index says first: a restarted worker retries until
the first process's lease lapses (``cluster.lease_s``)."""


def index_in_use(worker: int, silent_s: float, lease_s: float) -> Rejected:
    return Rejected("ALREADY_EXISTS", "index_in_use",
                    f"{INDEX_IN_USE} {worker}: another live process holds it (heard from {silent_s:.1f}s ago); "
                    f"a second process may take it once the first has been silent for cluster.lease_s "
                    f"({lease_s:g}s)")


def superseded(worker: int) -> Rejected:
    return precondition("superseded", f"worker {worker}'s index is held by a newer process, which took it after "
                                      "this one was silent for cluster.lease_s: this process must stop")


def precondition(reason: str, message: str) -> Rejected:
    return Rejected("FAILED_PRECONDITION", reason, message)
