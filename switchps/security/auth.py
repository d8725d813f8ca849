"""Credentials: one run secret, a token per role, and what each role may call.

A token is ``<role>.<index>.<mac>`` with ``mac = HMAC-SHA256(secret, "switchps/<role>/<index>")``, sent
as ``authorization: Bearer <token>`` call metadata. So one secret configures a whole cluster, each
process holds only its own role's token, and a token names the one identity it grants: worker ``i``
can push and register only as worker ``i``. Verification recomputes the MAC and compares in constant
time (``hmac.compare_digest``); no token is cached.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from switchps.refusals import Rejected

METADATA_KEY = "authorization"
ROLES = ("worker", "evaluator", "status", "shard")
PERMITTED: dict[str, frozenset[str]] = {
    "worker": frozenset({"Register", "Attach", "Init", "Push", "PushSmall", "Pull", "InitPart", "PushPart",
                        "PullPart", "Leave"}),
    "evaluator": frozenset({"Pull", "Eval", "Status", "PullPart"}),
    "status": frozenset({"Status"}),
    "shard": frozenset({"Follow"}),
}
"""The RPCs each role may call; a worker's also carry its index, which must be its own, and a follower
shard's (``shard``) its shard index."""
MAX_TOKEN_CHARS = 128


@dataclass(frozen=True)
class Caller:
    """Who a verified token says the caller is; ``index`` is a worker's, 0 for the other roles."""

    role: str
    index: int = 0

    def __str__(self) -> str:
        return f"worker {self.index}" if self.role == "worker" else self.role


def new_secret() -> str:
    """A fresh run secret: 32 random bytes, hex-encoded."""
    return secrets.token_hex(32)


def write_private(path: Path, data: bytes) -> Path:
    """Create ``path`` holding ``data``, readable by its owner only from the moment it exists; an
    existing file is never overwritten (``FileExistsError``)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


def _mac(secret: bytes, role: str, index: int) -> str:
    return hmac.new(secret, f"switchps/{role}/{index}".encode(), hashlib.sha256).hexdigest()


def token(secret: bytes, role: str, index: int = 0) -> str:
    """The credential of ``role`` (worker ``index``) under the run ``secret``."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
    return f"{role}.{index}.{_mac(secret, role, index)}"


def metadata(tok: str) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries ``tok``."""
    return ((METADATA_KEY, f"Bearer {tok}"),)


def _claim(header: str) -> tuple[Caller, str] | None:
    """The caller a well-formed ``authorization`` header names, and its MAC; None if malformed."""
    scheme, _, tok = header.partition(" ")
    role, _, rest = tok.partition(".")
    index, _, mac = rest.partition(".")
    if scheme != "Bearer" or len(tok) > MAX_TOKEN_CHARS or role not in ROLES or not index.isdigit() \
            or len(index) > 6:
        return None
    return Caller(role, int(index)), mac


def verify(secret: bytes, header: str | None) -> Caller:
    """The caller an ``authorization`` header proves, or ``Rejected`` (UNAUTHENTICATED)."""
    if header is None:
        raise Rejected("UNAUTHENTICATED", "no_token", "no credentials: this PS requires a token")
    claim = _claim(header)
    expected = _mac(secret, claim[0].role, claim[0].index) if claim else ""
    if claim is None or not hmac.compare_digest(expected.encode(), claim[1].encode()):
        raise Rejected("UNAUTHENTICATED", "bad_token", "invalid credentials")
    return claim[0]


def admitted(header: str | None) -> Caller:
    """The caller of a call whose header ``verify`` has already accepted: parsed, not checked again."""
    claim = _claim(header or "")
    if claim is None:
        raise Rejected("UNAUTHENTICATED", "bad_token", "invalid credentials")
    return claim[0]


def authorize(caller: Caller, rpc: str) -> None:
    """``Rejected`` (PERMISSION_DENIED) unless ``caller``'s role may call ``rpc``."""
    if rpc not in PERMITTED[caller.role]:
        raise Rejected("PERMISSION_DENIED", "role", f"{caller} may not call {rpc}")


def authorize_worker(caller: Caller, worker: int, rpc: str) -> None:
    """``Rejected`` (PERMISSION_DENIED) unless ``caller`` may act as ``worker`` (-1: not a worker)."""
    allowed = caller.index == worker if caller.role == "worker" else worker == -1
    if not allowed:
        who = f"worker {worker}" if worker >= 0 else "a non-worker"
        raise Rejected("PERMISSION_DENIED", "identity", f"{caller} may not call {rpc} as {who}")
