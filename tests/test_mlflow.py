"""`switchps export mlflow`: a simulated run and a simulated study, exported into a local sqlite tracking
store, read back with MLflow's client (params, metric series, final metrics, artifacts, a study's nesting)
and through MLflow's own server's REST API, the one its UI reads; a second export is refused."""

from __future__ import annotations

import csv
import json
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import wait_until
from test_launch import CONFIGS, run
from test_sim import config
from test_study import mini_study
from switchps.cli import main
from switchps.config.run import MlflowOutput
from switchps.ps_server.mlflow_log import LiveLog, flatten, log_batches, param_value, params
from switchps.runs import mlflow_export
from switchps.runs.mlflow_export import EXPORT_ID
from switchps.runs.plots import PLOT_FILES
from switchps.sim.run import simulate
from switchps.studies.runner import run_study
from switchps.studies.spec import load_study

mlflow = pytest.importorskip("mlflow", reason='needs MLflow: pip install -e ".[mlflow]"')
from mlflow import MlflowClient  # noqa: E402
from mlflow.entities import Metric, Param, RunTag  # noqa: E402
from mlflow.utils.validation import MAX_METRICS_PER_BATCH, MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH  # noqa: E402

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A BSP run simulated with real gradients: 3 workers, 20 updates, an evaluation every 0.5 s."""
    run = tmp_path_factory.mktemp("mlflow") / "bsp"
    simulate(config(train={"steps": 20}), run, quiet=True)
    return run


@pytest.fixture(scope="module")
def study_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A simulated study of 2 arms x 2 repeats."""
    where = tmp_path_factory.mktemp("mlflow-study")
    out = where / "mini"
    run_study(load_study(mini_study(where)), out)
    return out


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A sqlite tracking store in ``tmp_path``, where the artifacts go too (``./mlruns``)."""
    monkeypatch.chdir(tmp_path)
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def experiment_runs(client: MlflowClient, name: str) -> list[Any]:
    experiment = client.get_experiment_by_name(name)
    assert experiment is not None, f"no experiment {name!r}"
    return list(client.search_runs([experiment.experiment_id]))


def rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in client.get_metric_history(run_id, key)]


def artifacts(client: MlflowClient, run_id: str, path: str | None = None) -> set[str]:
    return {a.path for a in client.list_artifacts(run_id, path)}


def test_a_run_becomes_one_mlflow_run_with_its_config_series_summary_and_plots(
        run_dir: Path, store: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", "mlflow", str(run_dir), "--tracking-uri", store, "--experiment", "sims"]) == 0
    client = MlflowClient(store)
    (run,) = experiment_runs(client, "sims")
    assert run.info.run_id in capsys.readouterr().out and run.info.status == "FINISHED"

    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert run.data.params == {k: param_value(v) for k, v in flatten(cfg).items()}
    assert (run.data.params["protocol.name"], run.data.params["train.steps"],
            run.data.params["optimizer.learning_rate"]) == ("bsp", "20", "0.1")

    ps, evals = rows(run_dir / "ps.csv"), rows(run_dir / "eval.csv")
    assert len(ps) == 20
    for column in ("train_loss", "lr", "staleness_mean", "samples"):
        assert history(client, run.info.run_id, f"ps/{column}") == [(int(r["version"]), float(r[column])) for r in ps]
    assert history(client, run.info.run_id, "eval/test_accuracy") == [
        (int(r["version"]), float(r["test_accuracy"])) for r in evals]
    assert not any(k.startswith(("ps/protocol", "ps/workers", "ps/pushes", "ps/version", "ps/time_s"))
                   for k in run.data.metrics), "text columns and the step/time columns are no metrics"

    summary = json.loads((run_dir / "summary.json").read_text())
    assert run.data.metrics["final_test_accuracy"] == summary["final_test_accuracy"]
    assert run.data.metrics["updates"] == summary["updates"] == 20
    assert run.data.metrics["emulated_device.samples_per_s"] == summary["emulated_device"]["samples_per_s"]
    assert history(client, run.info.run_id, "final_test_loss") == [(20, summary["final_test_loss"])]

    assert {"config.yaml", "summary.json", "events.jsonl", "plots"} <= artifacts(client, run.info.run_id)
    assert {Path(p).name for p in artifacts(client, run.info.run_id, "plots")} == set(PLOT_FILES)
    assert not (run_dir / "plots").exists(), "the plots are made outside the run directory"
    tags = run.data.tags
    assert (tags["switchps.protocol"], tags["switchps.framework"], tags["switchps.device"],
            tags["switchps.run_dir"]) == ("bsp", "tensorflow", "simulated", str(run_dir.resolve()))


def test_a_second_export_of_a_directory_is_refused_in_one_line_and_logs_nothing(run_dir: Path, store: str) -> None:
    export = [str(BIN / "switchps"), "export", "mlflow", str(run_dir), "--tracking-uri", store]
    first = subprocess.run(export, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    again = subprocess.run(export, capture_output=True, text=True, timeout=300)
    client = MlflowClient(store)
    (run,) = experiment_runs(client, "switchps")
    assert again.returncode == 2 and [line for line in again.stderr.splitlines() if "INFO" not in line] == [
        f"switchps: {run_dir} is already in MLflow: run {run.info.run_id} of experiment 'switchps' at {store}; "
        "delete that run to export it again"]
    client.delete_run(run.info.run_id)
    assert mlflow_export.export_mlflow(run_dir, store).run_id != run.info.run_id, "a deleted export may be redone"


def test_an_export_that_fails_part_way_leaves_no_run(run_dir: Path, store: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(run_dir: Path, tmp: Path) -> Path:
        raise OSError("disk full")

    monkeypatch.setattr(mlflow_export, "_plots", broken)
    with pytest.raises(OSError, match="disk full"):
        mlflow_export.export_mlflow(run_dir, store)
    client = MlflowClient(store)
    assert experiment_runs(client, "switchps") == []
    monkeypatch.undo()
    assert mlflow_export.export_mlflow(run_dir, store).run_id, "and a retry is no second export"


def test_a_study_is_a_parent_run_with_a_nested_run_per_arm_and_repeat(study_dir: Path, store: str) -> None:
    done = mlflow_export.export_mlflow(study_dir, store, "studies")
    client = MlflowClient(store)
    runs = client.search_runs([done.experiment_id])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert parent.info.run_id == done.run_id and sorted(done.children) == sorted(r.info.run_id for r in children)
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parent.info.run_id}
    assert sorted((r.data.tags["switchps.arm"], r.data.tags["switchps.repeat"]) for r in children) == [
        ("backup", "0"), ("backup", "1"), ("bsp", "0"), ("bsp", "1")]
    study = json.loads((study_dir / "study.json").read_text())
    for child in children:
        listed = next(r for r in study["runs"] if (r["arm"], str(r["repeat"])) == (
            child.data.tags["switchps.arm"], child.data.tags["switchps.repeat"]))
        assert child.data.tags["switchps.run_dir"] == str(Path(listed["run_dir"]).resolve())
        assert child.data.metrics["final_test_accuracy"] == json.loads(
            (Path(listed["run_dir"]) / "summary.json").read_text())["final_test_accuracy"]
    for arm in ("bsp", "backup"):
        assert parent.data.metrics[f"{arm}/final_accuracy"] == study["arms"][arm]["final_accuracy"]["mean"]
        assert parent.data.metrics[f"{arm}/final_accuracy_ci95"] == study["arms"][arm]["final_accuracy"]["ci95"]
    assert parent.data.params["reference"] == "bsp" and parent.data.params["repeats"] == "2"
    assert {"study.json", "study.png"} <= artifacts(client, parent.info.run_id)
    assert parent.data.tags[EXPORT_ID] and all(EXPORT_ID not in r.data.tags for r in children)


def test_a_directory_that_is_neither_a_run_nor_a_study_exits_2_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", "mlflow", str(tmp_path), "--tracking-uri", f"sqlite:///{tmp_path / 'm.db'}"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"switchps: {tmp_path} is neither a finished run directory (config.yaml, ps.csv, summary.json) "
        "nor a study directory (study.json)"]


def test_export_mlflow_without_mlflow_installed_says_how_to_install_it(
        run_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow raises ModuleNotFoundError
    assert main(["export", "mlflow", str(run_dir)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        'switchps: config error: export mlflow needs MLflow, which is not installed: pip install "switchps[mlflow]"']


def test_export_without_a_form_still_writes_the_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`switchps export RUN_DIR` (the form users have) is `switchps export model RUN_DIR`."""
    (tmp_path / "config.yaml").write_text("name: x\n")
    for argv in (["export", str(tmp_path)], ["export", "--checkpoint", "latest", str(tmp_path)],
                 ["export", "model", str(tmp_path)]):
        assert main(argv) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"switchps: {tmp_path}: no readable checkpoint (versions kept: none)"], argv


class Recorder:
    """An ``MlflowClient`` stand-in that keeps each ``log_batch`` call."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int]] = []

    def log_batch(self, run_id: str, metrics: list[Any], params: list[Any], tags: list[Any]) -> None:
        self.calls.append((len(metrics), len(params), len(tags)))


def test_batches_stay_within_mlflows_limits_and_are_as_few_as_they_allow() -> None:
    client: Any = Recorder()
    n = log_batches(client, "r", [Metric("m", 0.0, 0, step) for step in range(2 * MAX_METRICS_PER_BATCH + 5)],
                    [Param(f"p{i}", "v") for i in range(MAX_PARAMS_TAGS_PER_BATCH + 1)],
                    [RunTag(f"t{i}", "v") for i in range(3)])
    assert n == len(client.calls) == 3
    assert [sum(c[i] for c in client.calls) for i in range(3)] == [2 * MAX_METRICS_PER_BATCH + 5,
                                                                   MAX_PARAMS_TAGS_PER_BATCH + 1, 3]
    assert all(m + p + t <= MAX_METRICS_PER_BATCH and p <= MAX_PARAMS_TAGS_PER_BATCH and t <= MAX_PARAMS_TAGS_PER_BATCH
               for m, p, t in client.calls)


def test_a_param_longer_than_mlflow_takes_is_cut_and_says_so() -> None:
    (long,) = params({"data": {"path": "x" * (MAX_PARAM_VAL_LENGTH + 10)}})
    assert long.key == "data.path" and len(long.value) == MAX_PARAM_VAL_LENGTH and long.value.endswith("x…")
    assert [(p.key, p.value) for p in params({"a": {}, "b": [1, 2], "c": None, "d": True})] == [
        ("a", "{}"), ("b", "[1, 2]"), ("c", "null"), ("d", "true")]


@pytest.mark.integration
def test_a_real_run_logs_from_the_ps_as_it_trains_and_exports_with_its_model(tmp_path: Path, store: str) -> None:
    proc, run_dir = run(tmp_path, str(CONFIGS / "quickstart.yaml"), "--set", "train.epochs=1",
                        "--set", f"output.mlflow.tracking_uri={store}", "--set", "output.mlflow.experiment=live")
    assert proc.returncode == 0 and run_dir is not None, proc.stderr[-3000:]
    client = MlflowClient(store)
    (live,) = experiment_runs(client, "live")
    ps, evals = rows(run_dir / "ps.csv"), rows(run_dir / "eval.csv")
    assert history(client, live.info.run_id, "ps/train_loss") == [
        (int(r["version"]), float(r["train_loss"])) for r in ps]
    assert json.loads((run_dir / "summary.json").read_text())["mlflow"] == {
        "rows_logged": len(ps) + len(evals), "rows_lost": 0, "failures": 0}
    done = mlflow_export.export_mlflow(run_dir, store)
    assert artifacts(client, done.run_id, "model") == {"model/model.keras"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.integration
def test_mlflows_own_server_lists_the_exported_runs(run_dir: Path, study_dir: Path, store: str, tmp_path: Path,
                                                   processes: Any) -> None:
    """MLflow's tracking server on the exported store answers its REST API (what its UI reads) with them."""
    mlflow_export.export_mlflow(run_dir, store, "sims")
    mlflow_export.export_mlflow(study_dir, store, "studies")
    port = free_port()
    processes([str(BIN / "mlflow"), "server", "--backend-store-uri", store, "--default-artifact-root",
               str(tmp_path / "mlruns"), "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: _get(f"{url}/health") == b"OK", timeout_s=180, what="the MLflow server's health endpoint")
    experiments = json.loads(_post(f"{url}/api/2.0/mlflow/experiments/search", {"max_results": 10}))
    ids = {e["name"]: e["experiment_id"] for e in experiments["experiments"]}
    found = json.loads(_post(f"{url}/api/2.0/mlflow/runs/search",
                             {"experiment_ids": [ids["sims"], ids["studies"]], "max_results": 100}))["runs"]
    names = sorted(r["info"]["run_name"] for r in found)
    assert names == ["backup repeat 0", "backup repeat 1", "bsp repeat 0", "bsp repeat 1", "mini", "sim"]


def _get(url: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return bytes(r.read())
    except OSError:
        return b""


def _post(url: str, body: dict[str, Any]) -> bytes:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as r:
        return bytes(r.read())


def test_output_mlflow_logs_the_rows_as_the_run_goes(tmp_path: Path, store: str) -> None:
    run = tmp_path / "live"
    summary = simulate(config(train={"steps": 20}, output={"mlflow": {"tracking_uri": store, "experiment": "live"}}),
                       run, quiet=True)
    client = MlflowClient(store)
    (logged,) = experiment_runs(client, "live")
    ps, evals = rows(run / "ps.csv"), rows(run / "eval.csv")
    assert history(client, logged.info.run_id, "ps/train_loss") == [
        (int(r["version"]), float(r["train_loss"])) for r in ps]
    assert history(client, logged.info.run_id, "eval/test_accuracy") == [
        (int(r["version"]), float(r["test_accuracy"])) for r in evals]
    assert logged.data.params["output.mlflow.experiment"] == "live" and logged.info.status == "FINISHED"
    assert summary["mlflow"] == {"rows_logged": len(ps) + len(evals), "rows_lost": 0, "failures": 0}


def test_a_failing_tracking_store_is_logged_once_and_counted_and_the_run_trains_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "a file").write_text("")
    unusable = f"sqlite:///{tmp_path / 'a file' / 'mlflow.db'}"  # a directory that cannot be
    summary = simulate(config(train={"steps": 20}, output={"mlflow": {"tracking_uri": unusable}}), tmp_path / "r",
                       quiet=True)
    assert summary["updates"] == 20, "training went on"
    ps, evals = rows(tmp_path / "r" / "ps.csv"), rows(tmp_path / "r" / "eval.csv")
    assert summary["mlflow"]["rows_logged"] == 0 and summary["mlflow"]["rows_lost"] == len(ps) + len(evals)
    assert summary["mlflow"]["failures"] >= 1
    live = LiveLog(MlflowOutput(tracking_uri=unusable), tmp_path / "r", {})
    live.log(ps[:2], [])
    live.log(ps[2:5], evals[:1])
    assert (live.failures, live.lost, live.logged) == (2, 6, 0), "every flush tries, and counts what it lost"
    warned = [r for r in caplog.records if r.name == "switchps.mlflow"]
    assert len(warned) == 2 and all(unusable in r.getMessage() for r in warned), "once per run"
