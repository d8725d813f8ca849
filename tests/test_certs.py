"""The development CA and certificates: their files, their contents, and real gRPC TLS handshakes with them."""

from __future__ import annotations

import ipaddress
import stat
from collections.abc import Iterator
from concurrent import futures
from datetime import datetime, timedelta, timezone
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.x509.oid import ExtendedKeyUsageOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from switchps.security.certs import FILES, Issued, issue, make_ca, write_dir

HOSTS = ["ps.example", "10.0.0.5"]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The six files ``write_dir`` makes for HOSTS, in a directory that did not exist."""
    return write_dir(tmp_path_factory.mktemp("pki") / "a" / "certs", HOSTS)


def _load(paths: dict[str, Path], role: str) -> Issued:
    """The certificate and key of ``role`` ("ca", "server" or "client") as written."""
    if role == "ca":
        return Issued(paths["ca"].read_bytes(), paths["ca_key"].read_bytes())
    return Issued(paths[f"{role}_cert"].read_bytes(), paths[f"{role}_key"].read_bytes())


def _cert(issued: Issued) -> x509.Certificate:
    return x509.load_pem_x509_certificate(issued.cert)


@pytest.fixture(scope="module")
def port(pki: dict[str, Path]) -> Iterator[int]:
    """A real gRPC health service on loopback that requires a client certificate from the CA."""
    ca, server = _load(pki, "ca"), _load(pki, "server")
    creds = grpc.ssl_server_credentials([(server.key, server.cert)], root_certificates=ca.cert,
                                        require_client_auth=True)
    grpc_server = grpc.server(futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, grpc_server)
    bound = grpc_server.add_secure_port("127.0.0.1:0", creds)
    grpc_server.start()
    try:
        yield bound
    finally:
        grpc_server.stop(None).wait()


def _check(target: str, ca: Issued, client: Issued | None, server_name: str | None = None) -> int:
    """The health status a client trusting ``ca`` and presenting ``client`` (if any) gets from ``target``.

    ``server_name`` is the name the client expects the server's certificate to carry (default: the target's host).
    """
    creds = grpc.ssl_channel_credentials(root_certificates=ca.cert, private_key=client and client.key,
                                         certificate_chain=client and client.cert)
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    with grpc.secure_channel(target, creds, options) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return int(reply.status)


def _refused(target: str, ca: Issued, client: Issued | None, server_name: str | None = None) -> str:
    """The details of the UNAVAILABLE a handshake that must fail ends in."""
    with pytest.raises(grpc.RpcError) as e:
        _check(target, ca, client, server_name)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
    return str(e.value.details())


def test_write_dir_makes_six_files_with_private_keys(pki: dict[str, Path]) -> None:
    assert set(pki) == set(FILES)
    assert {p.name for p in pki.values()} == set(FILES.values())
    for role, path in pki.items():
        assert path.parent == pki["ca"].parent
        mode = stat.S_IMODE(path.stat().st_mode)
        if role.endswith("key"):
            assert mode == 0o600, (role, oct(mode))
            assert path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
        else:
            assert path.read_bytes().startswith(b"-----BEGIN CERTIFICATE-----")


def test_write_dir_refuses_an_existing_dir_and_changes_nothing(pki: dict[str, Path]) -> None:
    before = {role: path.read_bytes() for role, path in pki.items()}
    with pytest.raises(FileExistsError, match="ca.pem"):
        write_dir(pki["ca"].parent, HOSTS)
    assert {role: path.read_bytes() for role, path in pki.items()} == before


def test_write_dir_refuses_if_any_one_file_exists(tmp_path: Path) -> None:
    (tmp_path / "client.key").write_bytes(b"mine")
    with pytest.raises(FileExistsError, match="client.key"):
        write_dir(tmp_path, HOSTS)
    assert [p.name for p in tmp_path.iterdir()] == ["client.key"]
    assert (tmp_path / "client.key").read_bytes() == b"mine"


def test_server_cert_names_hosts_and_localhost_and_chains_to_the_ca(pki: dict[str, Path]) -> None:
    ca, server = _cert(_load(pki, "ca")), _cert(_load(pki, "server"))
    server.verify_directly_issued_by(ca)
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["ps.example", "localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.5"),
                                                       ipaddress.ip_address("127.0.0.1")]
    eku = server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    with pytest.raises(InvalidSignature):  # same issuer name, different key
        server.verify_directly_issued_by(_cert(make_ca()))


def test_client_cert_and_ca_extensions(pki: dict[str, Path]) -> None:
    ca, client = _cert(_load(pki, "ca")), _cert(_load(pki, "client"))
    client.verify_directly_issued_by(ca)
    ca.verify_directly_issued_by(ca)
    assert client.subject.rfc4514_string() == "CN=switchps client"
    san = client.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert list(san) == [x509.DNSName("switchps-client")]
    assert list(client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.CLIENT_AUTH]
    assert not client.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    constraints = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    assert constraints.critical and constraints.value.ca and constraints.value.path_length == 0
    usage = ca.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.key_cert_sign and usage.crl_sign and not usage.digital_signature
    ski = ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    aki = client.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
    assert aki.key_identifier == ski.digest


def test_validity_window() -> None:
    now = datetime(2030, 6, 1, tzinfo=timezone.utc)
    ca = make_ca(now=now)
    fresh = _cert(issue(ca, "w", ["w"], server=False, days=10, now=now))
    assert fresh.not_valid_before_utc == now - timedelta(minutes=5)
    assert fresh.not_valid_after_utc == now + timedelta(days=10)
    expired = _cert(issue(ca, "w", ["w"], server=False, days=-1, now=now))
    assert expired.not_valid_after_utc == now - timedelta(days=1)
    assert expired.not_valid_before_utc == now - timedelta(days=2)
    later = _cert(issue(ca, "w", ["w"], server=False, now=now, not_before=now + timedelta(hours=1)))
    assert later.not_valid_before_utc == now + timedelta(hours=1)
    with pytest.raises(ValueError):
        issue(ca, "w", [], server=False)


def test_mutual_tls_handshake_succeeds(pki: dict[str, Path], port: int) -> None:
    ca, client = _load(pki, "ca"), _load(pki, "client")
    assert _check(f"localhost:{port}", ca, client) == health_pb2.HealthCheckResponse.SERVING
    assert _check(f"127.0.0.1:{port}", ca, client) == health_pb2.HealthCheckResponse.SERVING


def test_expired_client_cert_is_refused(pki: dict[str, Path], port: int) -> None:
    ca = _load(pki, "ca")
    _refused(f"localhost:{port}", ca, issue(ca, "switchps client", ["switchps-client"], server=False, days=-1))


def test_client_cert_from_another_ca_is_refused(pki: dict[str, Path], port: int) -> None:
    other = make_ca()
    _refused(f"localhost:{port}", _load(pki, "ca"), issue(other, "switchps client", ["c"], server=False))


def test_client_trusting_another_ca_refuses_the_server(pki: dict[str, Path], port: int) -> None:
    # the client refuses, so it can say why; when the server refuses, the client sees only "Socket closed"
    assert "CERTIFICATE_VERIFY_FAILED" in _refused(f"localhost:{port}", make_ca(), _load(pki, "client"))


def test_client_without_a_cert_is_refused(pki: dict[str, Path], port: int) -> None:
    _refused(f"localhost:{port}", _load(pki, "ca"), None)


def test_server_cert_is_no_client_cert(pki: dict[str, Path], port: int) -> None:
    _refused(f"localhost:{port}", _load(pki, "ca"), _load(pki, "server"))  # its extended key usage is server auth


def test_server_name_must_be_in_its_cert(pki: dict[str, Path], port: int) -> None:
    ca, client = _load(pki, "ca"), _load(pki, "client")
    assert _check(f"localhost:{port}", ca, client, "ps.example") == health_pb2.HealthCheckResponse.SERVING
    assert "Hostname" in _refused(f"localhost:{port}", ca, client, "elsewhere.example")
