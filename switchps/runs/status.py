"""`switchps status RUN_DIR|HOST:PORT`: where a run stands, live while it trains.

From the PS (its Status RPC, with the status role's token): version, protocol, progress, active
workers, the latest test accuracy. A run directory names the PS (the address it published in
``ps.address``, else its config's ``cluster.ps``) and its config the secret; for a bare address,
``config`` does.
From the run directory, when given one: workers excluded by a policy, each worker's recent step
times, the last evaluation, and the summary once the run has finished.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import grpc
from rich.table import Table

from switchps.address import published
from switchps.security.channels import ClientSecurity, client_security
from switchps.checks import PREFLIGHT
from switchps.config.run import load_config
from switchps.errors import RunDirError

RECENT_STEPS = 10


def status_table(target: str, config: str | None = None) -> Table:
    """The status of the run in directory ``target``, or of the PS at address ``target`` (whose secret
    and TLS files ``config`` names)."""
    run_dir = Path(target) if Path(target).is_dir() else None
    if run_dir is not None and not (run_dir / "config.yaml").is_file():
        raise RunDirError(f"{target} is not a run directory (no config.yaml)")
    path = run_dir / "config.yaml" if run_dir else config
    cfg = load_config(path, checks=PREFLIGHT) if path else None
    address = (published(run_dir) or cfg.cluster.shards[0]) if run_dir and cfg else target
    security = client_security(cfg, "status") if cfg else ClientSecurity()
    t = Table(title=f"switchps status: {target}", show_header=False)
    t.add_column("field")
    t.add_column("value")
    for key, value in _from_ps(address, security):
        t.add_row(key, value)
    if run_dir is not None:
        for key, value in _from_run_dir(run_dir):
            t.add_row(key, value)
    return t


def _from_ps(address: str, security: ClientSecurity) -> list[tuple[str, str]]:
    from switchps.worker.client import PSClient

    client = PSClient(address, timeout_s=2.0, security=security)
    try:
        s = client.status()
    except grpc.RpcError as e:  # the run has ended or not started, the address is wrong, or access refused
        what = "not reachable" if e.code() == grpc.StatusCode.UNAVAILABLE else "refused"
        return [("PS", f"{address}: {what} ({e.code().name}: {e.details()})")]
    finally:
        client.close()
    return [("PS", address), ("version", str(s.version)), ("protocol", s.protocol),
            ("progress", f"{s.progress:.1%}" + (" (done)" if s.done else "")),
            ("active workers", f"{s.active_workers} of {s.members}" + (" (paused: below min)" if s.paused else "")),
            ("latest test accuracy", f"{s.test_accuracy:.4f}" if s.test_accuracy >= 0 else "—")]


def _from_run_dir(run_dir: Path) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = [("excluded workers", ", ".join(map(str, sorted(_excluded(run_dir)))) or "none")]
    steps = _rows(run_dir / "workers.csv")
    for w in sorted({int(r["worker"]) for r in steps}):
        mine = [float(r["compute_s"]) + float(r["sleep_s"]) for r in steps if int(r["worker"]) == w][-RECENT_STEPS:]
        rows.append((f"worker {w} step (s), last {len(mine)}", f"median {np.median(mine):.3f}, max {max(mine):.3f}"))
    evals = _rows(run_dir / "eval.csv")
    if evals:
        e = evals[-1]
        rows.append(("last evaluation", f"v{e['version']} at {float(e['time_s']):.1f} s: accuracy {e['test_accuracy']}"))
    for path in sorted(run_dir.glob("shard-*.json"), key=lambda p: int(p.stem.partition("-")[2])):
        rows.append(_shard(json.loads(path.read_text())))
    if (run_dir / "summary.json").exists():
        summary = json.loads((run_dir / "summary.json").read_text())
        rows.append(("finished", f"{summary['updates']} updates, final accuracy {summary['final_test_accuracy']}"))
    return rows


def _shard(r: dict) -> tuple[str, str]:
    """A follower shard's line, from its record (``shard-K.json``)."""
    apply = "—" if r["mean_apply_ms"] is None else f"{r['mean_apply_ms']:.2f} ms"
    return (f"PS shard {r['shard']}", f"v{r['final_version']}, {r['updates']} updates, {r['bytes_in'] / 1e6:.1f} MB in, "
                                      f"{r['bytes_out'] / 1e6:.1f} MB out, apply {apply}, {r['parts_waiting']} parts "
                                      f"waiting, refused {sum(r['rejections'].values())}")


def _excluded(run_dir: Path) -> set[int]:
    out: set[int] = set()
    path = run_dir / "events.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        e = json.loads(line)
        if e["event"] == "worker_excluded":
            out.add(e["worker"])
        elif e["event"] == "worker_readmitted":
            out.discard(e["worker"])
    return out


def _rows(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))
