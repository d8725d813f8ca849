"""The README's own-PyTorch-loop example, run as written against a real `switchps ps` on loopback.

Two worker processes run the README's ``train.py`` block (with a footer that reports the final loss on
the whole of digits and the steps each pushed) against the README's ``run.yaml`` block, under BSP and
under AMB; the run must train and its record must count every push once.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import wait_until
from test_launch import SWITCHPS, rows

ROOT = Path(__file__).resolve().parents[1]
FOOTER = '''
import json
with torch.no_grad():
    everything = F.cross_entropy(model(data.tensors[0]), data.tensors[1]).item()
print(json.dumps({"loss": everything, "steps": ps.steps}))
'''
UNTRAINED_LOSS = 2.3  # ln 10: a model that has learnt nothing about 10 classes


def readme_blocks() -> tuple[str, str]:
    """The python and yaml blocks of the README's section "Your own PyTorch loop"."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Your own PyTorch loop") :]
    section = section[: section.index("\n## ", 1)]
    python = re.search(r"```python\n(.*?)```", section, re.S)
    config = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert python and config, "the section has a python and a yaml block"
    return python.group(1), config.group(1)


def test_the_example_adds_five_lines() -> None:
    code, _ = readme_blocks()
    assert sum(line.rstrip().endswith("# +") or "# + " in line for line in code.splitlines()) == 5


def run_example(tmp_path: Path, processes, protocol: dict) -> tuple[dict, int, list[dict], list[dict]]:
    """The README's run with ``protocol``: (summary, ps.csv's rows, workers.csv's rows, each worker's footer)."""
    code, config = readme_blocks()
    (tmp_path / "train.py").write_text(code + FOOTER)
    raw = yaml.safe_load(config)
    raw["protocol"] = protocol
    raw["cluster"]["ps"] = "127.0.0.1:0"  # the PS picks a free port and publishes it
    raw["train"] = {"steps": 60}
    (tmp_path / "ps.yaml").write_text(yaml.safe_dump(raw))
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SWITCHPS_SECRET": secrets.token_hex()}
    ps = processes([SWITCHPS, "ps", "ps.yaml", "--run-dir", str(run_dir)], cwd=tmp_path, env=env,
                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until(lambda: (run_dir / "ps.address").exists() or ps.poll() is not None, 60, "the PS's address")
    assert ps.poll() is None, ps.communicate()[1]
    raw["cluster"]["ps"] = (run_dir / "ps.address").read_text().strip()
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(raw))
    workers = [processes([sys.executable, "train.py", str(i)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [w.communicate(timeout=120) for w in workers]
    for w, (_, err) in zip(workers, outs):
        assert w.returncode == 0, err
    _, err = ps.communicate(timeout=60)
    assert ps.returncode == 0, err
    summary = json.loads((run_dir / "summary.json").read_text())
    reports = [json.loads(out.splitlines()[-1]) for out, _ in outs]
    return summary, len(rows(run_dir / "ps.csv")), rows(run_dir / "workers.csv"), reports


def check_trained(summary: dict, updates: int, steps: list[dict], reports: list[dict]) -> None:
    assert summary["updates"] == updates == 60, "the PS's count, and one ps.csv row per update"
    assert summary["pushes_rejected"] == 0 and summary["workers_not_told_stop"] == []
    assert len(steps) == sum(r["steps"] for r in reports) == summary["pushes_accepted"], "every push counted once"
    assert reports[0]["loss"] == reports[1]["loss"] < UNTRAINED_LOSS / 2, "both hold the same, trained values"


def test_the_readme_loop_trains_under_bsp(tmp_path: Path, processes) -> None:
    summary, updates, steps, reports = run_example(tmp_path, processes, {"name": "bsp", "batch": 64})
    check_trained(summary, updates, steps, reports)
    assert {int(s["samples"]) for s in steps} == {64}, "each step takes the sample budget, whatever the loader's"
    assert [r["steps"] for r in reports] == [60, 60], "under BSP each worker pushes once per update"


def test_the_readme_loop_ends_its_steps_by_time_under_amb(tmp_path: Path, processes) -> None:
    amb = {"name": "amb", "batch": 64, "micro_batch": 8, "time_budget_s": 0.02, "max_batch": 100_000}
    summary, updates, steps, reports = run_example(tmp_path, processes, amb)
    check_trained(summary, updates, steps, reports)
    samples = [int(s["samples"]) for s in steps]
    assert max(samples) < 100_000 and summary["batch_exhausted_steps"] == 0, "T ended every step, not max_batch"
    assert len(set(samples)) > 1, f"b varies with the time the micro-batches took: {samples}"
