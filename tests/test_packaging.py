"""The checkout is a normal Python project: imports resolve by directory, the wheel holds real files."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import switchps

ROOT = Path(__file__).resolve().parent.parent
PS = ROOT / "switchps" / "ps_server"
SUBPACKAGES = ("ps_server", "worker", "protos", "policies", "examples")  # linked from the top level
PACKAGES = sorted(str(p.parent.relative_to(ROOT / "switchps")) for p in (ROOT / "switchps").rglob("__init__.py")
                  if p.parent != ROOT / "switchps")


def _own_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and not n.level]
    return [n for n in names if n == "switchps" or n.startswith("switchps.")]


def _resolves_on_disk(module: str) -> bool:
    base = ROOT.joinpath(*module.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def test_every_import_of_the_project_resolves_by_directory_from_the_checkout():
    sources = [p for d in ("switchps", "tests", "bench") for p in (ROOT / d).rglob("*.py")]
    imports = {m for p in sources for m in _own_imports(p)}
    assert len(imports) > 30
    assert sorted(m for m in imports if not _resolves_on_disk(m)) == []
    for sub in SUBPACKAGES:  # the code lives where its import path says; the design's top-level folders link to it
        assert not (ROOT / "switchps" / sub).is_symlink()
        link = ROOT / sub
        assert link.is_symlink() and link.resolve() == ROOT / "switchps" / sub


def test_the_installed_package_is_the_checkout():
    spec = importlib.util.find_spec("switchps.ps_server")
    assert spec is not None and spec.origin is not None
    assert Path(spec.origin).resolve().is_relative_to(ROOT), "editable install: tests run the edits"


def test_version_is_one_string_everywhere():
    exe = Path(sys.executable).parent / "switchps"
    out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"switchps {switchps.__version__}"
    assert importlib.metadata.version("switchps") == switchps.__version__


@pytest.mark.integration
def test_the_wheel_holds_real_files_for_every_subpackage(tmp_path):
    src = tmp_path / "src"  # a copy, so the build leaves nothing in the checkout
    shutil.copytree(ROOT, src, symlinks=True, ignore=lambda folder, names: [  # runs/ at the top holds run dirs
        n for n in names if n in (".git", "build") or n.endswith(".egg-info") or (folder, n) == (str(ROOT), "runs")])
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(src)],
                   check=True, capture_output=True, timeout=600)
    (wheel,) = tmp_path.glob("switchps-*.whl")
    with zipfile.ZipFile(wheel) as z:
        infos = {i.filename: i for i in z.infolist()}
        links = [n for n, i in infos.items() if stat.S_ISLNK(i.external_attr >> 16)]
        assert links == []
        for sub in PACKAGES:
            on_disk = sorted(p.name for p in (ROOT / "switchps" / sub).iterdir()
                             if p.suffix in (".py", ".pyi", ".yaml", ".proto") and p.is_file())
            prefix = f"switchps/{sub}/"
            in_wheel = sorted(n[len(prefix):] for n in infos if n.startswith(prefix) and "/" not in n[len(prefix):])
            assert in_wheel == on_disk, sub
            assert all(infos[f"switchps/{sub}/{name}"].file_size > 0 or name == "__init__.py" for name in on_disk)
        for folder in ("studies", "slurm", "k8s", "grafana"):  # the example configs ship with the package
            shipped = sorted(p.name for p in (ROOT / "switchps" / "examples" / folder).iterdir() if p.is_file())
            assert shipped and all(infos[f"switchps/examples/{folder}/{name}"].file_size > 0 for name in shipped), folder


def test_the_ps_never_imports_worker_code_and_stays_free_of_tensorflow():
    for path in PS.rglob("*.py"):
        assert not [m for m in _own_imports(path) if m.startswith("switchps.worker")], path.name
    probe = ("import sys, switchps.ps_server.rpc.main; from switchps.config.run import load_config; "
             "from switchps.checks import PREFLIGHT; load_config(None, ['security.insecure=true'], role='ps', "
             "checks=PREFLIGHT); print('tensorflow' in sys.modules or 'keras' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def test_the_protocol_core_has_no_io_and_no_threads():
    core = [f"core/{p.stem}" for p in (PS / "core").glob("*.py")]
    assert len(core) >= 9, core  # __init__, machine, its parts, protocols, events, rescale, overhead: the glob found them
    for name in core:
        imports = _own_imports(PS / f"{name}.py")
        tree = ast.parse((PS / f"{name}.py").read_text())
        third = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        third |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not third & {"grpc", "threading", "asyncio", "socket", "time", "concurrent"}, (name, third)
        assert not {"switchps.ps_server.rpc.service", "switchps.ps_server.store", "switchps.ps_server.snapshot",
                    "switchps.ps_server.sums"} & set(imports), (name, imports)
