"""The documentation holds to what runs: the site builds with mkdocs' warnings as errors (broken links and
anchors included), every relative link of the README reaches a file or a page, the README stays short,
the configuration reference lists every field of the config models, and every code block of the README
and the site that is a command or a config is parsed by the real parser (``text`` blocks are output or
illustrations, and are left out explicitly)."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

import pytest
import yaml
from pydantic import BaseModel, Field

from switchps.checks import PREFLIGHT
from switchps.cli import parser
from switchps.config.run import RunConfig, load_config, parse_config
from switchps.studies.spec import load_study
from switchps.yamlfile import read_yaml

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
DOCS = [README, *PAGES]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```$", re.MULTILINE | re.DOTALL)
LANGUAGES = {"yaml", "bash", "python", "text"}
"""Every block says what it is; ``text`` is output or an illustration, and is not run."""
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _hook() -> Any:
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "docs" / "hooks" / "config_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def blocks(language: str) -> list[tuple[str, str]]:
    """``(where, body)`` of every fenced block in ``language`` in the README and the site's pages."""
    return [(f"{doc.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}", m[2])
            for doc in DOCS for text in [doc.read_text()] for m in FENCE.finditer(text) if m[1] == language]


def _where(found: list[tuple[str, str]]) -> list[str]:
    return [where for where, _ in found]


def test_the_site_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    """mkdocs.yml is strict and validates links and anchors, so a broken one fails the build."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about its successor is not the site's warning
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    assert not re.search(r"(?m)^WARNING\b", out.stderr), out.stderr
    reference = (tmp_path / "site" / "configuration" / "index.html").read_text()
    assert "time_budget_s" in reference and "<!-- reference" not in reference, "the hook wrote the reference"


def test_every_page_is_in_the_sites_navigation() -> None:
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    listed = set(re.findall(r"[\w-]+\.md", str(nav)))
    assert listed == {p.name for p in PAGES}


def test_the_readmes_relative_links_reach_a_file_or_a_page() -> None:
    links = [t for t in LINK.findall(README.read_text()) if not t.startswith(("http://", "https://", "#"))]
    assert any(t.startswith("docs/") for t in links), "the README links to the site's pages"
    missing = [t for t in links if not (ROOT / t.split("#")[0]).exists()]
    assert not missing, missing


def test_the_readme_stays_short() -> None:
    assert len(README.read_text().splitlines()) <= 400


def test_every_code_block_says_what_it_is() -> None:
    untyped = [(doc.name, m[1] or "(none)") for doc in DOCS for m in FENCE.finditer(doc.read_text())
               if m[1] not in LANGUAGES]
    assert not untyped, untyped


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    return {**base, **{k: _merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
                       for k, v in over.items()}}


QUICKSTART = read_yaml(ROOT / "switchps" / "examples" / "quickstart.yaml")


@pytest.mark.parametrize("where, body", blocks("yaml"), ids=_where(blocks("yaml")))
def test_every_yaml_block_is_a_valid_config(where: str, body: str, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A study file loads as a study; any other block is a run config, or a part of one merged over the
    quickstart, checked with the preflight a command adds (the optimizer's parameters, the model's and
    the policy's keyword arguments); a block that starts ``# one of these lines`` is alternatives, each
    line checked alone.
    A secret file the block names is made (the config checks that it is readable)."""
    monkeypatch.chdir(tmp_path)
    snippets = body.splitlines()[1:] if body.startswith("# one of these lines") else [body]
    for snippet in snippets:
        path = tmp_path / "block.yaml"
        path.write_text(snippet)
        raw = read_yaml(path)  # duplicate keys are errors, as for a real config
        if secret := raw.get("security", {}).get("secret_file"):
            (tmp_path / secret).write_text("0" * 64)
            (tmp_path / secret).chmod(0o600)
        if "study" in raw:
            load_study(path)
        else:
            parse_config(_merge(QUICKSTART, raw), checks=PREFLIGHT)  # optimizer, model, policy build


def commands(body: str) -> list[str]:
    """The ``switchps`` commands of a shell block: continuation lines joined, comments cut, split at
    ``&&``, ``;``, ``&`` and ``|``, ``srun`` and environment assignments in front dropped."""
    joined = re.sub(r"\\\n\s*", " ", body)
    found = []
    for line in joined.splitlines():
        for part in re.split(r"&&|;|&|\|", re.sub(r"(^|\s)#.*", "", line)):
            words = shlex.split(part)
            while words and (words[0] == "srun" or re.fullmatch(r"[A-Z_]+=\S*", words[0])):
                words = words[1:]
            if words[:1] == ["switchps"]:
                found.append(shlex.join(words[1:]))
    return found


SHELL = [(where, c) for where, body in blocks("bash") for c in commands(body)]


def test_the_shell_blocks_are_found() -> None:
    assert len(SHELL) > 30 and {c.split()[0] for _, c in SHELL} >= {"run", "ps", "worker", "study", "simulate"}


@pytest.mark.parametrize("where, command", SHELL, ids=[f"{w} {c}" for w, c in SHELL])
def test_every_switchps_command_parses(where: str, command: str) -> None:
    """The real argument parser accepts it: the sub-command exists, each option is one of its own and gets
    the values it needs (argparse exits 2 otherwise)."""
    parser().parse_args(shlex.split(command))


@pytest.mark.parametrize("where, body", blocks("bash"), ids=_where(blocks("bash")))
def test_every_benchmark_a_shell_block_runs_exists(where: str, body: str) -> None:
    for script in re.findall(r"python (bench/\w+\.py)", body):
        assert (ROOT / script).is_file(), script


@pytest.mark.parametrize("where, body", blocks("python"), ids=_where(blocks("python")))
def test_every_python_block_compiles(where: str, body: str) -> None:
    """Compiled, not run: one loads a run's model, one is a policy that tests/test_config_errors.py runs."""
    compile(body, where, "exec")


def test_the_reference_lists_every_field_of_every_section() -> None:
    text = _hook().reference(RunConfig)

    def walk(model: type[BaseModel], path: str) -> None:
        assert f"`{path or 'top level'}`" in text, path
        for name, field in model.model_fields.items():
            assert f"| `{name}` |" in text, f"{path}.{name}"
            for sub in _hook().models_in(field.annotation):
                walk(sub, f"{path}.{name}" if path else name)

    walk(RunConfig, "")
    assert "| `time_budget_s` | float | required | > 0 |" in text, "type, default and bound (amb's own field)"
    assert "| `max_batch` | int \\| None | `None` | > 0, ≤ 1048576 |" in text, "an optional field's"
    assert "T, the compute time per step" in text, "the docstring under the field"


class _Sync(BaseModel):
    name: Literal["sync"] = "sync"
    deadline_s: float = Field(30.0, gt=0)
    """Drop a silent worker after this long."""


class _Async(BaseModel):
    name: Literal["async"]
    staleness: int = 3
    """How far ahead a worker may run."""


class _Run(BaseModel):
    protocol: Annotated[_Sync | _Async, Field(discriminator="name")] = Field(default_factory=_Sync)
    """The protocol, by name."""


def test_a_union_discriminated_by_a_field_lists_each_members_fields() -> None:
    text = _hook().reference(_Run)
    assert '`protocol`, `name: "sync"`' in text and '`protocol`, `name: "async"`' in text
    assert "Drop a silent worker after this long." in text and "How far ahead a worker may run." in text
    assert "| `deadline_s` | float | `30.0` | > 0 |" in text and "| `name` | \"async\" | required |" in text


def test_the_readme_tour_runs_as_a_config(tmp_path: Path) -> None:
    """The tour's file, as a user saves it, loads on its own (not merged over the quickstart)."""
    body = next(b for _, b in blocks("yaml") if b.startswith("# tour.yaml"))
    (tmp_path / "tour.yaml").write_text(body)
    cfg = load_config(tmp_path / "tour.yaml", checks=PREFLIGHT)
    assert cfg.policy.name == "schedule" and cfg.cluster.num_workers == 4


def test_every_module_path_the_docs_name_exists() -> None:
    """A path such as `ps_server/rpc/service.py` names a file of the repository (from its root, from
    switchps/, or, in the architecture's tables, from switchps/ps_server/), so a moved module cannot
    leave a stale name behind."""
    bases = [ROOT, ROOT / "switchps", ROOT / "switchps" / "ps_server"]
    named = {m for doc in DOCS for m in re.findall(r"`((?:[a-z_]+/)+[a-z_0-9]+\.(?:py|proto|sh|yaml|sbatch))`",
                                                   doc.read_text())}
    assert len(named) > 20
    missing = sorted(p for p in named if not any((base / p).is_file() for base in bases))
    assert not missing, missing
