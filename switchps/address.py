"""Where the PS serves: ``RUN_DIR/ps.address``, published by the PS once its port is bound.

The PS binds first and publishes after. A configured port 0 lets the OS pick a free port with no race
between choosing it and binding it (a port chosen beforehand can be taken by another process in
between), and whatever started the PS (`switchps run`'s backend: a local process today, an engine such
as Ray or SLURM later) learns the address from the file instead of deciding it. The file is one line
``host:port`` and is replaced atomically (a temporary file renamed over it), so a reader sees the
previous address or the new one, never a partial line.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

ADDRESS_FILE = "ps.address"
"""Shard 0's (an unsharded PS's); shard k >= 1 publishes ``ps-<k>.address``."""
Stamp = tuple[int, int]
"""One publication of the file: (inode, mtime in ns)."""


def split(address: str) -> tuple[str, int]:
    """``host:port`` as (host, port); ValueError if it is not one."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected host:port, got {address!r}")
    return host, int(port)


def reachable(ps: str, bound_port: int) -> str:
    """The address clients reach the PS at: ``ps`` (``cluster.ps``) itself, or, if it says port 0, its
    host at the port the PS bound."""
    host, port = split(ps)
    return ps if port else f"{host}:{bound_port}"


def address_file(shard: int = 0) -> str:
    return ADDRESS_FILE if shard == 0 else f"ps-{shard}.address"


def publish(run_dir: Path, address: str, shard: int = 0) -> Path:
    """Write ``address`` to ``RUN_DIR/ps.address`` (shard ``shard``'s file) atomically; returns the file."""
    path = run_dir / address_file(shard)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{address}\n")
    os.replace(tmp, path)
    return path


def published(run_dir: Path, shard: int = 0) -> str | None:
    """The address last published in ``run_dir`` (by shard ``shard``); None if none was."""
    try:
        return (run_dir / address_file(shard)).read_text().strip() or None
    except FileNotFoundError:
        return None


def stamp(run_dir: Path, shard: int = 0) -> Stamp | None:
    """Identifies the current publication, to tell a new one from a stale file (a resumed run directory
    holds its previous PS's address). Each publication renames a new file over the old one, created
    while the old one still existed, so it has another inode even when the address is the same."""
    try:
        st = (run_dir / address_file(shard)).stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns


def published_since(run_dir: Path, before: Stamp | None, shard: int = 0) -> str | None:
    """The address published in ``run_dir`` after the publication ``before`` (a ``stamp``); None if none."""
    now = stamp(run_dir, shard)
    return published(run_dir, shard) if now is not None and now != before else None


def free_port(host: str = "127.0.0.1") -> int:
    """A port free at the moment of asking, for tests and benchmarks that start a server on an explicit
    port. Racy (another process may take it before the server binds it): switchps itself never uses it."""
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port
