"""The run directory on the driver's host while each Ray actor's role writes on its own node.

Under `switchps run --backend ray` no filesystem is assumed to be shared. Each actor runs its role in a
node-local *stage* (``Stage``), seeded from the driver's run directory (``Mirror.seed``: the PS gets
the whole record, with its checkpoints, so that a PS restarted on another node resumes; the others get
``config.yaml``). Every ``cluster.ray.sync_every_s`` and once more when the role ends, the actor sends
what changed (``Stage.changes``: a ``Batch``) and the driver applies it to its run directory
(``Mirror.apply``), which so ends up as a local run's does.

What changed, file by file (temporary files, whose names start with ``.`` or end in ``.tmp``, never):

- a record that only grows (``*.csv``, ``*.jsonl``, ``*.log``, TensorBoard's ``*.tfevents.*``): the bytes
  appended since the last batch, which the driver appends to its copy. Several roles append to
  ``resources.csv``: a role's first rows of a CSV arrive with its header, which the driver keeps once.
  Of a text record only whole lines are sent until the role has ended, so that lines appended to one
  file by several roles (and by the driver, to ``events.jsonl``) never interleave.
- any other file, or a record rewritten (replaced by a rename, or shorter than before): the whole file,
  which the driver writes atomically (a temporary file renamed over it).
- a file the role deleted (checkpoints pruned): deleted on the driver too.

A lost node loses what its role wrote since its last batch (at most ``sync_every_s``); a checkpoint
reaches the driver at the next batch after it is written.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

APPENDED = (".csv", ".jsonl", ".log")
"""Files a role only appends to (and TensorBoard's event files)."""
PS_SEED_SKIPS = ("logs", "tensorboard")
"""What a PS's stage is not seeded with: other roles' logs, and event files a resumed PS does not read."""

Stat = tuple[int, int, int]
"""A file as last sent: (inode, size, mtime in ns)."""


@dataclass
class Change:
    """One file's change: ``data`` appended at ``offset`` of the role's copy, or (``offset`` None) the
    whole file."""

    path: str
    data: bytes
    offset: int | None = None


@dataclass
class Batch:
    """What a stage's role changed since the previous batch."""

    changes: list[Change] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)


def appended(path: str) -> bool:
    return path.endswith(APPENDED) or ".tfevents." in PurePosixPath(path).name


def lines(path: str) -> bool:
    """A record of text lines (TensorBoard's event files are binary, with one writer)."""
    return path.endswith(APPENDED)


def temporary(path: Path) -> bool:
    return path.name.startswith(".") or path.name.endswith(".tmp")


def _stat(path: Path) -> Stat:
    st = path.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns


@dataclass
class Stage:
    """A role's node-local run directory and what of it the driver has (used by one thread at a time)."""

    root: Path
    sent: dict[str, Stat] = field(default_factory=dict)

    @classmethod
    def seeded(cls, root: Path, files: dict[str, bytes]) -> "Stage":
        """A new stage at ``root`` (private to this user) holding ``files``, which the driver has."""
        root.mkdir(parents=True, mode=0o700)
        stage = cls(root)
        for rel, data in files.items():
            path = root / safe(rel)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            stage.sent[rel] = _stat(path)
        return stage

    def changes(self, final: bool = False) -> Batch:
        """What changed since the last call (or since the seed); nothing if the stage itself is gone (a
        deletion is of a file, never of the whole stage). ``final``: the role has ended, so a text
        record's last line is sent even if it has no newline."""
        batch, present = Batch(), set()
        if not self.root.is_dir():
            return batch
        for path in sorted(p for p in self.root.rglob("*") if p.is_file() and not temporary(p)):
            rel = path.relative_to(self.root).as_posix()
            present.add(rel)
            try:
                change = self._change(rel, path, final)
            except FileNotFoundError:  # replaced or deleted while we looked: the next batch has it
                present.discard(rel)
                continue
            if change is not None:
                batch.changes.append(change)
        batch.deleted = sorted(rel for rel in self.sent if rel not in present)
        for rel in batch.deleted:
            del self.sent[rel]
        return batch

    def _change(self, rel: str, path: Path, final: bool) -> Change | None:
        now, before = _stat(path), self.sent.get(rel)
        if now == before:
            return None
        offset = None  # the whole file, unless a record grew (or is new): what was appended
        if appended(rel) and before is None:
            offset = 0
        elif appended(rel) and before is not None and now[0] == before[0] and now[1] >= before[1]:
            offset = before[1]
        with path.open("rb") as f:
            f.seek(offset or 0)
            data = f.read()
        if offset is not None and not final and lines(rel):
            data = data[:data.rfind(b"\n") + 1]  # a line being written waits for the next batch
            if not data and before is not None:
                return None
        # what was read is what was sent, even if the role wrote more meanwhile
        size = (offset or 0) + len(data)
        self.sent[rel] = (now[0], size, now[2] if size == now[1] else -1)
        return Change(rel, data, offset)


def staged(args: list[str], run_dir: str, stage: str) -> list[str]:
    """A role's arguments with the driver's run directory (and paths in it) moved to its stage."""
    return [stage + a[len(run_dir):] if a == run_dir or a.startswith(run_dir.rstrip("/") + "/") else a
            for a in args]


def safe(rel: str) -> Path:
    """``rel`` as a relative path inside a run directory; ``ValueError`` if it would leave it."""
    p = PurePosixPath(rel)
    if p.is_absolute() or not p.parts or any(part in ("..", "") for part in p.parts):
        raise ValueError(f"not a path inside a run directory: {rel!r}")
    return Path(*p.parts)


@dataclass
class Mirror:
    """The driver's run directory, which batches from every role's stage are applied to (one thread)."""

    root: Path

    def seed(self, role: str) -> dict[str, bytes]:
        """The files a role's new stage starts with: for the PS (shard 0), everything the record holds
        but logs, TensorBoard and the other shards' parts; for follower shard K (``ps-K``), its saved
        parts and the address it had; ``config.yaml`` for every role."""
        if role == "ps":
            return self._files(lambda parts: parts[0] not in PS_SEED_SKIPS and not (
                parts[0] == "checkpoints" and len(parts) > 2))  # checkpoints/shard-K/: follower K's
        if role.startswith("ps-"):
            mine = ("checkpoints", f"shard-{role[3:]}")
            return self._files(lambda parts: parts[:2] == mine or parts in (("config.yaml",), (f"{role}.address",)))
        return {"config.yaml": (self.root / "config.yaml").read_bytes()}

    def _files(self, keep: Callable[[tuple[str, ...]], bool]) -> dict[str, bytes]:
        """The run directory's files (none temporary) whose path parts ``keep`` accepts."""
        return {p.relative_to(self.root).as_posix(): p.read_bytes() for p in sorted(self.root.rglob("*"))
                if p.is_file() and not temporary(p) and keep(p.relative_to(self.root).parts)}

    def apply(self, batch: Batch) -> list[str]:
        """Apply ``batch``; returns the paths it refused (outside the run directory), applying the rest."""
        refused = []
        for change in batch.changes:
            try:
                path = self.root / safe(change.path)
            except ValueError:
                refused.append(change.path)
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            if change.offset is None:
                tmp = path.with_name(f".{path.name}.mirror.tmp")
                tmp.write_bytes(change.data)
                os.replace(tmp, path)
            else:
                self._append(path, change)
        for rel in batch.deleted:
            try:
                (self.root / safe(rel)).unlink(missing_ok=True)
            except ValueError:
                refused.append(rel)
        return refused

    @staticmethod
    def _append(path: Path, change: Change) -> None:
        data = change.data
        if change.offset == 0 and path.suffix == ".csv" and path.exists() and path.stat().st_size:
            with path.open("rb") as f:
                header = f.readline()
            if data.startswith(header):  # another role's copy of the CSV's header
                data = data[len(header):]
        with path.open("ab") as f:
            f.write(data)
