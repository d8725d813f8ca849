"""Every command-line entry point answers ``--help`` with its usage and exit 0: each sub-command of
``switchps``, found from the parser itself (so a new one cannot be missed), and every benchmark."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from switchps.cli import parser

SWITCHPS = str(Path(sys.executable).parent / "switchps")
BENCH = Path(__file__).resolve().parent.parent / "bench"


def subcommands() -> list[str]:
    actions = [a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sorted(name for a in actions for name in a.choices)


def test_every_subcommand_is_found() -> None:
    assert {"run", "ps", "worker", "evaluator", "status", "study", "certs"} <= set(subcommands())


@pytest.mark.parametrize("command", [[], *([c] for c in subcommands())], ids=lambda c: " ".join(c) or "switchps")
def test_help_prints_usage(command: list[str]) -> None:
    out = subprocess.run([SWITCHPS, *command, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: switchps {' '.join(command)}".rstrip())
    assert out.stderr == ""


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.py")))
def test_benchmark_help_prints_usage(script: str) -> None:
    out = subprocess.run([sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage:") and "Traceback" not in out.stderr
