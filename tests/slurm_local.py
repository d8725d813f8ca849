"""Where the SLURM that `scripts/slurm-localhost.sh up` starts is configured, for the SLURM tests."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

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
