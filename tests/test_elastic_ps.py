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


@pytest.mark.parametrize("protocol", [{"name": "bsp"}, {"name": "asp"}, {"name": "amb", "time_budget_s": 5.0}],
                         ids=lambda p: p["name"])
def test_a_run_grows_and_shrinks_over_grpc(cluster_factory, protocol):
    c = cluster_factory(workers=2, size=4, cluster=ELASTIC, protocol=protocol)
    rounds = protocol["name"] != "asp"
    one = np.ones(4, np.float32)
    for p in [w.push_async(one, 1) for w in c.workers]:  # a round of the two it started with
        p.result()
    assert c.core.version == (1 if rounds else 2)
    newcomer = fake_worker(c.address, 2, c.layout, 4)
    newcomer.version = newcomer.client.pull(newcomer.params, worker=2).order.version
    pending = [w.push_async(one, 1) for w in c.workers]
    assert [p.result().reply.applied for p in [newcomer.push_async(one, 1), *pending]] == [True] * 3
    assert c.core.version == (2 if rounds else 5) and c.core.members.num_workers == 3
    status = c.workers[0].client.status()
    assert (status.members, status.paused) == (3, False)
    with pytest.raises(grpc.RpcError) as err:
        fake_worker(c.address, 3, c.layout, 4)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "outside [0, 3)" in err.value.details()
    assert c.rec.rejections["register:worker"] == 1, "the refusal is counted"
    assert c.core.members.num_workers == 3, "and changes nothing"
    pushed = 5
    while c.core.members.num_workers == 3:  # the newcomer goes silent and leaves after 1 s
        assert all(p.result().reply.applied for p in [w.push_async(one, 1) for w in c.workers])
        pushed += 2
    if not rounds:  # an update after the leave (a round's completes with it)
        assert all(p.result().reply.applied for p in [w.push_async(one, 1) for w in c.workers])
        pushed += 2
    members = [int(r["members"]) for r in c.ps_rows()]
    assert members[0] == 2 and members[-1] == 2 and 3 in members, members
    after = members[members.index(3):]
    assert set(after[after.index(2):]) == {2}, "once it left, N is 2"
    assert sum(len(r["workers"].split(";")) for r in c.ps_rows()) == pushed, "every push applied once"
    assert [(e["worker"], e["members"]) for e in c.events("worker_left")] == [(2, 2)]
    newcomer.client.close()


def test_a_worker_that_leaves_is_out_at_once_and_an_unknown_one_is_refused(cluster_factory):
    c = cluster_factory(workers=3, size=4, cluster={"workers": {"min": 1, "max": 3}, "leave_after_s": 600})
    status = c.workers[2].client.leave(2)
    assert (status.members, c.core.members.num_workers) == (2, 2)
    assert [(e["worker"], e["reason"]) for e in c.events("worker_left")] == [(2, "exited")]
    with pytest.raises(grpc.RpcError) as err:
        c.workers[2].client.leave(2)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and c.rec.rejections["leave:unknown_worker"] == 1
