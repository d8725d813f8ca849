"""The protocol core's cost per push, measured through the simulator on a virtual clock (``--time-only``:
no model, no gradients, no sockets), so what is timed is the core taking each push and the driver executing
its actions, plus the simulator's own loop and the run record.

For each protocol, one ``switchps simulate`` of ``--workers`` workers for ``--updates`` updates, ``--repeat``
times; prints JSON: each protocol's median wall microseconds per push (accepted or dropped) of the
simulation (``summary.json``'s ``sim_wall_s``). It runs the ``switchps`` that ``python -m`` finds: the
current directory's, then ``PYTHONPATH``'s; so the same command run from two checkouts' roots,
alternating, is a before/after of a change to the core.

    python bench/core_push.py [--workers 256] [--updates 20000] [--repeat 3] [--protocols bsp asp ssp]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIG = """name: core-push
cluster: {{workers: {workers}}}
model: {{name: mlp, kwargs: {{hidden: [64]}}}}
data: {{name: digits}}
protocol: {{name: {protocol}, batch: 32}}
device: {{samples_per_s: 1000}}
train: {{steps: {updates}}}
"""


def us_per_push(protocol: str, workers: int, updates: int, tmp: Path) -> float:
    """Wall microseconds per push of one time-only simulation."""
    config = tmp / f"{protocol}.yaml"
    config.write_text(CONFIG.format(workers=workers, protocol=protocol, updates=updates))
    run_dir = tmp / f"run-{protocol}"
    subprocess.run([sys.executable, "-m", "switchps.cli", "simulate", str(config), "--time-only", "--quiet",
                    "--run-dir", str(run_dir)], check=True, capture_output=True, timeout=600)
    summary = json.loads((run_dir / "summary.json").read_text())
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    return 1e6 * summary["sim_wall_s"] / (summary["pushes_accepted"] + summary["pushes_dropped"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=256)
    ap.add_argument("--updates", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--protocols", nargs="+", default=["bsp", "asp", "ssp"])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {p: [us_per_push(p, args.workers, args.updates, Path(tmp)) for _ in range(args.repeat)]
                for p in args.protocols}
    print(json.dumps({"workers": args.workers, "updates": args.updates,
                      "us_per_push": {p: round(statistics.median(v), 1) for p, v in runs.items()},
                      "runs": {p: [round(x, 1) for x in v] for p, v in runs.items()}}))


if __name__ == "__main__":
    main()
