"""Elastic membership on a real PS on loopback: workers join up to ``max`` over gRPC, one that falls silent
leaves, ps.csv carries N per update, and a join beyond ``max`` is refused with a status and counted."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from cluster import fake_worker
from conftest import wait_until

pytest_plugins = ["cluster"]

ELASTIC = {"workers": {"min": 2, "max": 3, "start": 2}, "leave_after_s": 1.0}


def test_a_bsp_run_grows_and_shrinks_over_grpc(cluster_factory):
    c = cluster_factory(workers=2, size=4, cluster=ELASTIC)
    one = np.ones(4, np.float32)
    for w in c.workers:  # a round of the two it started with
        w.push_async(one, 1)
    wait_until(lambda: c.core.version == 1, what="the first round")
    newcomer = fake_worker(c.address, 2, c.layout, 4)
    newcomer.version = newcomer.client.pull(newcomer.params, worker=2).order.version
    pending = [w.push_async(one, 1) for w in c.workers]
    assert [p.result().reply.applied for p in [newcomer.push_async(one, 1), *pending]] == [True] * 3
    assert c.core.version == 2 and c.core.members.num_workers == 3
    pending = [w.push_async(one, 1) for w in c.workers]  # the newcomer goes silent: it leaves after 1 s
    assert all(p.result().reply.applied for p in pending)
    assert [int(r["members"]) for r in c.ps_rows()] == [2, 3, 2]
    assert [len(r["workers"].split(";")) for r in c.ps_rows()] == [2, 3, 2], "every push applied once"
    assert [(e["worker"], e["members"]) for e in c.events("worker_left")] == [(2, 2)]
    status = c.workers[0].client.status()
    assert (status.members, status.paused) == (2, False)
    with pytest.raises(grpc.RpcError) as err:
        fake_worker(c.address, 3, c.layout, 4)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "outside [0, 3)" in err.value.details()
    assert c.rec.rejections["register:worker"] == 1, "the refusal is counted"
    assert c.core.members.num_workers == 2, "and changes nothing"
    newcomer.client.close()
