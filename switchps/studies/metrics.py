"""What one run of a study measured, read from its run directory (see ``spec.METRICS``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from switchps.runs.record import read_csv


@dataclass(frozen=True)
class Accuracy:
    """A run's evaluations: times, versions, and the trailing mean of ``smooth`` accuracies."""

    time_s: np.ndarray
    version: np.ndarray
    smoothed: np.ndarray

    @classmethod
    def of(cls, run_dir: Path, smooth: int) -> "Accuracy":
        ev = read_csv(run_dir / "eval.csv")
        acc = np.asarray(ev["test_accuracy"], float)
        trailing = np.array([acc[max(0, i + 1 - smooth):i + 1].mean() for i in range(len(acc))])
        return cls(np.asarray(ev["time_s"], float), np.asarray(ev["version"], int), trailing)

    def first_at_least(self, target: float, after: float = -np.inf) -> int | None:
        hits = np.nonzero((self.smoothed >= target) & (self.time_s >= after))[0]
        return int(hits[0]) if len(hits) else None


def final_accuracy(run_dir: Path, last: int) -> float:
    """The mean of the last ``last`` evaluations (the last is of the final version)."""
    acc = read_csv(run_dir / "eval.csv")["test_accuracy"]
    return float(np.mean(acc[-last:]))


def run_metrics(run_dir: Path, target: float, smooth: int, last: int) -> dict[str, Any]:
    """Every metric of ``spec.METRICS`` for one finished run (None where it does not apply)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    acc = Accuracy.of(run_dir, smooth)
    ps = read_csv(run_dir / "ps.csv")
    hit = acc.first_at_least(target)
    epochs = _config_epochs(run_dir)
    per_epoch = summary["samples"] / epochs if epochs else None
    reached_samples = float(ps["samples"][ps["version"] <= acc.version[hit]].sum()) if hit is not None else None
    overhead = summary.get("switch_overhead_s") or {}
    return {
        "time_to_target_s": float(acc.time_s[hit]) if hit is not None else None,
        "epochs_to_target": reached_samples / per_epoch if per_epoch and reached_samples is not None else None,
        "final_accuracy": final_accuracy(run_dir, last),
        "samples_per_s": summary["samples_per_s"],
        "worker_utilization": summary["worker_utilization"],
        "seconds_per_update": summary["wall_time_s"] / summary["updates"] if summary["updates"] else None,
        "samples_per_worker_step": float(np.mean(ps["b_mean"])) if len(ps["b_mean"]) else None,
        "switches": summary["switches"],
        "switch_overhead_s": overhead.get("median"),
        "total_time_s": summary["wall_time_s"],
        "updates": summary["updates"],
        "bytes_sent": bytes_sent(run_dir, summary),
        **switch_dip(run_dir, acc),
    }


def bytes_sent(run_dir: Path, summary: dict[str, Any]) -> float | None:
    """The bytes the workers pushed: one model vector in the wire's type per push the PS took in (accepted,
    or dropped as late, as a backup worker's is), whether it carried a gradient or the movement of H local
    steps; None for a record without the model's size (``model_initialized``) or the push counts."""
    import yaml

    from switchps.protos.wire_dtype import wire_nbytes

    size = next((e["parameters"] for e in map(json.loads, (run_dir / "events.jsonl").read_text().splitlines())
                 if e["event"] == "model_initialized"), None)
    if size is None or "pushes_accepted" not in summary:
        return None
    wire = (yaml.safe_load((run_dir / "config.yaml").read_text()).get("runtime") or {}).get("wire_dtype", "float32")
    return float((summary["pushes_accepted"] + summary["pushes_dropped"]) * wire_nbytes(int(size), wire))


def switch_dip(run_dir: Path, acc: Accuracy) -> dict[str, float | None]:
    """Around the first protocol switch: how far the smoothed accuracy fell below its value just before
    (points), and how long after the switch it was back at that value, after its lowest point (None if
    it never came back; both None without a switch)."""
    switch_at = _first_switch_s(run_dir)
    if switch_at is None or not len(acc.time_s):
        return {"dip_points": None, "recovery_s": None}
    before_idx = np.nonzero(acc.time_s <= switch_at)[0]
    if not len(before_idx):
        return {"dip_points": None, "recovery_s": None}
    before = float(acc.smoothed[before_idx[-1]])
    after = np.nonzero(acc.time_s > switch_at)[0]
    if not len(after):
        return {"dip_points": 0.0, "recovery_s": 0.0}
    lowest = int(after[np.argmin(acc.smoothed[after])])
    dip = max(0.0, before - float(acc.smoothed[lowest]))
    if dip == 0.0:
        return {"dip_points": 0.0, "recovery_s": 0.0}
    back = acc.first_at_least(before, after=float(acc.time_s[lowest]))
    return {"dip_points": 100 * dip, "recovery_s": float(acc.time_s[back] - switch_at) if back is not None else None}


def _first_switch_s(run_dir: Path) -> float | None:
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event["event"] == "switch":
            return float(event["time_s"])
    return None


def _config_epochs(run_dir: Path) -> float | None:
    import yaml

    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    return (cfg.get("train") or {}).get("epochs")
