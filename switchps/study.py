"""`switchps study amb-vs-fmb`: Anytime vs fixed mini-batch on the same straggler trace.

Eight emulated workers train digits under the `niagara` straggler mixture
(scaled down in time so the study is short; scaling keeps the ratios). FMB
runs first and records its straggler trace; AMB then replays exactly that
trace. AMB's time budget T is chosen so its mean batch matches FMB's batch, as
in the AMB paper: T = C + E[sleep], where C = batch / samples_per_s is FMB's
compute time per step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.table import Table

from switchps.config import parse_config
from switchps.jsonfile import write_json
from switchps.launcher import launch
from switchps.plots import console, read_csv, time_to_target
from switchps.ps_server.optimizers import asynchrony_momentum
from switchps.straggler_config import MixtureSpec, expected_mixture_mean


MOMENTUM = 0.9


MLP = {"name": "mlp", "kwargs": {"hidden": [64]}}


def emulated_digits(seed: int, workers: int, samples_per_s: float, out: str, lr: float, train: dict[str, Any],
                    model: dict[str, Any] = MLP, **sections: dict[str, Any]) -> dict[str, Any]:
    """The config every packaged study starts from: a model (an MLP unless given) on digits with emulated workers."""
    return _merge({
        "seed": seed, "cluster": {"workers": workers}, "model": model,
        "data": {"name": "digits"}, "optimizer": {"name": "momentum", "learning_rate": lr, "params": {"momentum": MOMENTUM}},
        "train": train,
        "eval": {"every_s": 1.0}, "output": {"dir": out}, "device": {"samples_per_s": samples_per_s},
    }, sections)


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@dataclass
class AmbStudy:
    """Defaults: C = batch / samples_per_s = 1 s of emulated compute per FMB step, with niagara's
    times scaled by 1/4. That is the paper's regime of C = 4 s against unscaled niagara, where the
    per-step gain is largest: a sleep longer than T still delays an AMB round, because a worker
    always finishes at least one micro-batch."""

    workers: int = 8
    batch: int = 16
    micro_batch: int = 1
    samples_per_s: float = 16.0
    scale: float = 0.25
    steps: int = 100
    target: float = 0.9
    seed: int = 0
    out: str = "runs/amb-vs-fmb"

    def base(self) -> dict[str, Any]:
        return emulated_digits(self.seed, self.workers, self.samples_per_s, self.out, lr=0.05,
                               train={"steps": self.steps}, eval={"target_accuracy": self.target})

    @property
    def mixture(self) -> dict[str, Any]:
        return {"preset": "niagara", "scale": self.scale}

    def time_budget_s(self) -> float:
        return self.batch / self.samples_per_s + expected_mixture_mean(MixtureSpec(**self.mixture))


@dataclass
class Arm:
    name: str
    run_dir: Path
    time_to_target_s: float | None
    final_accuracy: float
    best_accuracy: float
    seconds_per_step: float
    samples_per_step: float
    worker_utilization: float


def _arm(name: str, run_dir: Path, summary: dict, target: float) -> Arm:
    ev, ps = read_csv(run_dir / "eval.csv"), read_csv(run_dir / "ps.csv")
    return Arm(name, run_dir, time_to_target(ev["time_s"], ev["test_accuracy"], target),
               summary["final_test_accuracy"], summary["best_test_accuracy"],
               summary["wall_time_s"] / summary["updates"], float(np.mean(ps["b_mean"])),
               summary["worker_utilization"])


def run_amb_vs_fmb(study: AmbStudy, quiet: bool = True) -> dict[str, Any]:
    """Run both arms and write the table, ``amb_vs_fmb.png`` and ``study.json`` into ``study.out``."""
    out = Path(study.out)
    base = study.base()
    fmb_cfg = parse_config({**base, "name": "fmb", "stragglers": {"mixture": study.mixture},
                            "protocol": {"name": "fmb", "batch": study.batch, "micro_batch": study.micro_batch}})
    fmb_dir, fmb = launch(fmb_cfg, quiet=quiet)
    budget = study.time_budget_s()
    amb_cfg = parse_config({**base, "name": "amb", "stragglers": {"trace": str(fmb_dir / "stragglers.csv")},
                            "protocol": {"name": "amb", "batch": study.batch, "micro_batch": study.micro_batch,
                                         "time_budget_s": budget, "max_batch": 4 * study.batch}})
    amb_dir, amb = launch(amb_cfg, quiet=quiet)
    arms = [_arm("fmb", fmb_dir, fmb, study.target), _arm("amb", amb_dir, amb, study.target)]
    f, a = arms
    result = {
        "study": "amb-vs-fmb", "config": asdict(study), "amb_time_budget_s": round(budget, 4),
        "arms": [{**asdict(x), "run_dir": str(x.run_dir)} for x in arms],
        "speedup_time_to_target": round(f.time_to_target_s / a.time_to_target_s, 3)
        if f.time_to_target_s and a.time_to_target_s else None,
        "speedup_seconds_per_step": round(f.seconds_per_step / a.seconds_per_step, 3),
    }
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "study.json", result)
    plot_amb_vs_fmb(arms, study.target, out / "amb_vs_fmb.png")
    console().print(study_table(arms, study.target, result))
    return result


def study_table(arms: list[Arm], target: float, result: dict[str, Any]) -> Table:
    t = Table(title=f"AMB vs FMB, {result['config']['workers']} emulated workers, niagara stragglers "
                    f"(x{result['config']['scale']}), same trace; speedup to {target}: "
                    f"{result['speedup_time_to_target']}x")
    for col in ("arm", f"time to {target} (s)", "final acc", "best acc", "s / step", "samples / worker-step",
                "worker utilization"):
        t.add_column(col, justify="right")
    for x in arms:
        ttt = "—" if x.time_to_target_s is None else f"{x.time_to_target_s:.1f}"
        t.add_row(x.name, ttt, f"{x.final_accuracy:.4f}", f"{x.best_accuracy:.4f}", f"{x.seconds_per_step:.3f}",
                  f"{x.samples_per_step:.1f}", f"{x.worker_utilization:.1%}")
    return t


def plot_amb_vs_fmb(arms: list[Arm], target: float, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 4.2), layout="constrained")
    acc, loss, hist = fig.subplots(1, 3)
    for x in arms:
        ev, ps, ws = (read_csv(x.run_dir / f) for f in ("eval.csv", "ps.csv", "workers.csv"))
        acc.plot(ev["time_s"], ev["test_accuracy"], label=x.name.upper())
        loss.plot(ps["version"], ps["train_loss"], label=x.name.upper(), alpha=0.8)
        hist.hist(ws["samples"], bins=np.arange(0, ws["samples"].max() + 2) - 0.5, alpha=0.55, label=x.name.upper())
    acc.axhline(target, ls="--", c="grey", lw=0.8)
    acc.set(xlabel="time (s)", ylabel="test accuracy", title="accuracy vs time", ylim=(0, 1))
    loss.set(xlabel="step (model version)", ylabel="training loss", title="loss vs step", yscale="log")
    hist.set(xlabel="samples per worker-step", ylabel="count", title="batch sizes")
    for ax in (acc, loss, hist):
        ax.legend()
    fig.savefig(path, dpi=110)


@dataclass
class SyncSwitchStudy:
    """Sync-Switch's setting, shrunk: 8 emulated workers behind one emulated PS link, transient stragglers
    (2 workers 3x slower for a few seconds at a time), every arm under the same seeded episodes (they are
    a function of the run seed and wall time since training start, identical across arms).

    The emulated PS link makes communication cost what it costs in a cluster: at 5 Mbit/s a BSP round's
    8 pushes and 8 replies of the 19 kB MLP share the link for 0.5 s, twice the round's 0.25 s of compute,
    while ASP's transfers, spread in time, overlap other workers' compute. With ``ps_link_mbit_s=None``
    (loopback only) BSP pays for the stragglers alone. Every arm runs with the asynchrony momentum rule at
    switches, and the ASP arm starts with what the hybrid switches to."""

    workers: int = 8
    batch: int = 16
    samples_per_s: float = 64.0
    ps_link_mbit_s: float | None = 5.0
    lr: float = 0.2
    """BSP's learning rate at the global batch N*b: the best of 0.1, 0.2 and 0.4 in epochs to 0.95."""
    switch_lr: float = 16.0
    """``on_switch.lr`` factor: BSP -> ASP divides the learning rate by 16, the linear rule's N = 8 times 2.
    ASP at the linear rule's rate (then the momentum rule) diverged from BSP's tuned 0.2; at half of it,
    and at a quarter, it trained."""
    epochs: float = 12.0
    bsp_fraction: float = 0.125
    episode_s: float = 4.0
    every_s: float = 8.0
    factor: float = 3.0
    model: str = "mlp"
    """mlp (64 hidden units) or logreg."""
    arms_run: tuple[str, ...] = ("bsp", "asp", "hybrid", "greedy", "elastic", "anytime")
    """Which arms to run; BSP, the reference, always runs."""
    seed: int = 0
    out: str = "runs/sync-switch"

    def __post_init__(self) -> None:
        unknown = set(self.arms_run) - set(SyncSwitchStudy.arms_run)
        if unknown:
            raise ValueError(f"unknown arm(s) {sorted(unknown)}; choose from {sorted(SyncSwitchStudy.arms_run)}")

    def base(self) -> dict[str, Any]:
        return emulated_digits(
            self.seed, self.workers, self.samples_per_s, self.out, lr=self.lr, train={"epochs": self.epochs},
            model=MLP if self.model == "mlp" else {"name": self.model, "kwargs": {}},
            protocol={"name": "bsp", "batch": self.batch, "micro_batch": 4},
            network={"ps_link_mbit_s": self.ps_link_mbit_s},
            policy={"on_switch": {"lr": self.switch_lr, "momentum": "asynchrony"}},
            stragglers={"transient": {"workers": 2, "factor": self.factor, "duration_s": self.episode_s,
                                      "every_s": self.every_s}})

    def arms(self) -> dict[str, dict[str, Any]]:
        """Run name -> config overrides, for BSP and the selected ``arms_run``."""
        f = self.bsp_fraction
        detect = {"threshold": 1.5, "patience": 2}
        every = {
            "bsp": ("bsp", {}),
            "asp": ("asp", {"protocol": {"name": "asp"}, "optimizer": self.asp_optimizer()}),
            "hybrid": (f"hybrid{f:g}", {"policy": {"name": "schedule",
                                                   "kwargs": {"phases": [{"bsp": f}, {"asp": 1 - f}]}}}),
            "greedy": ("greedy", {"policy": {"name": "greedy", "kwargs": {"bsp_fraction": f, **detect}}}),
            "elastic": ("elastic", {"policy": {"name": "elastic", "kwargs": detect}}),
            "anytime": ("anytime", {"policy": {"name": "anytime", "kwargs": detect}}),
        }
        return dict(every[a] for a in every if a == "bsp" or a in self.arms_run)


    def asp_optimizer(self) -> dict[str, Any]:
        """What the hybrid switches to, from the start: the learning rate divided by ``switch_lr``, then the
        momentum rule for N asynchronous workers."""
        momentum = asynchrony_momentum(MOMENTUM, self.workers)
        return {"learning_rate": self.lr / self.switch_lr * (1 - momentum) / (1 - MOMENTUM),
                "params": {"momentum": momentum}}


def run_sync_switch(study: SyncSwitchStudy, quiet: bool = True) -> dict[str, Any]:
    """Run every arm, then report them (``report_sync_switch``)."""
    runs = {}
    for name, extra in study.arms().items():
        runs[name] = launch(parse_config(_merge({**study.base(), "name": name}, extra)), quiet=quiet)
    return report_sync_switch(study, runs)


def report_sync_switch(study: SyncSwitchStudy, runs: dict[str, tuple[Path, dict]]) -> dict[str, Any]:
    """Write ``sync_switch.png`` and ``study.json`` for finished arms (BSP first), print the table."""
    out = Path(study.out)
    bsp_final = round(float(_smoothed_accuracy(runs["bsp"][0])[1][-1]), 4)
    target = bsp_final - 0.005
    rows = []
    for name, (run_dir, summary) in runs.items():
        overhead = summary.get("switch_overhead_s") or {}
        reached = _time_and_epochs_to(run_dir, target, summary["samples"] / study.epochs)
        rows.append({"arm": name, "run_dir": str(run_dir), "final_accuracy": round(float(_smoothed_accuracy(run_dir)[1][-1]), 4),
                     "time_to_bsp_minus_0.5_s": reached[0], "epochs_to_bsp_minus_0.5": reached[1],
                     "samples_per_s": summary["samples_per_s"],
                     "total_time_s": summary["wall_time_s"], "switches": summary["switches"],
                     "switch_overhead_median_s": overhead.get("median"), "switch_overhead_max_s": overhead.get("max"),
                     "step_time_s": _median_step_time(run_dir)})
    bsp_t = rows[0]["time_to_bsp_minus_0.5_s"]
    for r in rows:
        t = r["time_to_bsp_minus_0.5_s"]
        r["speedup_vs_bsp"] = round(bsp_t / t, 3) if bsp_t and t else None
    result = {"study": "sync-switch", "config": asdict(study), "bsp_final_accuracy": bsp_final,
              "target": target, "arms": rows}
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "study.json", result)
    plot_sync_switch(runs, target, out / "sync_switch.png")
    console().print(sync_switch_table(rows, target))
    return result


SMOOTH_EVALS = 5
"""Accuracies in the sync-switch study are means of the last 5 evaluations: one evaluation on digits'
360 test images moves by a point or more, which would decide a time-to-target comparison by chance."""


def _smoothed_accuracy(run_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """Evaluation times and the trailing mean of up to ``SMOOTH_EVALS`` evaluations' accuracy."""
    ev = read_csv(run_dir / "eval.csv")
    acc = np.cumsum(ev["test_accuracy"])
    window = np.minimum(np.arange(1, len(acc) + 1), SMOOTH_EVALS)
    acc[SMOOTH_EVALS:] -= acc[:-SMOOTH_EVALS].copy()
    return ev["time_s"], acc / window


def _time_and_epochs_to(run_dir: Path, target: float, samples_per_epoch: float) -> tuple[float | None, float | None]:
    """When the smoothed accuracy first reached ``target``, and how many epochs the model had seen by then."""
    times, acc = _smoothed_accuracy(run_dir)
    t = time_to_target(times, acc, target)
    if t is None:
        return None, None
    ev, ps = read_csv(run_dir / "eval.csv"), read_csv(run_dir / "ps.csv")
    version = int(ev["version"][ev["time_s"] == t][0])
    return t, round(float(ps["samples"][ps["version"] <= version].sum()) / samples_per_epoch, 2)


def _median_step_time(run_dir: Path) -> float:
    """A worker's median step: compute, injected delay and communication, without barrier waits."""
    ws = read_csv(run_dir / "workers.csv")
    step = ws["compute_s"] + ws["sleep_s"] + np.maximum(0.0, ws["send_s"] - ws["wait_s"])
    return round(float(np.median(step)), 4) if len(step) else 0.0


def sync_switch_table(rows: list[dict[str, Any]], target: float) -> Table:
    t = Table(title=f"Sync-Switch study: time to BSP's final accuracy - 0.5 points ({target:.4f})")
    for col in ("arm", "final", "to target (s)", "vs BSP", "epochs to target", "samples/s", "total (s)", "switches",
                "overhead (ms)", "step (s)"):
        t.add_column(col, justify="right")
    fmt = lambda v, f, k=1: "—" if v is None else format(v * k, f)  # noqa: E731
    for r in rows:
        t.add_row(r["arm"], fmt(r["final_accuracy"], ".4f"), fmt(r["time_to_bsp_minus_0.5_s"], ".1f"),
                  fmt(r["speedup_vs_bsp"], ".2f"), fmt(r["epochs_to_bsp_minus_0.5"], ".1f"),
                  fmt(r["samples_per_s"], ".0f"), fmt(r["total_time_s"], ".1f"), str(r["switches"]),
                  f"{fmt(r['switch_overhead_median_s'], '.0f', 1e3)}/{fmt(r['switch_overhead_max_s'], '.0f', 1e3)}",
                  fmt(r["step_time_s"], ".3f"))
    return t


PROTOCOL_COLORS = {"bsp": "tab:blue", "asp": "tab:orange", "ssp": "tab:green", "amb": "tab:red", "fmb": "tab:purple"}


def plot_sync_switch(runs: dict[str, tuple[Path, dict]], target: float, path: Path) -> None:
    """Accuracy vs time per arm, each with its protocol timeline as a strip underneath."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 7), layout="constrained")
    parts = fig.subfigures(2, 1, height_ratios=[2.2, 1])
    assert isinstance(parts, np.ndarray)  # two subfigures, not one
    acc, strips = parts
    ax = acc.subplots()
    lanes = strips.subplots(len(runs), 1, sharex=True)
    for lane, (name, (run_dir, _)) in zip(lanes, runs.items()):
        ax.plot(*_smoothed_accuracy(run_dir), label=name)
        ps = read_csv(run_dir / "ps.csv")
        times, protos = ps["time_s"], ps["protocol"]
        start = 0.0
        for i in range(len(protos)):
            if i + 1 == len(protos) or protos[i + 1] != protos[i]:
                end = times[i]
                lane.axvspan(start, end, color=PROTOCOL_COLORS.get(protos[i], "grey"), alpha=0.6, lw=0)
                start = end
        lane.set_yticks([])
        lane.set_ylabel(name, rotation=0, ha="right", va="center")
    ax.axhline(target, ls="--", c="grey", lw=0.8)
    ax.set(xlabel="time (s)", ylabel=f"test accuracy (mean of last {SMOOTH_EVALS} evals)", ylim=(0.5, 1.0),
           title="Sync-Switch study: accuracy vs time; dashed: BSP's final accuracy - 0.5 points")
    ax.legend(ncol=3)
    lanes[-1].set_xlabel("time (s); protocol in force: " + ", ".join(f"{p}={c.split(':')[1]}"
                                                                      for p, c in PROTOCOL_COLORS.items()))
    fig.savefig(path, dpi=110)


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
        run_dir, summary = launch(parse_config(_merge({**study.base(), "name": name}, extra)), quiet=quiet)
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
