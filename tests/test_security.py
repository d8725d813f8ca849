"""Authentication, roles and TLS against a real PS on loopback.

Every refused call gets the right status, changes no parameter and is counted in the run record.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from switchps.security import auth
from switchps.security.certs import Issued, issue, make_ca
from switchps.security.channels import ClientSecurity, ServerSecurity
from switchps.protos import switchps_pb2 as pb
from switchps.config.security import TLSSpec
from switchps.worker.client import PSClient

pytest_plugins = ["cluster"]  # cluster_factory: a PS on loopback

SECRET = b"a" * 64
SIZE = 8


def _client(c, token: str | None, tls: TLSSpec | None = None) -> PSClient:
    return PSClient(c.address, timeout_s=10, security=ClientSecurity(token, tls))


def _push(client: PSClient, c, worker: int = 0) -> None:
    header = pb.PushHeader(worker=worker, base_version=0, samples=4, layout_digest=c.layout.digest)
    client.push(header, np.ones(SIZE, np.float32), np.zeros(SIZE, np.float32))


def _refused(call, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == code, e.value.details()
    return e.value.details()


def _unchanged(c) -> None:
    np.testing.assert_array_equal(c.params, np.zeros(SIZE))
    assert c.store.version == 0


@pytest.fixture
def secure(cluster_factory):
    return cluster_factory(workers=2, size=SIZE, security=ServerSecurity(SECRET))


def test_a_call_without_a_token_is_unauthenticated_on_every_rpc_and_counted(secure):
    c = secure
    anonymous = _client(c, None)
    _refused(lambda: _push(anonymous, c), grpc.StatusCode.UNAUTHENTICATED)
    _refused(lambda: anonymous.pull(np.zeros(SIZE, np.float32)), grpc.StatusCode.UNAUTHENTICATED)
    _refused(anonymous.status, grpc.StatusCode.UNAUTHENTICATED)
    _refused(lambda: anonymous.report_eval(0, 0.1, 0.999, final=True), grpc.StatusCode.UNAUTHENTICATED)
    _refused(lambda: anonymous.register(5, c.layout, -1), grpc.StatusCode.UNAUTHENTICATED)
    _unchanged(c)
    assert c.rec.rejections == {"push:no_token": 1, "pull:no_token": 1, "status:no_token": 1,
                                "eval:no_token": 1, "register:no_token": 1}
    assert c.ps.last_eval is None and not c.core.done
    assert len(c.events("push_rejected")) == 1


def test_a_wrong_or_forged_token_is_unauthenticated(secure):
    c = secure
    other_secret = _client(c, auth.token(b"b" * 64, "worker", 0))
    _refused(lambda: _push(other_secret, c), grpc.StatusCode.UNAUTHENTICATED)
    real = auth.token(SECRET, "worker", 1)
    forged = _client(c, real.replace("worker.1.", "worker.0."))  # worker 1's MAC under worker 0's name
    _refused(lambda: _push(forged, c), grpc.StatusCode.UNAUTHENTICATED)
    garbage = _client(c, "x" * 2000)
    details = _refused(garbage.status, grpc.StatusCode.UNAUTHENTICATED)
    assert real not in details
    _unchanged(c)
    assert c.rec.rejections == {"push:bad_token": 2, "status:bad_token": 1}


def test_a_worker_may_push_and_register_only_as_itself(secure):
    c = secure
    worker1 = _client(c, auth.token(SECRET, "worker", 1))
    details = _refused(lambda: _push(worker1, c, worker=0), grpc.StatusCode.PERMISSION_DENIED)
    assert "worker 1 may not call Push as worker 0" in details
    _refused(lambda: worker1.register(0, c.layout, 100), grpc.StatusCode.PERMISSION_DENIED)
    _refused(lambda: worker1.pull(np.zeros(SIZE, np.float32), worker=0), grpc.StatusCode.PERMISSION_DENIED)
    _refused(worker1.status, grpc.StatusCode.PERMISSION_DENIED)
    _unchanged(c)
    assert c.rec.rejections == {"push:identity": 1, "register:identity": 1, "pull:identity": 1,
                                "status:role": 1}
    first = c.workers[0].push_async(np.ones(SIZE), 4)  # the real workers are unaffected: a BSP round
    c.workers[1].push(np.ones(SIZE), 4)
    assert first.result().order.version == c.store.version == 1


def test_the_evaluator_may_read_and_report_but_not_push(secure):
    c = secure
    evaluator = _client(c, auth.token(SECRET, "evaluator"))
    details = _refused(lambda: _push(evaluator, c, worker=0), grpc.StatusCode.PERMISSION_DENIED)
    assert details == "evaluator may not call PushSmall"
    _refused(lambda: evaluator.register(0, c.layout, 100), grpc.StatusCode.PERMISSION_DENIED)
    _refused(lambda: evaluator.pull(np.zeros(SIZE, np.float32), worker=1), grpc.StatusCode.PERMISSION_DENIED)
    values = np.zeros(SIZE, np.float32)
    assert evaluator.pull(values).order.version == 0
    assert evaluator.report_eval(0, 0.5, 0.5).version == 0
    _unchanged(c)
    assert c.rec.rejections == {"push:role": 1, "register:role": 1, "pull:identity": 1}


def test_a_status_reader_may_only_read_status(secure):
    c = secure
    reader = _client(c, auth.token(SECRET, "status"))
    assert reader.status().version == 0
    _refused(lambda: reader.pull(np.zeros(SIZE, np.float32)), grpc.StatusCode.PERMISSION_DENIED)
    _refused(lambda: reader.report_eval(0, 0.1, 0.999, final=True), grpc.StatusCode.PERMISSION_DENIED)
    assert c.ps.last_eval is None
    assert c.rec.rejections == {"pull:role": 1, "eval:role": 1}


def test_health_needs_no_token(secure):
    with grpc.insecure_channel(secure.address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_large_unauthenticated_stream_is_refused_before_it_is_read(cluster_factory):
    c = cluster_factory(workers=1, size=1 << 20, chunk_bytes=1 << 16, security=ServerSecurity(SECRET))
    client = PSClient(c.address, 1 << 16, timeout_s=10)
    header = pb.PushHeader(worker=0, base_version=0, samples=4, layout_digest=c.layout.digest)
    _refused(lambda: client.push(header, np.ones(1 << 20, np.float32), np.zeros(1 << 20, np.float32)),
             grpc.StatusCode.UNAUTHENTICATED)
    assert c.store.version == 0 and not c.params.any()
    assert c.rec.rejections == {"push:no_token": 1}


def test_many_rejections_are_all_counted_but_logged_as_events_only_up_to_a_cap(secure):
    from switchps.ps_server.rejections import EVENTS_PER_REASON

    anonymous = _client(secure, None)
    for _ in range(EVENTS_PER_REASON + 5):
        _refused(anonymous.status, grpc.StatusCode.UNAUTHENTICATED)
    assert secure.rec.rejections == {"status:no_token": EVENTS_PER_REASON + 5}
    assert len(secure.events("status_rejected")) == EVENTS_PER_REASON


# ---- TLS ------------------------------------------------------------------------------------------


def _write(tmp_path, name: str, issued: Issued) -> tuple[str, str]:
    cert, key = tmp_path / f"{name}.pem", tmp_path / f"{name}.key"
    cert.write_bytes(issued.cert)
    key.write_bytes(issued.key)
    return str(cert), str(key)


@pytest.fixture
def pki(tmp_path):
    ca = make_ca()
    (tmp_path / "ca.pem").write_bytes(ca.cert)
    server_cert, server_key = _write(tmp_path, "server", issue(ca, "ps", ["localhost", "127.0.0.1"], server=True))
    client_cert, client_key = _write(tmp_path, "client", issue(ca, "client", ["switchps-client"], server=False))
    server = TLSSpec(cert=server_cert, key=server_key, ca=str(tmp_path / "ca.pem"), require_client_cert=True,
                     client_cert=client_cert, client_key=client_key)
    return ca, server, tmp_path


def test_mutual_tls_with_tokens_trains(cluster_factory, pki):
    _, tls, _ = pki
    c = cluster_factory(workers=2, size=SIZE, security=ServerSecurity(SECRET, tls))
    first = c.workers[0].push_async(np.ones(SIZE), 4)
    c.workers[1].push(np.ones(SIZE), 4)
    assert first.result().order.version == c.store.version == 1 and c.rec.rejections == {}


def test_plaintext_expired_and_foreign_certificates_cannot_reach_a_tls_ps(cluster_factory, pki):
    ca, tls, tmp = pki
    c = cluster_factory(workers=1, size=SIZE, security=ServerSecurity(SECRET, tls))
    token = auth.token(SECRET, "status")
    plaintext = PSClient(c.address, timeout_s=5, security=ClientSecurity(token))
    _refused(plaintext.status, grpc.StatusCode.UNAVAILABLE)
    expired = _write(tmp, "expired", issue(ca, "client", ["switchps-client"], server=False, days=-1))
    foreign = _write(tmp, "foreign", issue(make_ca(), "client", ["switchps-client"], server=False))
    for cert, key in (expired, foreign):
        spec = tls.model_copy(update={"client_cert": cert, "client_key": key})
        _refused(_client(c, token, spec).status, grpc.StatusCode.UNAVAILABLE)
    no_cert = tls.model_copy(update={"client_cert": None, "client_key": None})
    _refused(_client(c, token, no_cert).status, grpc.StatusCode.UNAVAILABLE)
    assert _client(c, token, tls).status().version == 0
    _unchanged(c)


def test_a_client_refuses_a_ps_whose_certificate_its_ca_did_not_sign(cluster_factory, pki, tmp_path):
    _, tls, tmp = pki
    c = cluster_factory(workers=1, size=SIZE, security=ServerSecurity(SECRET, tls))
    (tmp / "other-ca.pem").write_bytes(make_ca().cert)
    spec = tls.model_copy(update={"ca": str(tmp / "other-ca.pem")})
    _refused(_client(c, auth.token(SECRET, "status"), spec).status, grpc.StatusCode.UNAVAILABLE)


def test_tokens_name_one_identity():
    t = auth.token(SECRET, "worker", 3)
    assert auth.verify(SECRET, f"Bearer {t}") == auth.Caller("worker", 3)
    assert t != auth.token(SECRET, "worker", 4) != auth.token(SECRET, "evaluator")
    for header in (None, t, f"Basic {t}", f"Bearer {t}x", "Bearer worker.-1.00", "Bearer admin.0.00"):
        with pytest.raises(Exception) as e:
            auth.verify(SECRET, header)
        assert getattr(e.value, "code", None) == "UNAUTHENTICATED"


def test_security_config_problems_name_their_fields_for_each_role(tmp_path, monkeypatch):
    from switchps.config.schema import Role
    from switchps.config.run import ConfigError, parse_config

    def problems(security: dict, role: Role) -> list[str]:
        with pytest.raises(ConfigError) as e:
            parse_config({"security": security}, role=role)
        return e.value.problems

    assert problems({}, "ps") == ["security: no run secret: set security.secret_file or security.secret_env (the "
                                  "same on every host), or security.insecure: true on a trusted network"]
    parse_config({}, role="run")  # `switchps run` makes a secret itself
    loose = tmp_path / "loose"
    loose.write_text("s" * 64)
    loose.chmod(0o644)
    assert problems({"secret_file": str(loose)}, "worker") == [
        f"security.secret_file: {loose}: readable by other users; chmod 600 {loose}"]
    monkeypatch.delenv("NO_SUCH_SECRET", raising=False)
    assert problems({"secret_env": "NO_SUCH_SECRET"}, "evaluator") == [
        "security.secret_env: the environment variable NO_SUCH_SECRET is not set"]
    assert problems({"insecure": True, "tls": {"require_client_cert": True}}, "worker") == [
        "security.tls.ca: required", "security.tls.client_cert: required with require_client_cert: true",
        "security.tls.client_key: required with require_client_cert: true"]
    ca = tmp_path / "ca.pem"
    ca.write_bytes(make_ca().cert)
    parse_config({"security": {"insecure": True, "tls": {"ca": str(ca)}}}, role="worker")  # no server key needed


def test_a_role_refused_by_the_ps_exits_1_in_one_line(secure, tmp_path, capsys, monkeypatch):
    from switchps import cli

    wrong = tmp_path / "wrong"
    wrong.write_text("w" * 64)
    wrong.chmod(0o600)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"cluster: {{ps: '{secure.address}', workers: 2}}\nsecurity: {{secret_file: {wrong}}}\n")

    def evaluator(args) -> int:  # the evaluator's first call, without loading TensorFlow
        from switchps.security.channels import client_security
        from switchps.config.run import load_config

        c = load_config(args.config, role="evaluator")
        PSClient(c.cluster.shards[0], timeout_s=10, security=client_security(c, "evaluator")).status()
        return 0

    monkeypatch.setattr(cli, "cmd_evaluator", evaluator)
    assert cli.main(["evaluator", str(cfg)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["switchps: evaluator: the PS refused this process (UNAUTHENTICATED: invalid credentials); "
                   "does it use the PS's secret (security.secret_file or secret_env)?"]
    assert secure.rec.rejections == {"status:bad_token": 1}


def test_status_of_a_secured_ps_uses_the_run_directory_secret(secure, tmp_path):
    from switchps.runs.record import console
    from switchps.runs.status import status_table

    secret = tmp_path / "run-secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    (secure.run_dir / "config.yaml").write_text(
        f"cluster: {{ps: '{secure.address}', workers: 2}}\nsecurity: {{secret_file: {secret}}}\n")
    con = console()
    with con.capture() as out:
        con.print(status_table(str(secure.run_dir)))
    assert "active workers" in out.get() and "refused" not in out.get()
    with con.capture() as out:
        con.print(status_table(secure.address))
    assert "refused (UNAUTHENTICATED: no credentials" in out.get()
    assert secure.rec.rejections == {"status:no_token": 1}
