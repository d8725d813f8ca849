"""The run record's rows as MLflow metrics, logged in batches: what `switchps export mlflow` and the PS's
live logging (``output.mlflow``) share.

A row of ``ps.csv`` or ``eval.csv`` becomes one metric per numeric column, ``<table>/<column>``, at step =
its ``version`` and timestamp = the run's start plus its ``time_s`` (so MLflow's relative-time axis is the
record's). MLflow takes at most ``MAX_METRICS_PER_BATCH`` metrics and ``MAX_PARAMS_TAGS_PER_BATCH``
params and tags per ``log_batch`` call, and ``MAX_ENTITIES_PER_BATCH`` in all: ``log_batches`` cuts
longer lists into calls within all three.

``LiveLog`` is the live form (``output.mlflow``): an MLflow run that the PS's record flusher feeds each
flush's new rows, from the flusher's thread (an update never waits on it; a slow tracking store delays
only the next flush). Any failure of the tracking store is logged once, counted in ``failures`` with the
rows it lost, and never raised: training goes on. A resumed run logs on into the run it started.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from switchps.config.run import MlflowOutput, RunConfig

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param, RunTag

log = logging.getLogger("switchps.mlflow")

LIVE_ID = "switchps.live_id"
"""The tag of a live run: ``export_id("live", run_dir)``, by which a resumed run finds it."""

NOT_METRICS = ("time_s", "version")
"""Columns that place a row (its timestamp and step) rather than measure it."""


def row_metrics(table: str, rows: Iterable[Mapping[str, Any]], start_ms: int) -> list[Metric]:
    """Every finite numeric field of ``rows`` (a table's rows by column) as ``<table>/<column>`` at the
    row's version; text columns (protocol, workers, pushes) and empty fields are left out."""
    from mlflow.entities import Metric

    out = []
    for row in rows:
        step, time_s = int(float(row["version"])), float(row["time_s"])
        timestamp = start_ms + round(time_s * 1000)
        for column, value in row.items():
            if column in NOT_METRICS:
                continue
            number = _finite(value)
            if number is not None:
                out.append(Metric(f"{table}/{column}", number, timestamp, step))
    return out


def _finite(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def log_batches(client: MlflowClient, run_id: str, metrics: Sequence[Metric] = (), params: Sequence[Param] = (),
                tags: Sequence[RunTag] = ()) -> int:
    """Log everything in as few ``log_batch`` calls as MLflow's limits allow; the number of calls."""
    from mlflow.utils.validation import MAX_ENTITIES_PER_BATCH, MAX_METRICS_PER_BATCH, MAX_PARAMS_TAGS_PER_BATCH

    metrics, params, tags = list(metrics), list(params), list(tags)
    calls = 0
    while metrics or params or tags:
        p, params = params[:MAX_PARAMS_TAGS_PER_BATCH], params[MAX_PARAMS_TAGS_PER_BATCH:]
        t, tags = tags[:MAX_PARAMS_TAGS_PER_BATCH], tags[MAX_PARAMS_TAGS_PER_BATCH:]
        room = min(MAX_METRICS_PER_BATCH, MAX_ENTITIES_PER_BATCH - len(p) - len(t))
        m, metrics = metrics[:room], metrics[room:]
        client.log_batch(run_id, metrics=m, params=p, tags=t)
        calls += 1
    return calls


def get_or_create_experiment(client: MlflowClient, name: str) -> str:
    """The experiment ``name``, created if missing, as one of model training (MLflow 3's UI then opens on
    its runs, not on its GenAI traces)."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        return str(found.experiment_id)
    return str(client.create_experiment(name, tags={"mlflow.experimentKind": "custom_model_development"}))


def export_id(kind: str, path: Path) -> str:
    """The same for every export of one directory (by its resolved path), whatever the current directory."""
    return hashlib.sha256(f"{kind}:{path.resolve()}".encode()).hexdigest()[:16]


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as one level of dotted keys; an empty mapping stays a value."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def params(config: Mapping[str, Any]) -> list[Param]:
    """``config`` as MLflow params: dotted keys, strings as they are and other values as JSON, each cut
    to MLflow's ``MAX_PARAM_VAL_LENGTH`` (a cut value ends in "…")."""
    from mlflow.entities import Param
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    return [Param(k, cut(param_value(v), MAX_PARAM_VAL_LENGTH)) for k, v in flatten(config).items()]


def param_value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    log.warning("a value of %d characters is cut to MLflow's limit of %d", len(text), limit)
    return text[:limit - 1] + "…"


def live_log(cfg: RunConfig, run_dir: Path) -> LiveLog | None:
    """The live MLflow run ``cfg`` asks for (``output.mlflow``), if any."""
    spec = cfg.output.mlflow
    return None if spec is None else LiveLog(spec, run_dir, cfg.model_dump(mode="json"))


class LiveLog:
    """The MLflow run of a run directory while it trains (``output.mlflow``); made at the first flush."""

    def __init__(self, spec: MlflowOutput, run_dir: Path, config: Mapping[str, Any]) -> None:
        self.spec, self.run_dir, self.config = spec, run_dir, config
        self.start_ms = round(time.time() * 1000)
        self.client: MlflowClient | None = None
        self.run_id: str | None = None
        self.logged = 0
        """Rows logged."""
        self.failures = 0
        """Flushes whose rows the tracking store did not take."""
        self.lost = 0
        """Rows not logged."""

    def log(self, ps: Sequence[Mapping[str, Any]], evals: Sequence[Mapping[str, Any]]) -> None:
        """Log ``ps`` (ps.csv's new rows by column) and ``evals`` (eval.csv's); never raises."""
        if not ps and not evals and self.run_id is not None:
            return
        try:
            client, run_id = self._run()
            log_batches(client, run_id, [*row_metrics("ps", ps, self.start_ms),
                                         *row_metrics("eval", evals, self.start_ms)])
            self.logged += len(ps) + len(evals)
        except Exception as e:  # the tracking store's errors are many kinds (HTTP, SQL, a missing mlflow)
            self.failures += 1
            self.lost += len(ps) + len(evals)
            if self.failures == 1:
                log.warning("output.mlflow: %s: %s: %s; training goes on, rows not logged are counted in "
                            "summary.json's mlflow", self.spec.tracking_uri, type(e).__name__, e)

    def _run(self) -> tuple[MlflowClient, str]:
        """The client and the run: the one a previous PS of this run directory started, else a new one."""
        if self.client is not None and self.run_id is not None:
            return self.client, self.run_id
        from mlflow import MlflowClient

        client = MlflowClient(self.spec.tracking_uri)
        experiment = get_or_create_experiment(client, self.spec.experiment)
        key = export_id("live", self.run_dir)
        resumed = client.search_runs([experiment], f"tags.`{LIVE_ID}` = '{key}'", max_results=1)
        if resumed:
            run_id = resumed[0].info.run_id
        else:
            run_id = client.create_run(experiment, start_time=self.start_ms, run_name=str(self.config.get("name")),
                                       tags={LIVE_ID: key, "switchps.run_dir": str(self.run_dir.resolve())}).info.run_id
            log_batches(client, run_id, params=params(self.config))
        self.client, self.run_id = client, run_id
        return client, run_id

    def close(self) -> dict[str, int]:
        """End the MLflow run (if one was made); what ``summary.json``'s ``mlflow`` says."""
        if self.client is not None and self.run_id is not None:
            try:
                self.client.set_terminated(self.run_id)
            except Exception as e:
                self.failures += 1
                log.warning("output.mlflow: ending the run: %s: %s", type(e).__name__, e)
        return {"rows_logged": self.logged, "rows_lost": self.lost, "failures": self.failures}
