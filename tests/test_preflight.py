"""Configs that would start and then fail are refused before any process starts: exit 2, one line per
problem naming its field. TLS files a handshake would refuse, and a resume whose config changes what its
checkpoint was made with."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509

import switchps.launch.launcher
from switchps.security.certs import CLIENT_NAME, CLIENT_SAN, Issued, issue, make_ca
from switchps.checks import BUILDS, PREFLIGHT
from switchps.cli import main
from switchps.config.run import ConfigError, RunConfig, parse_config
from switchps.config.schema import Role
from switchps.ps_server.resume_rules import ALLOWED, REFUSED

from test_config_errors import PREFIX, USER_MODELS, _check
from test_launch import SWITCHPS
from test_resume import pushed_to_version_5

SERVER_HOSTS = ["localhost", "127.0.0.1"]
CA = make_ca()
"""One CA for the module: each case issues only the certificates it spoils."""


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The real console script, with this checkout's PYTHONPATH (so the code under test is imported)."""
    return subprocess.run([SWITCHPS, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def _not_after(issued: Issued) -> str:
    return f"{x509.load_pem_x509_certificate(issued.cert).not_valid_after_utc:%Y-%m-%d %H:%M:%S} UTC"


def _not_before(issued: Issued) -> str:
    return f"{x509.load_pem_x509_certificate(issued.cert).not_valid_before_utc:%Y-%m-%d %H:%M:%S} UTC"


def _pki(tmp_path: Path, **spoilt: Issued) -> dict[str, Issued]:
    """Valid server and client certificates from ``CA``, with ``spoilt`` ones (server=, client=) instead,
    written as tls/{ca,server,client}.{pem,key}."""
    made = {"ca": CA, "server": issue(CA, "localhost", SERVER_HOSTS, server=True),
            "client": issue(CA, CLIENT_NAME, [CLIENT_SAN], server=False)} | spoilt
    (tmp_path / "tls").mkdir()
    for name, issued in made.items():
        (tmp_path / "tls" / f"{name}.pem").write_bytes(issued.cert)
        (tmp_path / "tls" / f"{name}.key").write_bytes(issued.key)
    return made


def _config(tmp_path: Path, ps: str = "127.0.0.1:50999") -> None:
    (tmp_path / "cfg.yaml").write_text(
        f"cluster: {{ps: '{ps}', workers: 1}}\ntrain: {{steps: 5}}\noutput: {{dir: runs}}\nsecurity:\n"
        "  insecure: true\n  tls: {cert: tls/server.pem, key: tls/server.key, ca: tls/ca.pem, "
        "client_cert: tls/client.pem, client_key: tls/client.key, require_client_cert: true}\n")


ROLES = {"run": ["run"], "ps": ["ps", "--run-dir", "runs/ps"], "worker": ["worker", "--index", "0"],
         "evaluator": ["evaluator", "--run-dir", "runs/eval"]}
SERVER_SIDE, CLIENT_SIDE = ("run", "ps"), ("run", "worker", "evaluator")


def _expired(tmp_path: Path) -> tuple[list[str], list[str]]:
    pki = _pki(tmp_path, server=issue(CA, "localhost", SERVER_HOSTS, server=True, days=-2))
    return ["security.tls.cert: the certificate CN=localhost in tls/server.pem expired on "
            + _not_after(pki["server"])], list(SERVER_SIDE)


def _not_yet_valid(tmp_path: Path) -> tuple[list[str], list[str]]:
    later = datetime.now(timezone.utc) + timedelta(days=3)
    pki = _pki(tmp_path, client=issue(CA, CLIENT_NAME, [CLIENT_SAN], server=False, days=30, not_before=later))
    return [f"security.tls.client_cert: the certificate CN={CLIENT_NAME} in tls/client.pem is not valid until "
            + _not_before(pki["client"])], list(CLIENT_SIDE)


def _mismatched_keys(tmp_path: Path) -> tuple[list[str], list[str]]:
    server, other = issue(CA, "localhost", SERVER_HOSTS, server=True), issue(CA, "x", ["x"], server=True)
    client, another = (issue(CA, CLIENT_NAME, [CLIENT_SAN], server=False) for _ in range(2))
    _pki(tmp_path, server=Issued(server.cert, other.key), client=Issued(client.cert, another.key))
    return ["security.tls.key: tls/server.key is not the private key of security.tls.cert (tls/server.pem)",
            "security.tls.client_key: tls/client.key is not the private key of security.tls.client_cert "
            "(tls/client.pem)"], ["run"]


def _wrong_host(tmp_path: Path) -> tuple[list[str], list[str]]:
    _pki(tmp_path, server=issue(CA, "ps.example", ["PS.example", "10.0.0.5"], server=True))
    return ["security.tls.cert: tls/server.pem does not name '127.0.0.1', the host of cluster.ps that clients "
            "connect to; it names DNS:PS.example, IP:10.0.0.5"], list(SERVER_SIDE)


def _another_ca(tmp_path: Path) -> tuple[list[str], list[str]]:
    _pki(tmp_path, client=issue(make_ca("another CA"), CLIENT_NAME, [CLIENT_SAN], server=False))
    return ["security.tls.client_cert: tls/client.pem is not signed by the CA in security.tls.ca (tls/ca.pem), "
            "so the other side of the connection would refuse it"], list(CLIENT_SIDE)


TLS_CASES: dict[str, Callable[[Path], tuple[list[str], list[str]]]] = {
    "expired": _expired, "not yet valid": _not_yet_valid, "mismatched keys": _mismatched_keys,
    "wrong host": _wrong_host, "another CA": _another_ca}
"""Each case writes its files and returns the expected lines and the roles that use the spoilt files."""


@pytest.mark.parametrize("case", sorted(TLS_CASES))
def test_tls_files_a_handshake_would_refuse_stop_every_role_that_uses_them(tmp_path, case):
    expected, roles = TLS_CASES[case](tmp_path)
    _config(tmp_path)
    for role in roles:
        proc = _cli(*ROLES[role], "cfg.yaml", cwd=tmp_path)
        assert proc.returncode == 2, (role, proc.stderr[-2000:])
        assert proc.stderr.strip().splitlines() == [PREFIX + line for line in expected], role
        assert not (tmp_path / "runs").exists(), f"{role}: no run directory"


@pytest.mark.parametrize("ps", ["LOCALHOST:50999", "127.0.0.1:50999"])
def test_a_server_certificate_that_names_the_host_passes_in_any_case(tmp_path, monkeypatch, ps):
    _pki(tmp_path)
    _config(tmp_path, ps)
    monkeypatch.chdir(tmp_path)
    launched: list[RunConfig] = []
    monkeypatch.setattr(switchps.launch.launcher, "launch", lambda cfg, **kw: launched.append(cfg) or (tmp_path, {}))
    assert main(["run", "cfg.yaml"]) == 0 and len(launched) == 1


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A crashed run with checkpoints (version 4), made by a PS in this process: 2 workers, ASP, SGD."""
    path = tmp_path_factory.mktemp("crashed")
    pushed_to_version_5(path)
    return path


def _files(directory: Path) -> dict[Path, bytes]:
    """The run's files; not TensorBoard's, which the crashed in-process PS's writer thread may still flush."""
    return {p: p.read_bytes() for p in directory.rglob("*") if p.is_file() and "tensorboard" not in p.parts}


def _refused(proc: subprocess.CompletedProcess, run_dir: Path, before: dict[Path, bytes], lines: list[str]) -> None:
    assert proc.returncode == 2, proc.stderr[-2000:]
    _check(proc.stderr, [tuple(line.split(" | ")) for line in lines])
    assert _files(run_dir) == before and not (run_dir / "logs").exists(), "nothing started, nothing touched"


def test_run_resume_refuses_a_changed_model_optimizer_data_seed_and_worker_count(run_dir, tmp_path):
    before = _files(run_dir)
    sets = ["model.name=cnn", "optimizer.name=adam", "data.test_fraction=0.3", "seed=5", "cluster.workers=3",
            "protocol.name=ssp"]
    proc = _cli("run", "--resume", str(run_dir), *[f"--set={s}" for s in sets], cwd=tmp_path)
    _refused(proc, run_dir, before, [
        "seed: the checkpoint was made with 0, this config says 5 | data split",
        "cluster.workers: the checkpoint was made with 2, this config says 3 | every N-th sample",
        "model.name: the checkpoint was made with 'mlp', this config says 'cnn' | a resume cannot change it",
        "data.test_fraction: the checkpoint was made with 0.2, this config says 0.3",
        "optimizer.name: the checkpoint was made with 'sgd', this config says 'adam' | optimizer's state"])


def test_ps_resume_refuses_another_data_set_and_optimizer_hyper_parameters(run_dir, tmp_path):
    before = _files(run_dir)
    sets = ["security.insecure=true", "data.name=synthetic", "optimizer.params={momentum: 0.9}"]
    proc = _cli("ps", str(run_dir / "config.yaml"), "--resume", str(run_dir), *[f"--set={s}" for s in sets],
                cwd=tmp_path)
    _refused(proc, run_dir, before, [
        "data.name: the checkpoint was made with 'digits', this config says 'synthetic'",
        "optimizer.params.momentum: the checkpoint was made with 0.0, this config says 0.9"])


def test_the_checkpoint_s_own_config_counts_when_the_run_s_config_yaml_was_edited(run_dir, tmp_path):
    copy = shutil.copytree(run_dir, tmp_path / "copy")
    saved = yaml.safe_load((copy / "config.yaml").read_text())
    saved["model"]["kwargs"] = {"hidden": [16]}
    (copy / "config.yaml").write_text(yaml.safe_dump(saved))
    before = _files(copy)
    proc = _cli("run", "--resume", str(copy), cwd=tmp_path)
    _refused(proc, copy, before, ["model.kwargs.hidden: the checkpoint was made with nothing, this config says [16]"])


def test_a_resume_may_change_how_the_run_is_driven(run_dir, monkeypatch):
    launched: list[dict[str, Any]] = []
    monkeypatch.setattr(switchps.launch.launcher, "launch",
                        lambda cfg, **kw: launched.append({"cfg": cfg, **kw}) or (run_dir, {}))
    sets = ["protocol.name=ssp", "policy={name: greedy, kwargs: {bsp_fraction: 0.5}}", "train.steps=50", "optimizer.learning_rate=0.5",
            "checkpoint.every_updates=7", "cluster.workers=['a:1', 'b:2']", "stragglers.slowdown={factors: {0: 2.0}}",
            "optimizer.params={momentum: 0.0}", "output.dir=elsewhere"]
    assert main(["run", "--resume", str(run_dir), *[f"--set={s}" for s in sets]]) == 0
    (call,) = launched
    assert call["resume"] == run_dir and call["cfg"].protocol.name == "ssp"


def _fields(d: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted paths of a config dump, a mapping that may hold anything (kwargs, params) as one field."""
    return [f for k, v in d.items() for f in (_fields(v, f"{prefix}{k}.") if isinstance(v, dict) and v
                                               else [f"{prefix}{k}"])]


def test_every_config_field_is_either_allowed_or_refused_on_resume():
    for path in _fields(RunConfig().model_dump(mode="json")):
        rules = [r for r in [*REFUSED, *ALLOWED] if path == r or path.startswith(r + ".")]
        assert len(rules) == 1, (path, rules)


TORCH_MODELS = textwrap.dedent("""
    import torch
    from torch import nn


    def tiny(input_shape, num_classes, width=8):
        return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0], width), nn.ReLU(), nn.Linear(width, num_classes))


    def no_module(input_shape, num_classes):
        return {"weight": torch.zeros(num_classes)}


    class Counted(nn.Module):
        def __init__(self, input_shape, num_classes):
            super().__init__()
            self.fc = nn.Linear(input_shape[0], num_classes)
            self.seen = nn.Parameter(torch.zeros(1, dtype=torch.int64), requires_grad=False)

        def forward(self, x):
            return self.fc(x)
""")


@pytest.fixture
def torch_dir(tmp_path, monkeypatch):
    """A working directory holding users' models, torch and Keras (``test_config_errors.USER_MODELS``)."""
    (tmp_path / "torch_models.py").write_text(TORCH_MODELS)
    (tmp_path / "my_models.py").write_text(USER_MODELS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    return tmp_path


def _torch_problems(model: dict[str, Any], role: Role = "worker", **sections: Any) -> list[str]:
    """What the preflight says of a torch run of ``model`` on digits for ``role`` (no line: [])."""
    raw = {"model": {"framework": "torch", **model}, "security": {"insecure": True}, **sections}
    try:
        parse_config(raw, role=role, checks=PREFLIGHT)
    except ConfigError as e:
        return e.problems
    return []


def test_a_torch_builder_must_return_a_float_module(torch_dir):
    assert _torch_problems({"name": "torch_models:tiny", "kwargs": {"width": 4}}) == []
    assert _torch_problems({"name": "torch_models:no_module"}) == [
        "model.name: model 'torch_models:no_module' returned dict, not a torch.nn.Module"]
    assert _torch_problems({"name": "my_models:tiny"}) == [
        "model.name: model 'my_models:tiny' returned a Keras model (Functional), not a torch.nn.Module: "
        "set model.framework: tensorflow"]
    assert _torch_problems({"name": "torch_models:Counted"}) == [
        "model.name: model 'torch_models:Counted' has parameters that are not floating point: seen (torch.int64); "
        "switchps trains float32 parameters (keep integers in buffers)"]


def test_a_torch_state_dict_must_exist_and_fit_the_model_strictly(torch_dir):
    import torch
    from torch import nn

    from switchps.workload.torch.files import save
    from switchps.workload.torch.models import build_model

    model = build_model("mlp", (64,), 10, hidden=[16])
    save(model, torch_dir / "fits.pt")
    save(build_model("mlp", (64,), 10, hidden=[8]), torch_dir / "narrow.pt")
    torch.save({k: v for k, v in model.state_dict().items() if not k.endswith("bias")}, torch_dir / "partial.pt")
    mlp = {"name": "mlp", "kwargs": {"hidden": [16]}}
    assert _torch_problems({**mlp, "state_dict": "fits.pt"}) == []
    assert _torch_problems({**mlp, "state_dict": "fits.safetensors"}) == []
    assert _torch_problems({**mlp, "state_dict": "nowhere.pt"}) == ["model.state_dict: nowhere.pt: file not found"]
    (narrow,) = _torch_problems({**mlp, "state_dict": "narrow.pt"})
    assert narrow.startswith("model.state_dict: narrow.pt does not fit the model: ") and "size mismatch" in narrow
    (partial,) = _torch_problems({**mlp, "state_dict": "partial.pt"})
    assert partial.startswith("model.state_dict: partial.pt does not fit the model: ") and "Missing key" in partial
    assert isinstance(model, nn.Module) and _torch_problems({**mlp, "state_dict": "nowhere.pt"}, role="ps") == []


@pytest.mark.parametrize("gpus, device, expected", [
    (0, "cuda", "runtime.device: cuda: torch {v} sees no GPU on this host; use auto or cpu"),
    (2, "cuda:2", "runtime.device: cuda:2: torch {v} sees 2 GPUs (cuda:0 to cuda:1) on this host; use auto or cpu"),
    (1, "cuda:1", "runtime.device: cuda:1: torch {v} sees 1 GPU (cuda:0) on this host; use auto or cpu"),
    (1, "cuda:0", None), (0, "auto", None), (0, "cpu", None)])
def test_a_torch_device_must_be_a_gpu_this_host_has(monkeypatch, gpus, device, expected):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    for role in BUILDS:
        assert _torch_problems({}, role, runtime={"device": device}) == ([expected.format(v=torch.__version__)]
                                                                        if expected else []), role
    assert _torch_problems({}, "ps", runtime={"device": device}) == [], "the PS computes nothing"


def test_tensorflow_takes_no_state_dict_nor_gpu():
    with pytest.raises(ConfigError) as err:
        parse_config({"model": {"state_dict": "m.pt"}, "runtime": {"device": "cuda:0"}}, role="run", checks=PREFLIGHT)
    assert err.value.problems == [
        "model.state_dict: is for model.framework torch; a TensorFlow model starts from its seed"]
    with pytest.raises(ConfigError) as err:
        parse_config({"runtime": {"device": "cuda:0"}}, role="run", checks=PREFLIGHT)
    assert err.value.problems == [
        "runtime.device: cuda:0 is for model.framework torch; TensorFlow roles run on the CPU (auto or cpu)"]


def test_switchps_ps_imports_neither_torch_nor_tensorflow_for_a_torch_run(tmp_path):
    """The PS command's path up to its server (the preflight of a torch config whose model, file and device
    only the workers would check, then the PS's module), stopped by a bad --shard: exit 2, no framework."""
    (tmp_path / "cfg.yaml").write_text("model: {framework: torch, name: 'torch_models:tiny', state_dict: none.pt}\n"
                                       "runtime: {device: 'cuda:7'}\nsecurity: {insecure: true}\n")
    (tmp_path / "torch_models.py").write_text(TORCH_MODELS)
    code = ("import sys; from switchps.cli import main; code = main(['ps', 'cfg.yaml', '--shard', '9']); "
            "print(code, sorted(m for m in ('torch', 'tensorflow', 'keras') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.stdout.splitlines() == ["2 []"], out.stderr[-2000:]
    assert out.stderr.strip() == f"{PREFIX}ps: --shard 9 outside [0, 1) (cluster.ps lists 1 shards)"


def test_a_torch_run_on_a_missing_gpu_exits_2_before_any_process(tmp_path):
    (tmp_path / "cfg.yaml").write_text("model: {framework: torch}\nruntime: {device: 'cuda:99'}\n")
    proc = _cli("run", "cfg.yaml", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    _check(proc.stderr, [("runtime.device: cuda:99: torch ", " on this host; use auto or cpu")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg.yaml"], "no run directory"
