"""Every command-line entry point answers ``--help`` with its usage and exit 0, and lists the options the
README and the documentation site (docs/*.md) show it with: each sub-command of ``switchps``, found from the parser itself (so a new one cannot be
missed), and every benchmark."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from switchps.cli import parser

SWITCHPS = str(Path(sys.executable).parent / "switchps")
ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z-]*")
COMMANDS = {  # where the docs run each kind of entry point, in a code block or an inline span
    "switchps": re.compile(r"(?:^|[;&|(`]\s*|\$ |srun )switchps ([a-z][a-z-]*)()([^#;&)`]*)"),
    "bench": re.compile(r"python bench/(\w+\.py)((?: [a-z][a-z_-]*)?)([^#;&|)`>]*)"),
}


def subcommands() -> list[str]:
    actions = [a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sorted(name for a in actions for name in a.choices)


def readme_options(kind: str) -> dict[tuple[str, ...], set[str]]:
    """The options the README and the site show with each command (its sub-command, for a benchmark that
    has them)."""
    shown: dict[tuple[str, ...], set[str]] = defaultdict(set)
    for line in (line for doc in DOCS for line in doc.read_text().splitlines()):
        for name, sub, rest in COMMANDS[kind].findall(line):
            shown[(name, *sub.split())] |= set(OPTION.findall(rest))
    return shown


SWITCHPS_OPTIONS, BENCH_OPTIONS = readme_options("switchps"), readme_options("bench")


def _help(args: list[str]) -> str:
    out = subprocess.run([*args, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    return out.stdout


def _forms(command: list[str]) -> list[str]:
    """The forms of sub-command ``command`` (``export``: ``model``, ``mlflow``), if it has any."""
    if not command:
        return []
    [sub] = [a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sorted(name for a in sub.choices[command[0]]._actions if isinstance(a, argparse._SubParsersAction)
                  for name in a.choices)


def _lists(help_text: str, option: str) -> bool:
    """Whether ``help_text`` describes ``option`` in its list of options (not merely in the usage line)."""
    return re.search(rf"(?m)^ +(?:-\w, )?{re.escape(option)}\b", help_text) is not None


def test_every_subcommand_is_found() -> None:
    assert {"run", "ps", "worker", "evaluator", "status", "study", "certs"} <= set(subcommands())


def test_the_readme_shows_options_for_the_entry_points() -> None:
    """The docs' commands are found (else the checks of their options below would pass vacuously); they
    show `plot` and `status` bare. Every sub-command shown with options, and every benchmark, exists."""
    with_options = {name for (name, *_), options in SWITCHPS_OPTIONS.items() if options}
    assert with_options >= set(subcommands()) - {"plot", "status"}
    assert {"transport.py", "steps.py", "hostile_memory.py", "ceiling.py", "sim_validation.py"} <= \
        {name for (name, *_), options in BENCH_OPTIONS.items() if options}
    assert BENCH_OPTIONS[("sim_vs_real.py", "compare")] == {"--overhead", "--jitter"}
    assert with_options <= set(subcommands()), "prose may say `switchps decides`; a command with options is one"
    assert all((BENCH / name).is_file() for name, *_ in BENCH_OPTIONS)


@pytest.mark.parametrize("command", [[], *([c] for c in subcommands())], ids=lambda c: " ".join(c) or "switchps")
def test_help_prints_usage_and_the_options_the_readme_shows(command: list[str]) -> None:
    text = _help([SWITCHPS, *command])
    assert text.startswith(f"usage: switchps {' '.join(command)}".rstrip())
    for form in _forms(command):  # a command with forms (`export model|mlflow`): their options count too
        text += _help([SWITCHPS, *command, form])
    documented = SWITCHPS_OPTIONS[tuple(command)] if command else {"--version"}  # README: `switchps --version`
    assert all(_lists(text, option) for option in documented), (documented, text)


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.py")))
def test_benchmark_help_prints_usage_and_the_options_the_readme_shows(script: str) -> None:
    assert _help([sys.executable, str(BENCH / script)]).startswith("usage:")
    for (name, *sub), documented in BENCH_OPTIONS.items():
        if name == script and documented:
            text = _help([sys.executable, str(BENCH / script), *sub])
            assert all(_lists(text, option) for option in documented), (sub, documented, text)
