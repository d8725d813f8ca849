"""Secure channels both ways: what a PS serves with and what a client connects with, from the config.

A client's ``ClientSecurity`` carries its role's token (sent as call metadata on every RPC) and the
TLS files it verifies the PS with (and presents, for mTLS). ``ServerSecurity`` is the PS's side: the
run secret its ``Guard`` checks tokens against, and its certificate.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from switchps.security.auth import metadata, token
from switchps.config.security import SecuritySpec, TLSSpec

if TYPE_CHECKING:
    from switchps.config.run import RunConfig

log = logging.getLogger("switchps.security")


@dataclass(frozen=True)
class ServerSecurity:
    secret: bytes | None = None
    tls: TLSSpec | None = None

    def credentials(self) -> grpc.ServerCredentials | None:
        """TLS server credentials (None: plaintext)."""
        t = self.tls
        if t is None:
            return None
        return grpc.ssl_server_credentials([(_read(t.key), _read(t.cert))], root_certificates=_read(t.ca),
                                           require_client_auth=t.require_client_cert)


@dataclass(frozen=True)
class ClientSecurity:
    token: str | None = None
    tls: TLSSpec | None = None

    @property
    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        return metadata(self.token) if self.token else None

    def channel(self, address: str, options: list[tuple[str, Any]] | None = None) -> grpc.Channel:
        """A channel to the PS at ``address``: TLS if configured (with this client's certificate, if it
        has one), else plaintext."""
        creds = self._credentials()
        if creds is None:
            return grpc.insecure_channel(address, options=options)
        return grpc.secure_channel(address, creds, options=options)

    def aio_channel(self, address: str, options: list[tuple[str, Any]] | None = None) -> grpc.aio.Channel:
        """``channel`` for an asyncio caller (a follower shard's stream to shard 0)."""
        creds = self._credentials()
        if creds is None:
            return grpc.aio.insecure_channel(address, options=options)
        return grpc.aio.secure_channel(address, creds, options=options)

    def _credentials(self) -> grpc.ChannelCredentials | None:
        t = self.tls
        if t is None:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=_read(t.ca), private_key=_read(t.client_key) if t.client_key else None,
            certificate_chain=_read(t.client_cert) if t.client_cert else None)


def _read(path: str | None) -> bytes:
    assert path is not None, "the role's config check requires the file"
    return Path(path).read_bytes()


def server_security(spec: SecuritySpec) -> ServerSecurity:
    """The PS's security from its config (validated: a secret, or ``insecure`` said explicitly)."""
    secret = spec.secret_value()
    if secret is None:
        log.warning("security.insecure: true -- any process that reaches this PS can read the model, push "
                    "gradients and end the run")
    return ServerSecurity(secret, spec.tls)


def client_security(cfg: RunConfig, role: str, index: int = 0) -> ClientSecurity:
    """A client's credentials: its role's token under the configured secret, and the TLS files."""
    secret = cfg.security.secret_value()
    return ClientSecurity(token(secret, role, index) if secret else None, cfg.security.tls)
