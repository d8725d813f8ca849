"""`switchps study dynamic-batching`: uniform batches vs Tyagi & Sharma's dynamic batching, one worker slow."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.table import Table

from switchps.config import parse_config
from switchps.jsonfile import write_json
from switchps.launcher import launch
from switchps.plots import console, read_csv
from switchps.studies.base import emulated_digits, merge


@dataclass
class DynamicBatchingStudy:
    """Tyagi & Sharma's setting, shrunk: BSP with one worker 3x slower, uniform batches vs dynamic batching,
    both for the same number of epochs."""

    workers: int = 4
    batch: int = 16
    samples_per_s: float = 128.0
    slow_factor: float = 3.0
    epochs: float = 15.0
    seed: int = 0
    out: str = "runs/dynamic-batching"

    def base(self) -> dict[str, Any]:
        return emulated_digits(
            self.seed, self.workers, self.samples_per_s, self.out, lr=0.05, train={"epochs": self.epochs},
            protocol={"name": "bsp", "batch": self.batch, "micro_batch": 4},
            stragglers={"slowdown": {"factors": {0: self.slow_factor}}})


def run_dynamic_batching(study: DynamicBatchingStudy, quiet: bool = True) -> dict[str, Any]:
    out = Path(study.out)
    arms = {"uniform": {}, "dynamic": {"policy": {"name": "dynamic_batching", "kwargs": {"every_rounds": 3}}}}
    rows = []
    for name, extra in arms.items():
        run_dir, summary = launch(parse_config(merge({**study.base(), "name": name}, extra)), quiet=quiet)
        ws = read_csv(run_dir / "workers.csv")
        last = {int(w): float(ws["samples"][ws["worker"] == w][-1]) for w in np.unique(ws["worker"])}
        rows.append({"arm": name, "run_dir": str(run_dir), "wall_time_s": summary["wall_time_s"],
                     "final_accuracy": summary["final_test_accuracy"], "updates": summary["updates"],
                     "final_batches": last})
    u, d = rows
    result = {"study": "dynamic-batching", "config": asdict(study), "arms": rows,
              "speedup": round(u["wall_time_s"] / d["wall_time_s"], 3),
              "accuracy_gap_points": round(100 * (d["final_accuracy"] - u["final_accuracy"]), 2)}
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "study.json", result)
    t = Table(title=f"Dynamic batching, worker 0 {study.slow_factor:g}x slower, {study.epochs:g} epochs: "
                    f"{result['speedup']}x sooner")
    for col in ("arm", "wall time (s)", "final acc", "updates", "final per-worker batches"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(r["arm"], f"{r['wall_time_s']:.1f}", f"{r['final_accuracy']:.4f}", str(r["updates"]),
                  " ".join(f"{w}:{b:g}" for w, b in sorted(r["final_batches"].items())))
    console().print(t)
    return result
