"""Chaos: kill -9 the PS and workers of real runs at seeded random moments and check what survives.

For each of BSP, ASP and a BSP -> ASP schedule (digits, 3 workers): one uninterrupted run, then the same
run (same seed) under `switchps run` while the PS is killed at ``--ps-kills`` moments and a random
worker at ``--worker-kills`` moments, each restarted by the launcher (the PS from its checkpoint).
Reports per run whether it completed, its final accuracy against the uninterrupted run's, the updates
lost per PS kill (against the checkpoint interval), pushes applied twice (from ps.csv's ``pushes``),
checkpoints that could not be read, and the time from each PS kill to the first update after it.
Prints JSON.

    python bench/chaos.py [--seed 0] [--ps-kills 20] [--worker-kills 10] [--every-updates 50]
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from switchps.address import free_port
from switchps.jsonfile import dumps
from switchps.ps_server import checkpoint
from switchps.worker.client import PSClient

SWITCHPS = str(Path(sys.executable).parent / "switchps")
RUNS = {
    "bsp": ["protocol.name=bsp", "optimizer.name=momentum"],
    "asp": ["protocol.name=asp", "protocol.staleness_lr=true"],
    "bsp->asp": ["protocol.name=bsp", "optimizer.name=momentum",
                 "policy={name: schedule, kwargs: {phases: [{bsp: 0.3}, {asp: 0.7}]}}"],
}


@dataclass
class Kills:
    """What the chaos did to one run, as seen from outside."""

    ps_at: list[float] = field(default_factory=list)        # kill times
    version_before: list[int] = field(default_factory=list)  # the last version seen before each PS kill
    back_after_s: list[float] = field(default_factory=list)  # kill -> first update after the restart
    workers: list[int] = field(default_factory=list)


def base_args(name: str, out: Path, port: int, every_updates: int) -> list[str]:
    sets = ["name=" + name.replace("->", "-"), "cluster.workers=3", "model={name: mlp, kwargs: {hidden: [64]}}",
            "data.name=digits", "optimizer.learning_rate=0.05", "protocol.batch=16", "train.epochs=25",
            "eval.every_s=1.0", f"output.dir={out}", f"cluster.ps=127.0.0.1:{port}", "cluster.max_restarts=40",
            f"checkpoint.every_updates={every_updates}", "checkpoint.every_s=null", *RUNS[name]]
    return [a for s in sets for a in ("--set", s)]


def run(name: str, out: Path, every_updates: int, chaos: random.Random | None, ps_kills: int,
        worker_kills: int) -> tuple[Path | None, int, Kills]:
    port = free_port()
    out.mkdir(parents=True)
    launcher = subprocess.Popen([SWITCHPS, "run", "--quiet", *base_args(name, out, port, every_updates)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    kills = Kills()
    if chaos is not None:
        inflict(launcher, f"127.0.0.1:{port}", chaos, ps_kills, worker_kills, kills)
    _, err = launcher.communicate(timeout=1800)
    dirs = [d for d in out.iterdir() if (d / "summary.json").exists()]
    if launcher.returncode != 0:
        print(f"{name}: exit {launcher.returncode}: {err[-1500:]}", file=sys.stderr)
    return (dirs[0] if dirs else None), launcher.returncode, kills


def inflict(launcher: subprocess.Popen, address: str, rng: random.Random, ps_kills: int, worker_kills: int,
            kills: Kills) -> None:
    """Kill the PS when the run passes each of ``ps_kills`` random fractions of its updates, and a random
    worker at ``worker_kills`` others; after a PS kill, wait for the first update of its successor."""
    moments = sorted([(rng.uniform(0.03, 0.9), "ps") for _ in range(ps_kills)] +
                     [(rng.uniform(0.03, 0.9), "worker") for _ in range(worker_kills)])
    client = PSClient(address, timeout_s=1.0)
    seen = 0
    try:
        for fraction, what in moments:
            while launcher.poll() is None:
                status = _status(client)
                if status is not None:
                    seen = status.version
                    if status.progress >= fraction:
                        break
                time.sleep(0.02)
            if launcher.poll() is not None:
                return
            if what == "worker":
                kills.workers.append(_kill(launcher, "worker", rng))
                continue
            kills.ps_at.append(time.monotonic())
            kills.version_before.append(seen)
            _kill(launcher, "ps", rng)
            kills.back_after_s.append(_first_update_after(launcher, client, kills.ps_at[-1]))
    finally:
        client.close()


def _status(client: PSClient):  # noqa: ANN202 - pb.Status or None
    try:
        return client.status()
    except Exception:  # the PS is down or restarting
        return None


def _kill(launcher: subprocess.Popen, role: str, rng: random.Random) -> int:
    """SIGKILL one child of the launcher in ``role``; returns its worker index (-1 for the PS)."""
    while launcher.poll() is None:
        found = [(p, c) for p, c in _children(launcher) if len(c) > 3 and c[3] == role]
        if found:
            proc, cmd = rng.choice(found)
            proc.kill()
            return int(cmd[cmd.index("--index") + 1]) if role == "worker" else -1
        time.sleep(0.05)
    return -2


def _children(launcher: subprocess.Popen) -> list[tuple[psutil.Process, list[str]]]:
    """The launcher's live children with their command lines (not the killed ones not yet reaped)."""
    out = []
    for p in psutil.Process(launcher.pid).children():
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append((p, p.cmdline()))
        except psutil.Error:
            pass
    return out


def _first_update_after(launcher: subprocess.Popen, client: PSClient, killed_at: float) -> float:
    """Seconds from the kill until the restarted PS has applied an update of its own."""
    first: int | None = None
    while launcher.poll() is None:
        status = _status(client)
        if status is not None:
            if first is None:
                first = status.version  # the restarted PS: its checkpoint's version
            elif status.version > first or status.done:
                return time.monotonic() - killed_at
        time.sleep(0.02)
    return float("nan")


def audit(run_dir: Path, kills: Kills) -> dict:
    """What the run record says about the kills."""
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line]
    resumed = [e for e in events if e["event"] == "resumed"]
    lost = [max(before, e["version"] + e["lost_updates"]) - e["version"]
            for before, e in zip(kills.version_before, resumed)]
    with (run_dir / "ps.csv").open() as f:
        rows = list(csv.DictReader(f))
    pushes = [p for r in rows for p in r["pushes"].split(";")]
    versions = [int(r["version"]) for r in rows]
    unreadable = (run_dir / "logs" / "ps.log").read_text().count("skipping checkpoint")
    for path in checkpoint.files(run_dir / "checkpoints"):
        try:
            checkpoint.read(path)
        except checkpoint.CheckpointError:
            unreadable += 1
    back = [s for s in kills.back_after_s if s == s]
    return {"ps_kills": len(kills.ps_at), "resumes": len(resumed), "worker_kills": len(kills.workers),
            "updates_lost_per_kill": lost, "max_updates_lost": max(lost, default=0),
            "pushes_applied_twice": len(pushes) - len(set(pushes)),
            "versions_in_order_once": versions == list(range(1, len(versions) + 1)),
            "checkpoints_unreadable": unreadable,
            "kill_to_first_update_s": {"median": round(statistics.median(back), 2) if back else None,
                                       "max": round(max(back), 2) if back else None}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ps-kills", type=int, default=20)
    ap.add_argument("--worker-kills", type=int, default=10)
    ap.add_argument("--every-updates", type=int, default=50)
    ap.add_argument("--runs", default=",".join(RUNS), help="comma-separated: " + ", ".join(RUNS))
    args = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="switchps-chaos-"))
    report = []
    for i, name in enumerate(args.runs.split(",")):
        t0 = time.monotonic()
        base_dir, _, _ = run(name, out / f"{i}-plain", args.every_updates, None, 0, 0)
        plain_s = time.monotonic() - t0
        rng = random.Random(args.seed * 1000 + i)
        run_dir, code, kills = run(name, out / f"{i}-chaos", args.every_updates, rng, args.ps_kills,
                                   args.worker_kills)
        base = json.loads((base_dir / "summary.json").read_text()) if base_dir else {}
        summary = json.loads((run_dir / "summary.json").read_text()) if run_dir else {}
        final, reference = summary.get("final_test_accuracy"), base.get("final_test_accuracy")
        report.append({
            "run": name, "completed": code == 0 and run_dir is not None, "final_accuracy": final,
            "uninterrupted_accuracy": reference,
            "gap_points": round(100 * (reference - final), 2) if final is not None and reference else None,
            "checkpoint_every_updates": args.every_updates, "updates": summary.get("updates"),
            "uninterrupted_s": round(plain_s, 1), **(audit(run_dir, kills) if run_dir else {}),
            "run_dir": str(run_dir)})
        print(dumps(report[-1]), file=sys.stderr)
    print(dumps({"benchmark": "chaos", "seed": args.seed, "runs": report}, indent=2))


if __name__ == "__main__":
    main()
