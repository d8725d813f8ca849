"""Config validation: bad files exit 2 with one line naming the field; overrides and examples work."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.resources import files
from pathlib import Path

import pytest

from switchps.cli import main
from switchps.checks import PREFLIGHT
from switchps.config.run import ConfigError, load_config, parse_config

EXAMPLES = sorted(Path(str(files("switchps.examples"))).glob("*.yaml"))


@pytest.mark.parametrize("yaml_text, field", [
    ("protocol: {name: bsp, batchsize: 3}", "protocol.batchsize: unknown key"),
    ("bogus: 1", "bogus: unknown key"),
    ("protocol: {name: gossip}", "protocol.name"),
    ("protocol: {batch: -4}", "protocol.batch"),
    ("optimizer: {name: sgd, learning_rate: fast}", "optimizer.learning_rate"),
    ("cluster: {workers: 0}", "cluster.workers"),
    ("cluster: {ps: nowhere}", "cluster.ps"),
    ("network: {ps_link_mbit_s: 0}", "network.ps_link_mbit_s"),
    ("train: {steps: 10, epochs: 2}", "train: give exactly one of steps, epochs, seconds"),
    ("data: {name: npz}", "data: path is required"),
    ("cluster: {workers: 2}\nprotocol: {backup_workers: 2}", "protocol.backup_workers: must be below"),
    ("protocol: [1, 2", "invalid YAML at line"),
    ("- just\n- a list", "the top level must be a mapping"),
])
def test_bad_config_exits_2_with_one_line_naming_the_field(tmp_path, capsys, yaml_text, field):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    assert main(["ps", str(path), "--set", "security.insecure=true"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("switchps: config error: ") and field in err, err


def test_bad_config_from_the_real_command_has_no_traceback(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: {name: mlp, layers: 3}\n")
    exe = Path(sys.executable).parent / "switchps"  # the console script pip installed
    proc = subprocess.run([str(exe), "run", str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "switchps: config error: model.layers: unknown key"


def test_missing_file_and_bad_override():
    with pytest.raises(ConfigError, match="file not found"):
        load_config("/nonexistent/x.yaml")
    with pytest.raises(ConfigError, match="expected key.path=value"):
        parse_config({}, ["protocol.name"])
    with pytest.raises(ConfigError, match="protocol.staleness"):
        parse_config({}, ["protocol.staleness=-1"])


def test_overrides_reach_any_field():
    cfg = parse_config({"protocol": {"name": "bsp"}},
                       ["protocol.name=ssp", "protocol.staleness=2", "cluster.workers=3", "model.kwargs={hidden: [8]}"])
    assert (cfg.protocol.name, cfg.protocol.staleness, cfg.cluster.num_workers) == ("ssp", 2, 3)
    assert cfg.model.kwargs == {"hidden": [8]}


def test_default_config_is_the_quickstart():
    cfg = load_config(None)
    assert cfg.name == "quickstart" and cfg.data.name == "digits" and cfg.cluster.num_workers == 4
    assert cfg.protocol.name == "bsp"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_configs_validate_and_round_trip(path):
    cfg = load_config(path, checks=PREFLIGHT)
    import yaml

    assert parse_config(yaml.safe_load(cfg.dump()), checks=PREFLIGHT) == cfg


def test_examples_cover_every_protocol():
    from switchps.ps_server.core.protocols import PROTOCOLS

    names = {p.stem for p in EXAMPLES}
    assert set(PROTOCOLS) | {"quickstart", "backup"} <= names


def test_tf_config_supplies_cluster_and_index(tmp_path, monkeypatch):
    from switchps.launch.role_commands import apply_tf_config as _tf_config

    cfg = parse_config({})
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"ps": ["10.0.0.1:7000"], "worker": ["a:1", "b:1"]},
                                                "task": {"type": "worker", "index": 1}}))
    assert _tf_config(cfg, "worker", None) == 1
    assert cfg.cluster.ps == "10.0.0.1:7000" and cfg.cluster.num_workers == 2
    with pytest.raises(ConfigError, match="task.type is 'worker'"):
        _tf_config(cfg, "ps", None)
