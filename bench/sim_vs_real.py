"""The simulator against the real system: every run of real studies simulated again, same config, seed
and straggler delays, and the two compared per arm (mean over the study's seeds).

``compare``: each real run listed in a study's ``runs.jsonl`` is simulated
(``switchps.sim.run.simulate``, real gradients) from its own ``config.yaml`` with ``stragglers: {trace:
<its stragglers.csv>}`` (the delays it faced, step by step; the trace it replayed if it recorded none),
its seed, and ``network.push_overhead_s`` = ``--overhead``. Per arm, real vs simulated mean of: seconds
per update, samples per second and mean staleness (relative difference, within 10 %), time to the study's
target (its study.json ``target``, within 20 %) and final accuracy (difference in points, within 1), each
from ``switchps.studies.metrics.run_metrics`` with the study's smoothing. Mean staleness is the PS's: the
mean over applied pushes of (version when it arrived - its base version), ps.csv's ``staleness_mean``
weighted by each update's pushes. Beside them, where the time goes (``diagnostics``, real and simulated):
per push, its round trip beyond the PS's wait (``rpc_s``: workers.csv ``send_s - wait_s``: RPC,
serialization, link) and its time on the emulated link as the PS recorded it (``link_s``); per step, the
worker's time beyond its compute and sleeps (``local_s``: between two arrivals, less the round trip,
compute_s and sleep_s: gradient read-out, parameter load, sleep overshoot); the fraction of pushes
arriving within 1 ms of the one before (``bunched``: workers in lockstep); the first push's arrival; how
many updates behind the PS the evaluated version was. ``trace_check`` confirms each simulation replayed
the real delays: stragglers.csv rows and workers.csv sleep_s per (worker, step) agree. Exits 1 when a
tolerance fails.

``fit``: ``network.push_overhead_s`` and ``network.push_jitter_s`` from the real runs' records alone. A
simulated step costs its compute, sleeps, the PS's wait, its link transfers and the overhead, nothing
else, so the overhead is what a real step costs beyond those: ``rpc_s + local_s - link_s``, the link time
being the PS's own record of its emulated link in that run. (Subtracting a simulation's link time
instead would mix in how differently the workers crowd the link in the two runs, which depends on their
timing, not on a per-push cost: see ``bunched``.) That cost is not constant: scheduling and RPC noise
keep real workers out of lockstep, and simulated ones without it finish their link transfers together
and stay in step. The simulator models it as a constant plus an exponential jitter. The jitter's mean is
the exponential scale of the per-step cost, (q75 - q25) / ln 3 (robust to the rare long pauses), pooled
over the steps of runs without an emulated link, where the cost is seen alone (behind a link each step's
share of it varies with the crowd); the constant is the mean over every step of every run less the
jitter. Per-arm estimates are printed beside the pooled ones.

    python bench/sim_vs_real.py compare REAL_STUDY_DIR... [--overhead S] [--jitter S] [--out DIR]
    python bench/sim_vs_real.py fit REAL_STUDY_DIR...

With ``--out`` the simulated runs are kept there (OUT/o<overhead>-j<jitter>/<study>/<arm>-<repeat>) and
reused by a later call with the same overhead and jitter; without it they go to a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from switchps.config.run import load_config
from switchps.jsonfile import dumps
from switchps.runs.record import read_csv
from switchps.straggler_trace import load_trace
from switchps.studies.metrics import run_metrics

TOLERANCES: dict[str, tuple[str, float]] = {
    "seconds_per_update": ("relative", 0.10), "samples_per_s": ("relative", 0.10),
    "staleness_mean": ("relative", 0.10), "time_to_target_s": ("relative", 0.20), "final_accuracy": ("points", 1.0)}
"""metric -> (how the difference is measured, its tolerance)."""
DIAGNOSTICS = ("rpc_s", "local_s", "link_s", "bunched", "compute_s", "sleep_s", "wait_s", "first_push_s",
               "eval_lag_updates")


@dataclass(frozen=True)
class Study:
    """A real study's directory: its name, target, smoothing and finished runs ((arm, repeat) -> dir)."""

    name: str
    target: float
    smooth: int
    last: int
    runs: dict[tuple[str, int], Path]

    @classmethod
    def read(cls, out: Path) -> "Study":
        result = json.loads((out / "study.json").read_text())
        runs: dict[tuple[str, int], Path] = {}
        for line in (out / "runs.jsonl").read_text().splitlines():
            r = json.loads(line)
            if (Path(r["run_dir"]) / "summary.json").exists():
                runs[(r["arm"], int(r["repeat"]))] = Path(r["run_dir"])
        spec = result["spec"]
        return cls(result["study"], float(result["target"]), int(spec["smooth_evals"]), int(spec["final_evals"]),
                   dict(sorted(runs.items(), key=lambda kv: (list(spec["arms"]).index(kv[0][0]), kv[0][1]))))


def trace_of(real_dir: Path) -> Path | None:
    """The delays a real run faced: its own stragglers.csv, else the trace its config replayed."""
    if (real_dir / "stragglers.csv").exists():
        return real_dir / "stragglers.csv"
    raw = load_config(real_dir / "config.yaml", role="simulate").stragglers.trace
    return Path(raw) if raw else None


def simulated(real_dir: Path, sim_dir: Path, overhead: float, jitter: float) -> Path:
    """``real_dir``'s run simulated into ``sim_dir`` (reused if a finished one is there)."""
    from switchps.sim.run import simulate

    if (sim_dir / "summary.json").exists():
        return sim_dir
    shutil.rmtree(sim_dir, ignore_errors=True)  # a simulation cut short
    overrides = [f"network.push_overhead_s={overhead!r}", f"network.push_jitter_s={jitter!r}"]
    trace = trace_of(real_dir)
    if trace is not None:
        overrides.append("stragglers=" + json.dumps({"trace": str(trace)}))
    cfg = load_config(real_dir / "config.yaml", overrides, role="simulate")
    sim_dir.parent.mkdir(parents=True, exist_ok=True)
    simulate(cfg, sim_dir, quiet=True)
    return sim_dir


def staleness_mean(run_dir: Path) -> float | None:
    """The mean over applied pushes of their staleness (ps.csv's per-update mean, weighted by pushes)."""
    ps = read_csv(run_dir / "ps.csv")
    if not len(ps.get("version", [])):
        return None
    pushes = np.array([len(str(w).split(";")) for w in ps["workers"]], float)
    return float(np.sum(np.asarray(ps["staleness_mean"], float) * pushes) / pushes.sum())


def by_worker(run_dir: Path) -> dict[str, np.ndarray]:
    """workers.csv sorted by (worker, step), with ``follows``: the row is the worker's next step after
    the row before it."""
    w = read_csv(run_dir / "workers.csv")
    order = np.lexsort((w["step"], w["worker"]))
    w = {k: np.asarray(v)[order].astype(float) for k, v in w.items() if k != "loss"}
    follows = np.zeros(len(w["step"]), bool)
    follows[1:] = (np.diff(w["worker"]) == 0) & (np.diff(w["step"]) == 1)
    return {**w, "follows": follows}


def step_extra(run_dir: Path) -> np.ndarray:
    """Each step's cost beyond its compute, sleeps, the PS's wait and the link's mean time:
    ``rpc_s + local_s - link_s`` per step (the module docstring)."""
    w = by_worker(run_dir)
    gap = np.diff(w["time_s"], prepend=np.nan)
    return (gap - w["compute_s"] - w["sleep_s"] - w["wait_s"])[w["follows"]] - link_s(run_dir)


def step_costs(run_dir: Path) -> dict[str, float]:
    """Where a run's worker time went, per step (see the module docstring): ``rpc_s``, ``local_s``,
    ``compute_s``, ``sleep_s``, ``wait_s``, ``first_push_s``; ``steps`` counted."""
    w = by_worker(run_dir)
    f = w["follows"]
    gap = np.diff(w["time_s"], prepend=np.nan)
    local = gap - w["send_s"] - w["compute_s"] - w["sleep_s"]
    return {"rpc_s": _mean((w["send_s"] - w["wait_s"])[f]), "local_s": _mean(local[f]),
            "compute_s": _mean(w["compute_s"]), "sleep_s": _mean(w["sleep_s"]), "wait_s": _mean(w["wait_s"][f]),
            "first_push_s": _mean(w["time_s"][w["step"] == 0]), "steps": float(f.sum())}


def _mean(x: np.ndarray) -> float:
    return float(np.mean(x)) if len(x) else math.nan


def link_s(run_dir: Path) -> float:
    """A push's time on the emulated link, from the PS's own record of it (summary.json): the model's
    bytes across each direction at the link's rate, plus each direction's mean sharing delay per
    transfer (the initial pulls count among them; 0 without a link). The model's bytes are float32
    values, as the wire carries them."""
    link = json.loads((run_dir / "summary.json").read_text()).get("emulated_link")
    if not link:
        return 0.0
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event["event"] == "model_initialized":
            crossing_s = 4 * int(event["parameters"]) * 8 / (float(link["mbit_s"]) * 1e6)
            return 2 * crossing_s + link["inbound_mean_sharing_delay_s"] + link["outbound_mean_sharing_delay_s"]
    raise ValueError(f"{run_dir}/events.jsonl: no model_initialized event (the model's size)")


def bunched(run_dir: Path) -> float:
    """The fraction of pushes that reached the PS within 1 ms of the one before (workers in lockstep)."""
    t = np.sort(np.asarray(read_csv(run_dir / "workers.csv")["time_s"], float))
    return float(np.mean(np.diff(t) < 1e-3)) if len(t) > 1 else math.nan


def eval_lag(run_dir: Path) -> float | None:
    """Mean over evaluations of how many updates the PS had made beyond the version evaluated."""
    ev, ps = read_csv(run_dir / "eval.csv"), read_csv(run_dir / "ps.csv")
    if not len(ev.get("time_s", [])) or not len(ps.get("time_s", [])):
        return None
    at = np.searchsorted(np.asarray(ps["time_s"], float), np.asarray(ev["time_s"], float), side="right")
    current = np.where(at > 0, np.asarray(ps["version"], float)[np.maximum(at - 1, 0)], 0.0)
    return float(np.mean(current - np.asarray(ev["version"], float)))


def measure(run_dir: Path, study: Study) -> dict[str, Any]:
    """The compared metrics and the diagnostics of one run."""
    m = run_metrics(run_dir, study.target, study.smooth, study.last)
    costs = step_costs(run_dir)
    return {"seconds_per_update": m["seconds_per_update"], "samples_per_s": m["samples_per_s"],
            "staleness_mean": staleness_mean(run_dir), "time_to_target_s": m["time_to_target_s"],
            "final_accuracy": m["final_accuracy"], **{k: costs[k] for k in DIAGNOSTICS if k in costs},
            "link_s": link_s(run_dir), "bunched": bunched(run_dir), "eval_lag_updates": eval_lag(run_dir),
            "steps": costs["steps"]}


def trace_check(real_dir: Path, sim_dir: Path) -> dict[str, int]:
    """Whether the simulation replayed the real delays: stragglers.csv rows and workers.csv sleep_s
    for the (worker, step)s both have (a worker may step more often in one of them)."""
    real_t, sim_t = [load_trace(d / "stragglers.csv") if (d / "stragglers.csv").exists() else {}
                     for d in (real_dir, sim_dir)]
    common = real_t.keys() & sim_t.keys()
    sleeps = [{(int(a), int(b)): s for a, b, s in zip(w["worker"], w["step"], w["sleep_s"])}
              for w in (by_worker(real_dir), by_worker(sim_dir))]
    both = sleeps[0].keys() & sleeps[1].keys()
    return {"trace_steps_real": len(real_t), "trace_steps_sim": len(sim_t), "trace_steps_compared": len(common),
            "trace_steps_differing": sum(real_t[k] != sim_t[k] for k in common),
            "sleep_rows_compared": len(both),
            "sleep_rows_differing": sum(not math.isclose(sleeps[0][k], sleeps[1][k], rel_tol=1e-4, abs_tol=1e-6)
                                        for k in both)}


def mean_of(values: list[float | None]) -> tuple[float | None, int]:
    """The mean of the values that exist, and how many are missing (e.g. a target never reached)."""
    have = [v for v in values if v is not None and math.isfinite(v)]
    return (float(np.mean(have)) if have else None), len(values) - len(have)


def judge(metric: str, real: list[float | None], sim: list[float | None]) -> dict[str, Any]:
    """Real vs simulated mean of one metric over an arm's seeds, and whether they agree."""
    (r, r_missing), (s, s_missing) = mean_of(real), mean_of(sim)
    kind, tol = TOLERANCES[metric]
    diff: float | None = None
    if r is not None and s is not None:
        if kind == "points":
            diff = 100 * (s - r)
        elif r != 0:
            diff = (s - r) / r
        elif s == 0:
            diff = 0.0
    ok = (r is None and s is None) or (r_missing == s_missing and diff is not None and abs(diff) <= tol)
    return {"real": r, "sim": s, "diff": diff, "unit": kind, "tolerance": tol, "pass": bool(ok),
            "real_missing": r_missing, "sim_missing": s_missing}


def simulate_study(study: Study, out: Path, overhead: float, jitter: float) -> list[dict[str, Any]]:
    """Every run of ``study`` simulated at ``overhead`` and ``jitter``, measured beside its real run."""
    rows = []
    for (arm, repeat), real_dir in study.runs.items():
        sim_dir = simulated(real_dir, out / f"o{overhead:g}-j{jitter:g}" / study.name / f"{arm}-{repeat}",
                            overhead, jitter)
        rows.append({"arm": arm, "repeat": repeat, "real_dir": str(real_dir), "sim_dir": str(sim_dir),
                     "trace": str(trace) if (trace := trace_of(real_dir)) else None, "real": measure(real_dir, study),
                     "sim": measure(sim_dir, study), "trace_check": trace_check(real_dir, sim_dir)})
    return rows


def arm_table(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm: each compared metric judged, and the diagnostics' real and simulated means."""
    arms: dict[str, Any] = {}
    for arm in dict.fromkeys(r["arm"] for r in rows):
        mine = [r for r in rows if r["arm"] == arm]
        arms[arm] = {
            "seeds": len(mine),
            "metrics": {m: judge(m, [r["real"][m] for r in mine], [r["sim"][m] for r in mine]) for m in TOLERANCES},
            "diagnostics": {d: {"real": mean_of([r["real"][d] for r in mine])[0],
                                "sim": mean_of([r["sim"][d] for r in mine])[0]} for d in DIAGNOSTICS}}
    return arms


def compare(studies: list[Study], out: Path, overhead: float, jitter: float) -> dict[str, Any]:
    """The ``compare`` result: per study its target, arms and runs; which tolerances failed."""
    result: dict[str, Any] = {"benchmark": "sim_vs_real", "overhead_s": overhead, "jitter_s": jitter,
                              "tolerances": {m: {"unit": k, "tolerance": t} for m, (k, t) in TOLERANCES.items()},
                              "studies": {}}
    failed = []
    for study in studies:
        rows = simulate_study(study, out, overhead, jitter)
        arms = arm_table(rows)
        failed += [f"{study.name}/{arm}/{m}" for arm, a in arms.items() for m, j in a["metrics"].items()
                   if not j["pass"]]
        result["studies"][study.name] = {"target": study.target, "arms": arms, "runs": rows}
    return {**result, "failed": failed, "passed": not failed}


def exponential_scale(x: np.ndarray) -> float:
    """The scale of a shifted exponential fitted to ``x`` by its quartiles: (q75 - q25) / ln 3."""
    q25, q75 = np.percentile(x, [25, 75])
    return float((q75 - q25) / math.log(3))


def fit(studies: list[Study], dirs: list[Path]) -> dict[str, Any]:
    """``network.push_overhead_s`` and ``push_jitter_s`` from the real runs' own records (module
    docstring), pooled over steps."""
    per_arm: dict[str, Any] = {}
    every, alone = [], []  # each step's cost: of every run, of runs without an emulated link
    for study in studies:
        for (arm, repeat), real_dir in study.runs.items():
            c, link, extra = step_costs(real_dir), link_s(real_dir), step_extra(real_dir)
            every.append(extra)
            if link == 0:
                alone.append(extra)
            entry = per_arm.setdefault(f"{study.name}/{arm}", {"runs": []})
            entry["runs"].append({"repeat": repeat, "rpc_s": c["rpc_s"], "local_s": c["local_s"], "link_s": link,
                                  "overhead_s": float(np.mean(extra)) if len(extra) else math.nan,
                                  "jitter_s": exponential_scale(extra) if link == 0 and len(extra) else None,
                                  "steps": c["steps"]})
    for entry in per_arm.values():
        entry["overhead_s"] = float(np.mean([r["overhead_s"] for r in entry["runs"]]))
    pooled = np.concatenate(every) if every else np.empty(0)
    seen = np.concatenate(alone) if alone else np.empty(0)
    jitter = round(max(0.0, exponential_scale(seen)), 6) if len(seen) else 0.0
    overhead = round(max(0.0, float(np.mean(pooled)) - jitter), 6) if len(pooled) else 0.0
    return {"benchmark": "sim_vs_real_fit", "fitted_push_overhead_s": overhead, "fitted_push_jitter_s": jitter,
            "jitter_steps": int(len(seen)),
            "estimator": "jitter: (q75 - q25) / ln 3 of send_s - wait_s + local_s per step of the runs without an "
                         "emulated link; overhead: the mean over every step of every run of send_s - wait_s + "
                         "local_s - link_s, less the jitter (module docstring)",
            "per_arm": per_arm, "set": f"--set network.push_overhead_s={overhead} --set network.push_jitter_s={jitter}",
            "command": f"python bench/sim_vs_real.py compare {' '.join(map(str, dirs))} --overhead {overhead} "
                       f"--jitter {jitter}"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    cmp = sub.add_parser("compare", help="simulate every real run and compare per arm (exit 1 on a failure)")
    cmp.add_argument("--overhead", type=float, default=0.0, help="network.push_overhead_s of the simulations")
    cmp.add_argument("--jitter", type=float, default=0.0, help="network.push_jitter_s of the simulations")
    cmp.add_argument("--out", type=Path, help="keep the simulated runs here (and reuse them)")
    fit_ = sub.add_parser("fit", help="fit network.push_overhead_s and push_jitter_s from the real runs' records")
    for p in (cmp, fit_):
        p.add_argument("studies", nargs="+", type=Path, metavar="REAL_STUDY_DIR",
                       help="a real study's --out (runs.jsonl and study.json)")
    args = ap.parse_args(argv)
    studies = [Study.read(d) for d in args.studies]
    if args.command == "fit":
        print(dumps(fit(studies, args.studies), indent=2))
        return 0
    out = args.out or Path(tempfile.mkdtemp(prefix="switchps-simreal-"))
    try:
        result = compare(studies, out, args.overhead, args.jitter)
    finally:
        if args.out is None:
            shutil.rmtree(out, ignore_errors=True)
    print(dumps(result, indent=2))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
