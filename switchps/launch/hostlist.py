"""SLURM's compact host lists and tasks-per-node counts, expanded without asking SLURM.

``expand("node[01-03,07]")`` gives ``node01 node02 node03 node07`` (zero padding kept, as
``scontrol show hostnames`` does), ``expand("a[1-2],b3")`` gives ``a1 a2 b3``, a bracket may sit
anywhere in a name (``gpu-[1-2]-ib``) and several brackets multiply out. ``tasks_per_node("2(x3),1")``
gives ``[2, 2, 2, 1]`` (the format of ``SLURM_STEP_TASKS_PER_NODE``). Malformed input raises
``ValueError`` naming what is wrong.
"""

from __future__ import annotations

import re
from itertools import product

MAX_HOSTS = 1_000_000
"""A range larger than this is refused rather than expanded (a typo such as ``n[1-99999999]``)."""
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
_COUNT = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def split_top(text: str) -> list[str]:
    """``text`` split at the commas outside brackets; ValueError if brackets do not pair up."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        if c == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"host list {text!r}: nested '['")
        elif c == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"host list {text!r}: ']' without '['")
        elif c == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"host list {text!r}: '[' without ']'")
    parts.append(text[start:])
    return parts


def _range(spec: str, whole: str) -> list[str]:
    """One bracket's contents, ``01-03,07``, as the strings it stands for (width of the start kept)."""
    out: list[str] = []
    for item in spec.split(","):
        m = _RANGE.fullmatch(item)
        if not m:
            raise ValueError(f"host list {whole!r}: {item!r} is not a number or a range lo-hi")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise ValueError(f"host list {whole!r}: range {item!r} runs backwards")
        if int(hi) - int(lo) >= MAX_HOSTS:
            raise ValueError(f"host list {whole!r}: range {item!r} holds more than {MAX_HOSTS} hosts")
        out += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]
    return out


def _expand_one(pattern: str, whole: str) -> list[str]:
    """One comma-free pattern such as ``gpu-[1-2]-ib`` (any number of brackets) as host names."""
    pieces: list[list[str]] = []
    for m in re.finditer(r"\[([^\]]*)\]|([^\[\]]+)", pattern):
        pieces.append(_range(m.group(1), whole) if m.group(1) is not None else [m.group(2)])
    return ["".join(p) for p in product(*pieces)]


def expand(hostlist: str) -> list[str]:
    """The host names a SLURM host list such as ``node[01-03,07],login1`` stands for, in order."""
    text = hostlist.strip()
    if not text:
        raise ValueError("host list is empty")
    hosts: list[str] = []
    for pattern in split_top(text):
        if not pattern:
            raise ValueError(f"host list {hostlist!r}: an empty name between commas")
        hosts += _expand_one(pattern, hostlist)
    return hosts


def tasks_per_node(spec: str) -> list[int]:
    """``SLURM_STEP_TASKS_PER_NODE``/``SLURM_TASKS_PER_NODE`` (``2(x3),1``) as one count per node."""
    counts: list[int] = []
    for item in spec.strip().split(","):
        m = _COUNT.fullmatch(item.strip())
        if not m:
            raise ValueError(f"tasks per node {spec!r}: {item!r} is not N or N(xM)")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def node_of_rank(rank: int, nodes: list[str], counts: list[int]) -> str:
    """The node that holds task ``rank`` when tasks are placed in blocks (SLURM's default distribution):
    the first ``counts[0]`` ranks on ``nodes[0]``, the next ``counts[1]`` on ``nodes[1]``, and so on."""
    if len(nodes) != len(counts):
        raise ValueError(f"{len(nodes)} nodes but tasks per node for {len(counts)}")
    if rank < 0:
        raise ValueError(f"rank {rank} is negative")
    first = 0
    for node, count in zip(nodes, counts):
        if rank < first + count:
            return node
        first += count
    raise ValueError(f"rank {rank} outside the {first} tasks these nodes hold")
