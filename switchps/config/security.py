"""The ``security`` section of a run config: the run secret that authenticates every role, and TLS.

A PS refuses to start without a secret unless ``insecure: true`` says so explicitly. `switchps run`
makes a fresh secret for each run (``RUN_DIR/secret``, readable by its owner only), so local runs are
authenticated with no configuration; a cluster started role by role shares one ``secret_file`` (or
``secret_env``). ``switchps.security.auth`` derives each role's credential from the secret.
"""

from __future__ import annotations

import os
import stat
from datetime import datetime, timezone
from pathlib import Path

from pydantic import field_validator, model_validator

from switchps.problems import Problem, Problems, under
from switchps.config.schema import Section
from switchps.config.tls_checks import tls_problems

MIN_SECRET_CHARS = 32
"""A secret shorter than this (after stripping whitespace) is refused: 16 random bytes, hex-encoded."""
SECRET_ROLES = ("ps", "worker", "evaluator")
"""The commands that need a secret from the config: `switchps run` makes one when the config has none."""


def _readable(path: str | None) -> str | None:
    if path is not None and not (Path(path).is_file() and os.access(path, os.R_OK)):
        raise ValueError(f"{path}: not a readable file")
    return path


class TLSSpec(Section):
    """PEM files. The PS serves with ``cert``/``key``; clients verify it against ``ca``. With
    ``require_client_cert`` the PS also verifies each client's certificate against ``ca`` (mTLS), and
    clients present ``client_cert``/``client_key``. Each role needs (and checks) only its own files, so
    a worker host holds no server key."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    client_cert: str | None = None
    client_key: str | None = None
    require_client_cert: bool = False

    def role_problems(self, role: str | None, ps_host: str) -> list[Problem]:
        """The files ``role`` needs that are missing or unreadable, then what a handshake would refuse in
        those it can read (``switchps.config.tls_checks``); ``ps_host`` is the host clients dial, which the
        server certificate must name (checked by the roles that serve with it: ``run`` and ``ps``). A
        simulation opens no connection and needs none."""
        if role is None or role == "simulate":
            return []
        serves = role in ("run", "ps")
        needed = ["ca"] + (["cert", "key"] if serves else [])
        if self.require_client_cert and role != "ps":
            needed += ["client_cert", "client_key"]
        problems: list[Problem] = []
        readable: dict[str, str] = {}
        for f in needed:
            try:
                if (path := _readable(getattr(self, f))) is None:
                    problems.append((f, "required" + (" with require_client_cert: true" if "client" in f else "")))
                else:
                    readable[f] = path
            except ValueError as e:
                problems.append((f, str(e)))
        now = datetime.now(timezone.utc)
        return problems + tls_problems(readable, ps_host if serves else None, now)


class SecuritySpec(Section):
    secret_file: str | None = None
    """A file holding the run secret (at least 32 characters, e.g. `openssl rand -hex 32`), mode 600."""
    secret_env: str | None = None
    """The name of an environment variable holding the run secret, instead of a file."""
    tls: TLSSpec | None = None
    insecure: bool = False
    """Run with no authentication at all (a warning is logged). Only for a trusted, isolated network."""

    @field_validator("secret_file")
    @classmethod
    def _secret_file(cls, v: str | None) -> str | None:
        if v is None:
            return v
        _readable(v)
        if os.stat(v).st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ValueError(f"{v}: readable by other users; chmod 600 {v}")
        return v

    @model_validator(mode="after")
    def _one_way(self) -> "SecuritySpec":
        given = [f for f in ("secret_file", "secret_env") if getattr(self, f) is not None]
        if len(given) == 2:
            raise Problems([("secret_env", "give secret_file or secret_env, not both")])
        if given and self.insecure:
            raise Problems([("insecure", f"true, but {given[0]} is set too: choose one")])
        secret = self.secret_value()
        if secret is not None and len(secret) < MIN_SECRET_CHARS:
            raise Problems([(given[0], f"the secret is shorter than {MIN_SECRET_CHARS} characters")])
        return self

    def role_problems(self, role: str | None, ps_host: str) -> list[Problem]:
        """What stops the command ``role`` from starting: its secret is missing, or its TLS files are
        missing or would fail the handshake with the PS at ``ps_host``."""
        problems = under("tls", self.tls.role_problems(role, ps_host)) if self.tls is not None else []
        if self.secret_env is not None and role not in (None, "simulate") and not os.environ.get(self.secret_env):
            problems.append(("secret_env", f"the environment variable {self.secret_env} is not set"))
        if self.secret_file is None and self.secret_env is None and not self.insecure and role in SECRET_ROLES:
            problems.append(("", "no run secret: set security.secret_file or security.secret_env (the same on "
                                 "every host), or security.insecure: true on a trusted network"))
        return problems

    def secret_value(self) -> bytes | None:
        """The run secret's bytes, or None when the config names none (or its variable is unset)."""
        if self.secret_file is not None:
            return Path(self.secret_file).read_bytes().strip()
        if self.secret_env is not None:
            return os.environ.get(self.secret_env, "").strip().encode() or None
        return None
