"""What a TLS handshake would refuse, found while the config is checked, before any process starts.

gRPC reports a bad certificate only at the handshake, as ``UNAVAILABLE: Socket closed`` at a client
that then retries until it gives up, long after the PS started serving. These checks read the PEM
files a role uses (``security_config.TLSSpec.role_problems`` decides which, and that they are
readable) and return one problem per fault, naming the field and the file: a certificate outside its
validity window, a private key that is not the certificate's, a server certificate that does not name
the host clients dial (``cluster.ps``), and a certificate the configured CA did not sign.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes

from switchps.problems import Problem

PAIRS = {"cert": "key", "client_cert": "client_key"}
"""Each certificate field and the field of its private key."""


@dataclass(frozen=True)
class Pem:
    """One configured file: its field in ``security.tls`` and its path."""

    field: str
    path: str

    def certificates(self) -> list[x509.Certificate]:
        """Every certificate in the file (a leaf first, then its chain; or a CA bundle)."""
        return x509.load_pem_x509_certificates(Path(self.path).read_bytes())

    def private_key(self) -> PrivateKeyTypes:
        return serialization.load_pem_private_key(Path(self.path).read_bytes(), password=None)


def tls_problems(files: dict[str, str], host: str | None, now: datetime) -> list[Problem]:
    """Problems with ``files`` (field -> path: the readable files a role uses) at time ``now``.

    ``host``: the host clients dial, for a role that serves with (or launches the PS with) ``cert``;
    None where the server certificate is not this role's to check.
    """
    problems: list[Problem] = []
    certs: dict[str, list[x509.Certificate]] = {}
    for field, path in files.items():
        if field in PAIRS or field == "ca":
            try:
                certs[field] = Pem(field, path).certificates()
            except ValueError:
                problems.append((field, f"{path} holds no PEM certificate"))
                continue
            problems += [(field, msg) for c in certs[field] if (msg := _validity(path, c, now))]
    for field, key_field in PAIRS.items():
        if field in certs and key_field in files:
            problems += _pair_problems(Pem(field, files[field]), Pem(key_field, files[key_field]), certs[field][0])
        if field in certs and "ca" in certs and not _signed(certs[field], certs["ca"]):
            problems.append((field, f"{files[field]} is not signed by the CA in security.tls.ca ({files['ca']}), "
                                    "so the other side of the connection would refuse it"))
    if host is not None and "cert" in certs and (msg := _host_problem(certs["cert"][0], host)):
        problems.append(("cert", f"{files['cert']} {msg}"))
    return problems


def _validity(path: str, cert: x509.Certificate, now: datetime) -> str | None:
    subject = cert.subject.rfc4514_string() or "(no subject)"
    if now > cert.not_valid_after_utc:
        return f"the certificate {subject} in {path} expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M:%S} UTC"
    if now < cert.not_valid_before_utc:
        return (f"the certificate {subject} in {path} is not valid until "
                f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M:%S} UTC")
    return None


def _pair_problems(cert: Pem, key: Pem, leaf: x509.Certificate) -> list[Problem]:
    """The key file's problem: unreadable as an unencrypted PEM key, or not the certificate's key."""
    try:
        private = key.private_key()
    except TypeError:  # encrypted: gRPC takes no password
        return [(key.field, f"{key.path} is encrypted; gRPC needs an unencrypted PEM private key")]
    except (ValueError, UnsupportedAlgorithm):
        return [(key.field, f"{key.path} holds no PEM private key")]
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if private.public_key().public_bytes(*spki) != leaf.public_key().public_bytes(*spki):
        return [(key.field, f"{key.path} is not the private key of security.tls.{cert.field} ({cert.path})")]
    return []


def _signed(chain: list[x509.Certificate], cas: list[x509.Certificate]) -> bool:
    """Whether the leaf was issued by one of ``cas`` or by a certificate that follows it in its own file."""
    for issuer in [*cas, *chain[1:]]:
        try:
            chain[0].verify_directly_issued_by(issuer)
            return True
        except (ValueError, TypeError, InvalidSignature):
            continue
    return False


def _host_problem(cert: x509.Certificate, host: str) -> str | None:
    """Why a client dialling ``host`` would refuse ``cert`` (gRPC's rule: the subject alternative names;
    the common name only when there are none, and never for an IP address), or None."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        dns, ips = san.get_values_for_type(x509.DNSName), san.get_values_for_type(x509.IPAddress)
    except x509.ExtensionNotFound:
        dns, ips = [], []
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
        if ip in ips:
            return None
    except ValueError:
        cn = [str(a.value) for a in cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)]
        if any(_dns_matches(name, host) for name in dns or (cn if not ips else [])):
            return None
    names = [f"DNS:{n}" for n in dns] + [f"IP:{i}" for i in ips]
    return (f"does not name {host!r}, the host of cluster.ps that clients connect to; it names "
            f"{', '.join(names) or 'no host (no subject alternative names)'}")


def _dns_matches(pattern: str, host: str) -> bool:
    """Case-insensitive; a leading ``*.`` stands for exactly one label."""
    pattern, host = pattern.lower().rstrip("."), host.lower().rstrip(".")
    if pattern.startswith("*."):
        return "." in host and host.split(".", 1)[1] == pattern[2:]
    return pattern == host
