"""Where the SLURM that `scripts/slurm-localhost.sh up` starts is configured, and whether the SLURM tests
can run. CI starts that cluster (`.ci/run`) and fails if it cannot, so under ``CI`` a SLURM test whose
cluster is missing fails instead of skipping: a broken SLURM path must not land green."""

from __future__ import annotations

import os
import shutil
import subprocess
from functools import cache
from pathlib import Path

import pytest

LOCAL_CONF = Path(os.environ.get("SWITCHPS_SLURM_DIR", "/tmp/switchps-slurm")) / "etc" / "slurm.conf"


def slurm_env() -> dict[str, str] | None:
    """This environment with SLURM_CONF set (the caller's, else the local cluster's); None if SLURM's
    commands or any config are missing."""
    if shutil.which("sinfo") is None or shutil.which("scontrol") is None:
        return None
    env = dict(os.environ)
    if "SLURM_CONF" not in env:
        if not LOCAL_CONF.is_file() and not Path("/etc/slurm/slurm.conf").is_file():
            return None
        if LOCAL_CONF.is_file():
            env["SLURM_CONF"] = str(LOCAL_CONF)
    return env


@cache
def cluster_up() -> str | None:
    """None if a SLURM cluster answers with a usable node; else why a job test cannot run (asked once:
    sinfo takes seconds to give up on an absent controller)."""
    env = slurm_env()
    if env is None:
        return "SLURM is not installed or not configured (run `bash scripts/slurm-localhost.sh up` as root)"
    out = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=30, env=env)
    states = out.stdout.split()
    if out.returncode != 0 or not any(s in ("idle", "mix") for s in states):
        return (f"no idle SLURM node (sinfo: {out.stdout.strip() or out.stderr.strip()!r}); "
                "run `bash scripts/slurm-localhost.sh up` as root")
    return None


def require(missing: str | None) -> None:
    """Go on if ``missing`` is None; else skip saying why, or fail under ``CI``, which starts SLURM itself."""
    if missing is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI starts a local SLURM (.ci/run), but: {missing}", pytrace=False)
    pytest.skip(missing)


@pytest.fixture
def slurm_cluster() -> dict[str, str]:
    """The environment of a running SLURM cluster with an idle node (see ``require``)."""
    require(cluster_up())
    env = slurm_env()
    assert env is not None
    return env


@pytest.fixture
def slurm_config() -> dict[str, str]:
    """The environment of an installed and configured SLURM (``scontrol`` works; no daemon needed)."""
    env = slurm_env()
    require(None if env is not None else "scontrol or a slurm.conf absent (SLURM not installed or set up)")
    assert env is not None
    return env
