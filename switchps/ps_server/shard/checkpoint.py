"""A follower shard's checkpoints: its part of the model, saved where shard 0's action log says.

Shard 0 sends ``checkpoint(v)`` in its action order at the moment it takes its own checkpoint of
version v, so a follower captures its part (values, optimizer state, open sums) after exactly the same
joins and updates. The file (``checkpoint``'s self-checking format) goes to
``RUN_DIR/checkpoints/shard-K/``, and the follower tells shard 0 the file's SHA-256. Shard 0 writes its
own checkpoint only once every follower's part is saved, with their digests as its manifest: shard 0's
file is the commit point, and a version without it is never resumed from. On a resume, shard 0 sends
each follower ``restore(v, digest)``; a follower whose file is missing, or holds another version or
other bytes, refuses, and the run stops with one line saying which.

Concurrency: ``capture`` runs on the store's applier thread (queued by ``ModelStore.control``);
``PartSaver`` writes on a thread of its own, one checkpoint at a time, so neither the event loop nor the
applier waits for the disk.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from switchps.protos import switchps_pb2 as pb
from switchps.protos.partition import of_layout, part_layout
from switchps.ps_server import checkpoint
from switchps.ps_server.store import ModelStore


def part_dir(run_dir: Path, shard: int) -> Path:
    return run_dir / "checkpoints" / f"shard-{shard}"


def file_digest(path: Path) -> str:
    """A checkpoint file's SHA-256, which its last bytes hold (``checkpoint``'s format)."""
    with path.open("rb") as f:
        f.seek(-checkpoint.DIGEST, 2)
        return f.read().hex()


def capture(store: ModelStore) -> dict[str, Any]:
    """The part's whole state, copied (on the applier: after the updates before, none after)."""
    return {"layout": np.frombuffer(store.layout.SerializeToString(), np.uint8), "values": store.values.copy(),
            "optimizer": {k: v.copy() if isinstance(v, np.ndarray) else v
                          for k, v in store.optimizer.state_dict(copy=False).items()},
            "outer": store.outer.state_dict(),
            "sums": store.sums.state_dict()}


class PartSaver:
    """Writes a follower's checkpoints, one at a time, keeping the newest ``keep`` (and one more, so the
    one shard 0's latest manifest names is never pruned while shard 0 writes the next)."""

    def __init__(self, directory: Path, keep: int) -> None:
        self.directory, self.keep = directory, keep + 1
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="switchps-shard-checkpoint")

    def save(self, version: int, state: dict[str, Any], done: Callable[[pb.ShardSaved], None]) -> None:
        """Write in the background; ``done`` gets the digest, or the error."""
        self._writer.submit(self._write, version, state, done)

    def _write(self, version: int, state: dict[str, Any], done: Callable[[pb.ShardSaved], None]) -> None:
        try:
            path = checkpoint.write(self.directory, version, state)
            checkpoint.prune(self.directory, self.keep)
            done(pb.ShardSaved(version=version, digest=file_digest(path)))
        except OSError as e:
            done(pb.ShardSaved(version=version, error=str(e)))

    def close(self) -> None:
        self._writer.shutdown(wait=True)


def restore_part(store: ModelStore, directory: Path, version: int, digest: str) -> pb.Layout:
    """Load the part saved at ``version`` into ``store`` (not yet serving); its layout. ``ValueError``
    naming the file if it is missing, torn, of another version or not the file shard 0's manifest names."""
    path = checkpoint.path_for(directory, version)
    if not path.exists():
        raise ValueError(f"{path} is missing (shard 0 resumed from version {version})")
    if file_digest(path) != digest:
        raise ValueError(f"{path} is not the file shard 0's checkpoint names (its SHA-256 differs)")
    try:
        state = checkpoint.read(path).state
    except checkpoint.CheckpointError as e:
        raise ValueError(f"{path}: {e}") from None
    layout = pb.Layout.FromString(state["layout"].tobytes())
    store.restore(layout, state["values"], state["optimizer"], version, state.get("outer"))
    store.sums.load_state_dict(state["sums"])
    return layout


def whole_model(ckpt: checkpoint.Checkpoint, run_dir: Path, layout: pb.Layout, max_bytes: int) -> np.ndarray:
    """The whole parameter vector of a sharded PS's checkpoint: shard 0's part joined with every part its
    manifest names (each file checked against its digest). ``ValueError`` naming what does not fit."""
    manifest: dict[str, str] = ckpt.state["shards"]
    part = of_layout(layout, len(manifest) + 1, max_bytes)
    saved = pb.Layout.FromString(ckpt.state["layout"].tobytes())
    if part_layout(layout, part, 0).digest != saved.digest:
        raise ValueError(f"{ckpt.path}: its part of the model is not part 0 of this model over "
                         f"{len(manifest) + 1} shards (the same model and runtime.shard_max_mb?)")
    parts = [ckpt.state["values"]]
    for shard, digest in sorted(manifest.items(), key=lambda kv: int(kv[0])):
        path = checkpoint.path_for(part_dir(run_dir, int(shard)), ckpt.version)
        if not path.exists() or file_digest(path) != digest:
            raise ValueError(f"{path} is missing or is not the file {ckpt.path.name} names")
        parts.append(checkpoint.read(path).state["values"])
    return part.join(parts)
