"""A development CA and the PS's server and client certificates, for TLS and mTLS.

Every key is EC P-256 (fast to make), stored as unencrypted PKCS8 PEM; every certificate is PEM,
signed with SHA-256. ``write_dir`` lays out the six files ``switchps certs DIR`` produces.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from switchps.security.auth import write_private

CLIENT_NAME = "switchps client"
CLIENT_SAN = "switchps-client"
FILES = {"ca": "ca.pem", "ca_key": "ca.key", "server_cert": "server.pem", "server_key": "server.key",
         "client_cert": "client.pem", "client_key": "client.key"}
"""``write_dir``'s result keys and the file each names inside the directory."""


@dataclass(frozen=True)
class Issued:
    """PEM bytes of one certificate and its private key."""

    cert: bytes
    key: bytes


def _issued(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Issued:
    """PEM-encode a certificate and its (unencrypted PKCS8) key."""
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    return Issued(cert.public_bytes(serialization.Encoding.PEM), pem)


def _usage(digital_signature: bool = False, key_agreement: bool = False, cert_sign: bool = False) -> x509.KeyUsage:
    """A KeyUsage with only the named bits set."""
    return x509.KeyUsage(digital_signature=digital_signature, content_commitment=False, key_encipherment=False,
                         data_encipherment=False, key_agreement=key_agreement, key_cert_sign=cert_sign,
                         crl_sign=cert_sign, encipher_only=False, decipher_only=False)


def make_ca(name: str = "switchps development CA", days: int = 365, now: datetime | None = None) -> Issued:
    """A self-signed CA valid from five minutes before ``now`` for ``days`` days; it may sign leaves only."""
    now = now or datetime.now(timezone.utc)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(minutes=5)).not_valid_after(now + timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_usage(cert_sign=True), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return _issued(cert, key)


def _san(host: str) -> x509.GeneralName:
    """An IPAddress entry if ``host`` parses as an IP address, else a DNSName."""
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def issue(ca: Issued, common_name: str, hosts: Sequence[str], server: bool, days: int = 365,
          now: datetime | None = None, not_before: datetime | None = None) -> Issued:
    """A leaf certificate signed by ``ca`` for ``hosts``, for server (else client) authentication.

    Valid from ``not_before`` (default five minutes before ``now``) until ``now + days``; a negative
    ``days`` gives an expired certificate, valid for the one day before it expired.
    """
    if not hosts:
        raise ValueError("a certificate needs at least one host")
    ca_key = serialization.load_pem_private_key(ca.key, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise TypeError("the CA key is not an EC key")
    ca_cert = x509.load_pem_x509_certificate(ca.cert)
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    now = now or datetime.now(timezone.utc)
    not_after = now + timedelta(days=days)
    start = not_before or now - timedelta(minutes=5)
    if start >= not_after:
        start = not_after - timedelta(days=1)
    key = ec.generate_private_key(ec.SECP256R1())
    purpose = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_usage(digital_signature=True, key_agreement=True), critical=True)
            .add_extension(x509.ExtendedKeyUsage([purpose]), critical=False)
            .add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return _issued(cert, key)


def write_dir(directory: Path, hosts: Sequence[str], days: int = 365) -> dict[str, Path]:
    """Make ``directory`` with a new CA and a server and client certificate, each with its key.

    The server is named by ``hosts`` plus localhost and 127.0.0.1. Refuses, writing nothing,
    if any of the six files already exists.
    """
    paths = {role: directory / name for role, name in FILES.items()}
    for path in paths.values():
        if path.exists():
            raise FileExistsError(f"{path} already exists; not overwriting certificates")
    ca = make_ca(days=days)
    server_hosts = list(dict.fromkeys([*hosts, "localhost", "127.0.0.1"]))
    server = issue(ca, server_hosts[0], server_hosts, server=True, days=days)
    client = issue(ca, CLIENT_NAME, [CLIENT_SAN], server=False, days=days)
    directory.mkdir(parents=True, exist_ok=True)
    for (cert_role, key_role), issued in zip([("ca", "ca_key"), ("server_cert", "server_key"),
                                              ("client_cert", "client_key")], [ca, server, client]):
        paths[cert_role].write_bytes(issued.cert)
        write_private(paths[key_role], issued.key)
    return paths
