"""How a model's parameter vector is spread over PS shards: a pure function of the layout and the count.

The vector is the layout's trainable variables then its state, each row-major (``protos.layout``). A
variable larger than ``max_bytes`` is first cut into row blocks (TF's ``MinSizePartitioner``: as few
blocks as keep each within ``max_bytes``, rows spread evenly, never more blocks than rows). The pieces
then go, largest first, each onto the shard holding the fewest bytes so far (ties: the earlier piece,
the lower shard). A shard's part is its pieces in vector order, concatenated: a row block is a
contiguous range of the vector, so a part is a list of ``(start, end)`` ranges.

Every element is in exactly one part, and ``join(split(v)) == v`` bit for bit. A partition's
``digest`` names it: a worker computes the same one from the same layout, and the PS refuses a worker
whose partition differs.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from switchps.protos import switchps_pb2 as pb
from switchps.protos.layout import make_layout, trainable_size

Specs = Sequence[tuple[str, tuple[int, ...]]]
ITEM_BYTES = 4
"""float32 on the wire and on the PS."""


@dataclass(frozen=True)
class Piece:
    """Rows ``[row_start, row_end)`` of one variable: elements ``[start, end)`` of the vector."""

    name: str
    row_start: int
    row_end: int
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Partition:
    """Each shard's pieces, in vector order."""

    parts: tuple[tuple[Piece, ...], ...]
    total: int
    """Elements of the whole vector."""

    @property
    def shards(self) -> int:
        return len(self.parts)

    def sizes(self) -> list[int]:
        """Elements each shard holds."""
        return [sum(p.size for p in part) for part in self.parts]

    def ranges(self, shard: int) -> list[tuple[int, int]]:
        """Shard ``shard``'s part as vector ranges, adjacent pieces merged."""
        out: list[tuple[int, int]] = []
        for p in self.parts[shard]:
            if out and out[-1][1] == p.start:
                out[-1] = (out[-1][0], p.end)
            else:
                out.append((p.start, p.end))
        return out

    def split(self, vector: np.ndarray, into: Sequence[np.ndarray | None] = ()) -> list[np.ndarray]:
        """Each shard's part of ``vector``: copied into ``into[shard]`` where that is given (an array of the
        part's size: a worker's shared-memory segment, so the part is copied once), else a view when the
        part is one range, else a copy."""
        if vector.shape != (self.total,):
            raise ValueError(f"expected a vector of {self.total} elements, got shape {vector.shape}")
        out = []
        for shard in range(self.shards):
            ranges, buffer = self.ranges(shard), into[shard] if shard < len(into) else None
            if buffer is not None:
                at = 0
                for a, b in ranges:
                    buffer[at:at + b - a] = vector[a:b]
                    at += b - a
                out.append(buffer)
                continue
            out.append(vector[ranges[0][0]:ranges[0][1]] if len(ranges) == 1 else
                       np.concatenate([vector[a:b] for a, b in ranges]) if ranges else vector[:0])
        return out

    def join(self, parts: Sequence[np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
        """The whole vector from every shard's part (into ``out`` if given)."""
        if [len(p) for p in parts] != self.sizes():
            raise ValueError(f"expected parts of {self.sizes()} elements, got {[len(p) for p in parts]}")
        out = np.empty(self.total, parts[0].dtype if parts else np.float32) if out is None else out
        for shard, part in enumerate(parts):
            at = 0
            for a, b in self.ranges(shard):
                out[a:b] = part[at:at + b - a]
                at += b - a
        return out

    def describe(self) -> list[list[list[object]]]:
        """Plain data for the run record: per shard, ``[name, row_start, row_end]`` per piece."""
        return [[[p.name, p.row_start, p.row_end] for p in part] for part in self.parts]

    @property
    def digest(self) -> str:
        text = "|".join(";".join(f"{p.name}[{p.row_start}:{p.row_end}]" for p in part) for part in self.parts)
        return hashlib.sha1(f"{self.total}/{text}".encode()).hexdigest()


def blocks(rows: int, nbytes: int, max_bytes: int) -> list[tuple[int, int]]:
    """A variable's row blocks: as few as keep each within ``max_bytes``, at most one per row."""
    n = max(1, min(rows, math.ceil(nbytes / max_bytes)))
    cuts = [rows * i // n for i in range(n + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def partition(variables: Specs, shards: int, max_bytes: int) -> Partition:
    """The partition of the vector of ``variables`` (trainable then state, as in the layout) over
    ``shards`` shards, no variable piece larger than ``max_bytes`` unless it is a single row."""
    if shards < 1 or max_bytes < ITEM_BYTES:
        raise ValueError(f"need shards >= 1 and max_bytes >= {ITEM_BYTES}, got {shards} and {max_bytes}")
    pieces, start = [], 0
    for name, shape in variables:
        size = math.prod(shape)
        rows = shape[0] if shape else 1
        per_row = size // rows if rows else 0
        for a, b in blocks(rows, size * ITEM_BYTES, max_bytes) if size else []:
            pieces.append(Piece(name, a, b, start + a * per_row, start + b * per_row))
        start += size
    load, parts = [0] * shards, [[] for _ in range(shards)]  # type: list[int], list[list[Piece]]
    for i in sorted(range(len(pieces)), key=lambda i: (-pieces[i].size, i)):
        shard = min(range(shards), key=lambda s: (load[s], s))
        parts[shard].append(pieces[i])
        load[shard] += pieces[i].size
    return Partition(tuple(tuple(sorted(p, key=lambda x: x.start)) for p in parts), start)


def of_layout(layout: pb.Layout, shards: int, max_bytes: int) -> Partition:
    """The partition of a wire layout's vector (trainable variables, then state)."""
    specs = [(v.name, tuple(v.shape)) for v in [*layout.variables, *layout.state]]
    return partition(specs, shards, max_bytes)


def part_layout(layout: pb.Layout, part: Partition, shard: int) -> pb.Layout:
    """Shard ``shard``'s part as a layout of its own: one variable per piece, the trainable pieces first
    (a part keeps vector order, and the trainable variables precede the state), so that a shard's store
    treats its part as a PS treats a whole model. Its digest names the model, the partition and the shard."""
    trainable = trainable_size(layout)
    pieces = [(f"{p.name}[{p.row_start}:{p.row_end}]", (p.size,)) for p in part.parts[shard]]
    starts = [p.start for p in part.parts[shard]]
    variables = [s for s, at in zip(pieces, starts) if at < trainable]
    state = [s for s, at in zip(pieces, starts) if at >= trainable]
    out = make_layout(variables, state)
    out.digest = hashlib.sha1(f"{layout.digest}/{part.digest}/{shard}".encode()).hexdigest()
    return out
