"""The run record's rows as MLflow metrics, logged in batches: what `switchps export mlflow` and the PS's
live logging (``output.mlflow``) share.

A row of ``ps.csv`` or ``eval.csv`` becomes one metric per numeric column, ``<table>/<column>``, at step =
its ``version`` and timestamp = the run's start plus its ``time_s`` (so MLflow's relative-time axis is the
record's). MLflow takes at most ``MAX_METRICS_PER_BATCH`` metrics and ``MAX_PARAMS_TAGS_PER_BATCH``
params and tags per ``log_batch`` call, and ``MAX_ENTITIES_PER_BATCH`` in all: ``log_batches`` cuts
longer lists into calls within all three.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param, RunTag

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
