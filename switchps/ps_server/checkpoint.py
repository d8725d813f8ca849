"""Checkpoint files: one self-checking file per saved version, written so that a crash never leaves a
half-written file that could be read.

A file is ``MAGIC | u64 header length | header (JSON) | raw arrays | SHA-256 of all before it``. The
header is the saved state as plain data, with each array replaced by ``{"array": i}``, whose bytes,
dtype and shape the header's ``arrays`` list gives. Writing goes to a temporary file in the same
directory, which is fsynced, renamed over the final name (``os.replace``, atomic) and followed by an
fsync of the directory: after a kill -9 at any moment the directory holds either the previous files
or the new one, whole. Reading verifies the magic and the checksum; ``latest`` skips a file that
fails (torn by a disk fault, truncated, edited) in favour of the one before it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from switchps.jsonfile import dumps

MAGIC = b"SWPSCKP1"
DIGEST = 32
log = logging.getLogger("switchps.ps")


class CheckpointError(ValueError):
    """A checkpoint file that cannot be trusted."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    version: int
    state: dict[str, Any]


def path_for(directory: Path, version: int) -> Path:
    return directory / f"v{version:010d}.ckpt"


def write(directory: Path, version: int, state: dict[str, Any]) -> Path:
    """Write ``state`` (plain data and arrays) as the checkpoint of ``version``, atomically."""
    directory.mkdir(parents=True, exist_ok=True)
    arrays: list[np.ndarray] = []
    header = dumps({"version": version, "state": _split(state, arrays),
                    "arrays": [{"dtype": a.dtype.str, "shape": list(a.shape)} for a in arrays]}).encode()
    final = path_for(directory, version)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    digest = hashlib.sha256()
    with tmp.open("wb") as f:
        parts: list[bytes | memoryview] = [MAGIC, struct.pack("<Q", len(header)), header]
        parts += [np.ascontiguousarray(a).reshape(-1).view(np.uint8).data for a in arrays]
        for part in parts:
            digest.update(part)
            f.write(part)
        f.write(digest.digest())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    _fsync_dir(directory)
    return final


def read(path: Path) -> Checkpoint:
    """The checkpoint in ``path``; raises ``CheckpointError`` unless it is whole and unchanged."""
    data = memoryview(path.read_bytes())
    if len(data) < len(MAGIC) + 8 + DIGEST or bytes(data[:len(MAGIC)]) != MAGIC:
        raise CheckpointError(f"{path.name}: not a switchps checkpoint (or truncated)")
    if hashlib.sha256(data[:-DIGEST]).digest() != bytes(data[-DIGEST:]):
        raise CheckpointError(f"{path.name}: checksum mismatch (torn or altered)")
    (n,) = struct.unpack_from("<Q", data, len(MAGIC))
    start = len(MAGIC) + 8
    header = json.loads(bytes(data[start:start + n]))
    arrays, pos = [], start + n
    for spec in header["arrays"]:
        dtype, shape = np.dtype(spec["dtype"]), tuple(spec["shape"])
        size = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        arrays.append(np.frombuffer(data[pos:pos + size], dtype).reshape(shape).copy())
        pos += size
    return Checkpoint(path, int(header["version"]), _join(header["state"], arrays))


def files(directory: Path) -> list[Path]:
    """Checkpoint files, newest version first (temporary files of an interrupted write excluded)."""
    return sorted(directory.glob("v*.ckpt"), reverse=True) if directory.is_dir() else []


def latest(directory: Path, version: int | None = None) -> Checkpoint | None:
    """The newest readable checkpoint (of ``version``, if given); unreadable ones are logged and skipped."""
    for path in files(directory):
        if version is not None and path != path_for(directory, version):
            continue
        try:
            return read(path)
        except (CheckpointError, OSError, ValueError, KeyError) as e:
            log.warning("skipping checkpoint %s: %s", path, e)
    return None


def prune(directory: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints, and what an earlier process left half written
    (one PS writes a run directory at a time, so a temporary file of another process is dead)."""
    for path in files(directory)[keep:]:
        path.unlink(missing_ok=True)
    for tmp in directory.glob(".v*.ckpt.*.tmp"):
        if tmp.name.split(".")[-2] != str(os.getpid()):
            tmp.unlink(missing_ok=True)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _split(x: Any, arrays: list[np.ndarray]) -> Any:
    if isinstance(x, np.ndarray):
        arrays.append(x)
        return {"array": len(arrays) - 1}
    if isinstance(x, dict):
        return {k: _split(v, arrays) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_split(v, arrays) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x


def _join(x: Any, arrays: list[np.ndarray]) -> Any:
    if isinstance(x, dict):
        if set(x) == {"array"}:
            return arrays[x["array"]]
        return {k: _join(v, arrays) for k, v in x.items()}
    if isinstance(x, list):
        return [_join(v, arrays) for v in x]
    return x
