"""The partition of the parameter vector over PS shards (``switchps.protos.partition``): pure, exact."""

from __future__ import annotations

import math

import numpy as np
import pytest

from switchps.protos.partition import blocks, partition

MB = 1024 * 1024
LOGREG = [("dense/kernel", (784, 10)), ("dense/bias", (10,))]
CNN = [("conv/kernel", (3, 3, 1, 32)), ("conv/bias", (32,)), ("dense/kernel", (5408, 128)),
       ("dense/bias", (128,)), ("out/kernel", (128, 10)), ("out/bias", (10,)), ("bn/moving_mean", (32,))]


def total(specs) -> int:
    return sum(math.prod(s) for _, s in specs)


@pytest.mark.parametrize("specs", [LOGREG, CNN, [("big", (25600, 1024)), ("b", (7,)), ("scalar", ())]])
@pytest.mark.parametrize("shards", [1, 2, 3, 4])
def test_every_element_is_in_one_part_and_split_then_join_is_bit_identical(specs, shards):
    p = partition(specs, shards, 4 * MB)
    assert p.total == total(specs) == sum(p.sizes())
    covered = sorted(r for s in range(shards) for r in p.ranges(s))
    assert [a for a, _ in covered] == [0] + [b for _, b in covered[:-1]] and covered[-1][1] == p.total
    v = np.random.default_rng(shards).standard_normal(p.total).astype(np.float32)
    parts = p.split(v)
    assert [len(x) for x in parts] == p.sizes()
    assert p.join(parts).tobytes() == v.tobytes()
    into = [np.empty(n, np.float32) if k % 2 == 0 else None for k, n in enumerate(p.sizes())]  # even shards: segments
    written = p.split(v, into)
    assert all(w is b for w, b in zip(written, into) if b is not None), "written where given, no other copy"
    assert [w.tobytes() for w in written] == [x.tobytes() for x in parts]


def test_one_shard_holds_the_whole_vector_as_one_view():
    p = partition(CNN, 1, 4 * MB)
    assert p.ranges(0) == [(0, total(CNN))]
    v = np.arange(p.total, dtype=np.float32)
    (part,) = p.split(v)
    assert np.shares_memory(part, v), "no copy with one shard"


def test_a_variable_over_the_limit_is_cut_into_row_blocks_and_the_shards_balance():
    big = [("embedding", (25600, 1024))]  # 100 MiB of float32
    p = partition(big, 4, 4 * MB)
    pieces = [x for part in p.parts for x in part]
    assert len(pieces) == 25 and all(x.size * 4 <= 4 * MB for x in pieces)
    assert sorted((x.row_start, x.row_end) for x in pieces) == [(i * 1024, (i + 1) * 1024) for i in range(25)]
    assert max(p.sizes()) - min(p.sizes()) == 1024 * 1024, "greedy: within one piece of even"


def test_largest_first_onto_the_lightest_shard():
    p = partition([("a", (10,)), ("b", (40,)), ("c", (30,)), ("d", (20,))], 2, 4 * MB)
    # b (40) to shard 0, c (30) to 1, d (20) to 1 (30 < 40), a (10) to 0 (40 < 50); each part in vector order
    assert [[x.name for x in part] for part in p.parts] == [["a", "b"], ["c", "d"]]
    assert p.sizes() == [50, 50] and p.ranges(0) == [(0, 50)] and p.ranges(1) == [(50, 100)]


def test_blocks_never_cut_finer_than_a_row():
    assert blocks(3, 100 * MB, 4 * MB) == [(0, 1), (1, 2), (2, 3)]
    assert blocks(10, 8, 4 * MB) == [(0, 10)]
    assert blocks(10, 9 * MB, 4 * MB) == [(0, 3), (3, 6), (6, 10)]


def test_the_digest_names_the_partition():
    assert partition(CNN, 3, 4 * MB).digest == partition(list(CNN), 3, 4 * MB).digest
    assert partition(CNN, 3, 4 * MB).digest != partition(CNN, 2, 4 * MB).digest
    assert partition(CNN, 2, 4 * MB).digest != partition(CNN, 2, 1 * MB).digest
    renamed = [("other", CNN[0][1]), *CNN[1:]]
    assert partition(CNN, 2, 4 * MB).digest != partition(renamed, 2, 4 * MB).digest
    assert partition(CNN, 2, MB).describe()[0][0][0] == "dense/kernel"


def test_wrong_sizes_are_refused():
    p = partition(LOGREG, 2, 4 * MB)
    with pytest.raises(ValueError, match="7850 elements"):
        p.split(np.zeros(7849, np.float32))
    with pytest.raises(ValueError, match="parts of"):
        p.join([np.zeros(3, np.float32), np.zeros(3, np.float32)])
    with pytest.raises(ValueError, match="shards >= 1"):
        partition(LOGREG, 0, 4 * MB)
