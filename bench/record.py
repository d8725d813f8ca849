"""Run one benchmark command and keep its JSON with what produced it: ``bench/results/NAME.json`` holds the
command, the commit (and whether the tree had uncommitted changes), the host's cores and the start and end
times beside the benchmark's own output, so a figure in the docs can name all of them.

    python bench/record.py NAME -- python bench/steps.py --vs-tf 5 --seconds 10
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, cwd=RESULTS.parent).stdout.strip()


def record(name: str, command: list[str], results: Path = RESULTS) -> Path:
    """Run ``command`` (it prints one JSON document) and write it with its provenance; raise if it fails."""
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode != 0:
        sys.stderr.write(out.stderr[-4000:])
        raise SystemExit(f"record: {shlex.join(command)} exited {out.returncode}")
    doc = {"command": shlex.join(command), "commit": git("rev-parse", "--short", "HEAD"),
           "dirty": bool(git("status", "--porcelain", "--untracked-files=no")), "cpus": os.cpu_count(),
           "started": started, "ended": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "result": json.loads(out.stdout)}
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{name}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 usage="record.py [--dir DIR] NAME -- COMMAND [ARG ...]")
    ap.add_argument("name", help="the result's file name, without .json")
    ap.add_argument("--dir", type=Path, default=RESULTS, help="where to write it (default bench/results)")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args, command = ap.parse_args(argv[:split]), argv[split + 1 :]
    if not command:
        ap.error("give the benchmark's command after --")
    print(record(args.name, command, args.dir))


if __name__ == "__main__":
    main()
