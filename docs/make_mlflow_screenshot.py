"""docs/mlflow_run.png: MLflow's own UI showing a simulated study exported by `switchps export mlflow`.

Simulates a small study (2 arms x 3 repeats on digits, a few seconds each), exports it into a sqlite
tracking store in a temporary directory, serves that store with `mlflow server`, and has headless
Chromium (Debian's ``chromium`` package) photograph the experiment's page. Run from the repository root:

    python docs/make_mlflow_screenshot.py [--out docs/mlflow_run.png]

Needs switchps[mlflow] and ``chromium`` on the PATH; nothing in CI runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

STUDY = {"study": "mini", "mode": "simulate", "repeats": 3, "reference": "bsp", "target": {"absolute": 0.5},
         "metrics": ["time_to_target_s", "final_accuracy", "updates"],
         "base": {"cluster": {"workers": 4}, "model": {"name": "logreg"}, "data": {"name": "digits"},
                  "protocol": {"name": "bsp", "batch": 16}, "train": {"steps": 60}, "eval": {"every_s": 0.5},
                  "optimizer": {"name": "momentum", "learning_rate": 0.1},
                  "device": {"samples_per_s": 200.0}, "stragglers": {"mixture": {"preset": "niagara", "scale": 0.05}}},
         "arms": {"bsp": {}, "asp": {"protocol.name": "asp"}}}

CHILDREN = urllib.parse.urlencode({"compareRunsMode": "TABLE"})
"""The experiment's runs as a table (the study's parent run, its nested runs folded under it)."""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/mlflow_run.png")
    out = Path(p.parse_args().out).resolve()
    bin_dir = Path(sys.executable).parent
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        (where / "mini.yaml").write_text(json.dumps(STUDY))
        run = [str(bin_dir / "switchps"), "study", "mini.yaml", "--out", "mini", "--quiet"]
        subprocess.run(run, cwd=where, check=True, stdout=subprocess.DEVNULL)
        store = f"sqlite:///{where / 'mlflow.db'}"
        subprocess.run([str(bin_dir / "switchps"), "export", "mlflow", "mini", "--tracking-uri", store,
                        "--experiment", "mini-study"], cwd=where, check=True)
        port = free_port()
        server = subprocess.Popen([str(bin_dir / "mlflow"), "server", "--backend-store-uri", store, "--host",
                                   "127.0.0.1", "--port", str(port), "--workers", "1"], cwd=where,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, 180)
            experiment = json.loads(get(f"{url}/api/2.0/mlflow/experiments/get-by-name?experiment_name=mini-study")
                                    )["experiment"]["experiment_id"]
            chromium = shutil.which("chromium") or "chromium"
            subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={out}",
                            "--window-size=1400,900", "--virtual-time-budget=10000",
                            f"{url}/#/experiments/{experiment}/runs?{CHILDREN}"], check=True, timeout=300,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)
    print(out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            if get(f"{url}/health") == b"OK":
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the MLflow server at {url} was not healthy within {timeout_s} s")


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as r:
        return bytes(r.read())


if __name__ == "__main__":
    main()
