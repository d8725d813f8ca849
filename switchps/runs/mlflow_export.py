"""`switchps export mlflow DIR`: a run directory, or a study directory, as MLflow runs.

A run becomes one MLflow run: its config as params (dotted keys; values as JSON, strings as they are,
cut to MLflow's length limit), its ``ps.csv`` and ``eval.csv`` as metric series at step = version
(``switchps.ps_server.mlflow_log``), its summary's numbers as final metrics at the last version (the
rest as ``summary.*`` tags), and as artifacts the config, summary, event log, plots (made by
``switchps plot``'s code if the run has none) and the model file (written by `switchps export` from the
latest checkpoint if the run has neither a model file nor a checkpoint, none). A study becomes a parent
run (its spec as params, each arm's mean and 95 % half-width as metrics, study.json and its figures as
artifacts) with one child run per arm and repeat (tag ``mlflow.parentRunId``).

A second export of the same directory into the same experiment is refused (``RunDirError``): each
export tags its top run with ``switchps.export_id``, a hash of what and where it exported, and the export
first searches for it. An export that fails part way deletes the runs it created, so that it can be
retried.
"""

from __future__ import annotations

import csv
import json
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from switchps.errors import RunDirError
from switchps.problems import ConfigError
from switchps.ps_server.mlflow_log import (cut, export_id, flatten, get_or_create_experiment, log_batches, param_value,
                                           params, row_metrics)

if TYPE_CHECKING:
    from mlflow import MlflowClient

EXPORT_ID = "switchps.export_id"
"""The tag that marks an exported directory (its value: ``export_id``)."""
DEFAULT_EXPERIMENT = "switchps"
RUN_FILES = ("config.yaml", "summary.json", "events.jsonl")
MODEL_FILES = ("model.keras", "model.pt", "model.safetensors")


@dataclass
class Exported:
    """What an export created: the experiment and the top run (a study's parent), with its children."""

    experiment_id: str
    run_id: str
    children: list[str] = field(default_factory=list)


def export_mlflow(path: Path, tracking_uri: str | None = None, experiment: str = DEFAULT_EXPERIMENT) -> Exported:
    """Export the run or study directory ``path`` into ``experiment`` (created if missing) of the
    tracking store at ``tracking_uri`` (default: MLflow's, e.g. ``MLFLOW_TRACKING_URI``)."""
    kind = _kind(path)
    client, uri = _client(tracking_uri)
    experiment_id = get_or_create_experiment(client, experiment)
    key = export_id(kind, path)
    done = client.search_runs([experiment_id], f"tags.`{EXPORT_ID}` = '{key}'", max_results=1)
    if done:
        raise RunDirError(f"{path} is already in MLflow: run {done[0].info.run_id} of experiment {experiment!r} at "
                          f"{uri}; delete that run to export it again")
    with _undo_on_failure(client) as created:
        if kind == "study":
            parent = _export_study(client, experiment_id, path, created)
        else:
            parent = _export_run(client, experiment_id, path, {}, created)
        client.set_tag(parent, EXPORT_ID, key)  # last: a partial export is never taken for a finished one
    return Exported(experiment_id, parent, [r for r in created if r != parent])


def _kind(path: Path) -> str:
    if (path / "study.json").is_file():
        return "study"
    if all((path / name).is_file() for name in ("config.yaml", "ps.csv", "summary.json")):
        return "run"
    if (path / "sweep.json").is_file():
        raise RunDirError(f"{path} is a sweep: export each of its studies (its KEY=VALUE directories)")
    raise RunDirError(f"{path} is neither a finished run directory (config.yaml, ps.csv, summary.json) "
                      "nor a study directory (study.json)")


def _client(tracking_uri: str | None) -> tuple[MlflowClient, str]:
    """MLflow's client of ``tracking_uri`` (None: MLflow's default), and that URI."""
    try:
        from mlflow import MlflowClient, get_tracking_uri
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] != "mlflow":
            raise
        raise ConfigError('export mlflow needs MLflow, which is not installed: pip install "switchps[mlflow]"') \
            from None
    uri = tracking_uri or get_tracking_uri()
    return MlflowClient(tracking_uri=uri), uri


@contextmanager
def _undo_on_failure(client: MlflowClient) -> Iterator[list[str]]:
    """The list the caller appends the runs it creates to; on an error they are deleted."""
    created: list[str] = []
    try:
        yield created
    except BaseException:
        for run_id in created:
            client.delete_run(run_id)
        raise


def _export_run(client: MlflowClient, experiment_id: str, run_dir: Path, tags: Mapping[str, str],
                created: list[str]) -> str:
    """One MLflow run from ``run_dir``, finished; its id, also appended to ``created`` once the run exists."""
    from mlflow.entities import Metric, RunTag
    from mlflow.utils.validation import MAX_TAG_VAL_LENGTH

    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    start_ms = _mtime_ms(run_dir / "config.yaml")
    name = tags.get("mlflow.runName") or str(summary.get("name") or run_dir.name)
    run = client.create_run(experiment_id, start_time=start_ms, run_name=name, tags={
        "switchps.run_dir": str(run_dir.resolve()), "switchps.protocol": str(summary.get("protocol")),
        "switchps.framework": str(summary.get("framework")), "switchps.device": str(summary.get("device")),
        **tags})
    run_id = run.info.run_id
    created.append(run_id)
    series = [*row_metrics("ps", _rows(run_dir / "ps.csv"), start_ms),
              *row_metrics("eval", _rows(run_dir / "eval.csv"), start_ms)]
    final_step, end_ms = int(summary.get("final_version") or 0), _mtime_ms(run_dir / "summary.json")
    numbers, texts = _split(flatten(summary))
    finals = [Metric(k, v, end_ms, final_step) for k, v in numbers.items()]
    log_batches(client, run_id, [*series, *finals], params(config),
                [RunTag(f"summary.{k}", cut(v, MAX_TAG_VAL_LENGTH)) for k, v in texts.items()])
    for name in RUN_FILES:
        if (run_dir / name).is_file():
            client.log_artifact(run_id, str(run_dir / name))
    with tempfile.TemporaryDirectory() as tmp:
        client.log_artifacts(run_id, str(_plots(run_dir, Path(tmp))), "plots")
    for model in _models(run_dir):
        client.log_artifact(run_id, str(model), "model")
    client.set_terminated(run_id, "KILLED" if summary.get("interrupted") else "FINISHED", end_ms)
    return run_id


def _export_study(client: MlflowClient, experiment_id: str, study_dir: Path, created: list[str]) -> str:
    """The parent run of ``study_dir`` and a child per run of its study.json; the parent's id. Each run
    is appended to ``created`` as it is made."""
    from mlflow.entities import Metric

    study = json.loads((study_dir / "study.json").read_text())
    runs = [(r, _run_dir(study_dir, r["run_dir"])) for r in study["runs"]]
    start_ms = min([_mtime_ms(d / "config.yaml") for _, d in runs], default=_mtime_ms(study_dir / "study.json"))
    end_ms = _mtime_ms(study_dir / "study.json")
    parent = client.create_run(experiment_id, start_time=start_ms, run_name=study["study"], tags={
        "switchps.study": study["study"], "switchps.study_dir": str(study_dir.resolve())}).info.run_id
    created.append(parent)
    for run, run_dir in runs:
        _export_run(client, experiment_id, run_dir, {
            "mlflow.parentRunId": parent, "mlflow.runName": f"{run['arm']} repeat {run['repeat']}",
            "switchps.arm": run["arm"], "switchps.repeat": str(run["repeat"])}, created)
    means = [Metric(f"{arm}/{metric}{suffix}", value, end_ms, 0)
             for arm, estimates in study["arms"].items() for metric, e in estimates.items()
             for suffix, value in (("", e["mean"]), ("_ci95", e["ci95"])) if value is not None]
    log_batches(client, parent, means, params(study["spec"]))
    for name in ["study.json", *sorted(p.name for p in study_dir.glob("*.png"))]:
        client.log_artifact(parent, str(study_dir / name))
    client.set_terminated(parent, "FINISHED", end_ms)
    return parent


def _run_dir(study_dir: Path, listed: str) -> Path:
    """A run of study.json: its path as the study wrote it (relative to where the study ran), else by its
    name under the study's ``runs/`` (a study directory moved or read from elsewhere)."""
    path = Path(listed)
    return path if (path / "summary.json").is_file() else study_dir / "runs" / path.name


def _split(flat: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, str]]:
    """A summary's numbers (bools are not), and its other values (but None) as text."""
    numbers, texts = {}, {}
    for key, value in flat.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            numbers[key] = float(value)
        elif value is not None:
            texts[key] = param_value(value)
    return numbers, texts


def _rows(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _mtime_ms(path: Path) -> int:
    return int(path.stat().st_mtime * 1000)


def _plots(run_dir: Path, tmp: Path) -> Path:
    """The run's plots directory, or, if it has none, one written into ``tmp`` by ``switchps plot``'s code."""
    if any((run_dir / "plots").glob("*.png")):
        return run_dir / "plots"
    from switchps.runs.plots import plot_run

    plot_run(run_dir, tmp)
    return tmp


def _models(run_dir: Path) -> list[Path]:
    """The run's model files; if it has none but a checkpoint, the one `switchps export` writes from the
    latest (into the run directory, as that command does)."""
    found = [run_dir / name for name in MODEL_FILES if (run_dir / name).is_file()]
    if found or not any((run_dir / "checkpoints").glob("*.ckpt")):
        return found
    from switchps.runs.export import export

    return [export(run_dir)]
