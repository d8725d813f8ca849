"""One process per worker index (``Lifecycle.check_holder``): a second live process registering at a held index
is refused and changes nothing; once the holder was silent for ``lease_s`` the newcomer takes the index and
the holder's pushes and ``Leave`` are refused. On the core, a fake clock, no sockets."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from cluster import fake_worker
from conftest import wait_until
from harness import Harness
from switchps.ps_server.core.events import Bounds
from switchps.refusals import INDEX_IN_USE, Rejected

pytest_plugins = ["cluster"]
OLD, NEW = 11, 22  # two processes' sessions


def held(workers: int = 2, bounds: Bounds | None = None) -> Harness:
    """A run whose worker 0 is process OLD (lease 10 s, the default), training under BSP."""
    h = Harness(workers=workers, start=False, bounds=bounds)
    h.run(h.core.register(0, 100, h.now, session=OLD))
    for w in range(1, workers):
        h.run(h.core.register(w, 100, h.now))
    h.run(h.core.initialized_at(h.now))
    for w in range(workers):
        h.core.issue(w, h.now)
    return h


def test_a_second_live_process_at_a_held_index_is_refused_and_changes_nothing():
    h = held()
    h.now += 9.0
    before = (dict(h.core.members.registered), dict(h.core.members.sessions), dict(h.core.members.last_seen))
    for attempt in (lambda: h.core.check_register(0, 100, session=NEW, now=h.now),
                    lambda: h.core.register(0, 100, h.now, session=NEW)):
        with pytest.raises(Rejected) as refused:
            attempt()
        assert refused.value.code == "ALREADY_EXISTS" and refused.value.reason == "index_in_use"
        assert str(refused.value).startswith(f"{INDEX_IN_USE} 0") and "cluster.lease_s (10s)" in str(refused.value)
    assert (dict(h.core.members.registered), dict(h.core.members.sessions), dict(h.core.members.last_seen)) == before
    h.push(0, 1.0, session=OLD, step=1)  # the holder goes on
    h.push(1, 1.0)
    assert h.core.version == 1


def test_the_same_process_registering_again_is_a_rejoin_not_a_second_process():
    h = held()
    h.run(h.core.register(0, 100, h.now + 1.0, session=OLD))
    assert h.core.members.sessions[0] == OLD


def test_a_holder_silent_for_the_lease_is_superseded():
    """The holder crashed; its restart takes the index; a late push or Leave of the old process is refused."""
    h = held()
    h.now += 10.0
    h.run(h.core.register(0, 100, h.now, session=NEW))
    h.core.issue(0, h.now)
    assert h.core.members.sessions[0] == NEW
    with pytest.raises(Rejected) as late:
        h.push(0, 5.0, session=OLD, step=1)
    assert late.value.code == "FAILED_PRECONDITION" and late.value.reason == "superseded"
    with pytest.raises(Rejected, match="held by a newer process"):
        h.core.leave(0, h.now, session=OLD)
    h.push(0, 1.0, session=NEW, step=0)
    h.push(1, 1.0)
    assert h.core.version == 1 and h.applied[0].aggregate.samples == 2, "one push per index"
    h.check_books()


def test_a_holder_whose_push_waits_in_a_round_is_live_however_long():
    h = held()
    h.push(0, 1.0, session=OLD, step=1)  # waits for worker 1
    h.now += 1_000.0
    with pytest.raises(Rejected, match=INDEX_IN_USE):
        h.core.register(0, 100, h.now, session=NEW)


def test_unnamed_sessions_are_not_checked():
    h = held()
    h.run(h.core.register(0, 100, h.now))  # a client that names no session
    h.run(h.core.register(1, 100, h.now, session=NEW))  # worker 1 registered unnamed: nothing to compare
    assert h.core.members.sessions == {0: OLD, 1: NEW}


def test_an_elastic_member_that_left_frees_its_index():
    h = held(workers=2, bounds=Bounds(min=1, max=3, leave_after_s=100.0))
    h.run(h.core.leave(0, h.now, session=OLD))
    assert 0 not in h.core.members.sessions
    h.run(h.core.register(0, 100, h.now, session=NEW))  # at once: the index is free
    assert h.core.members.sessions[0] == NEW


def test_a_resumed_core_forgets_the_sessions():
    """After a PS restart every process registers again; the first at each index holds it."""
    h = held()
    state = h.core.lifecycle.state_dict(h.now)
    h.core.lifecycle.load_state_dict(state, h.now)
    assert h.core.members.sessions == {}
    h.run(h.core.register(0, 100, h.now, session=NEW))
    assert h.core.members.sessions[0] == NEW


def test_over_grpc_a_second_process_is_refused_then_takes_over_after_the_lease(cluster_factory):
    """A real PS on loopback: worker 0's index named by process OLD; process NEW's registration is refused
    with ALREADY_EXISTS and counted while OLD is heard from, accepted once OLD was silent for lease_s (0.5 s);
    OLD's next push is then refused FAILED_PRECONDITION and counted, and nothing of it is applied."""
    c = cluster_factory(workers=2, size=4, protocol={"name": "asp"}, cluster={"lease_s": 0.5})
    old, new = c.workers[0], fake_worker(c.address, 1, c.layout, 4)  # a second channel (as worker 1: a real token)
    one = np.ones(4, np.float32)
    old.client.register(0, c.layout, 100, session=OLD, local_steps=True)
    old.push(one, 1, session=OLD, step=0)
    with pytest.raises(grpc.RpcError) as err:
        new.client.register(0, c.layout, 100, session=NEW, local_steps=True)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS and err.value.details().startswith(INDEX_IN_USE)
    assert c.rec.rejections["register:index_in_use"] == 1 and c.core.members.sessions[0] == OLD
    version = c.core.version

    def taken() -> bool:
        try:
            new.client.register(0, c.layout, 100, session=NEW, local_steps=True)
            return True
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.ALREADY_EXISTS, e.details()
            return False

    wait_until(taken, 30, "the index taken once its holder was silent for lease_s")
    with pytest.raises(grpc.RpcError) as late:
        old.push(one, 1, session=OLD, step=1)
    assert late.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "newer process" in late.value.details()
    assert c.rec.rejections["push:superseded"] == 1 and c.core.version == version, "nothing of it applied"
    new.index = 0
    new.push(one, 1, session=NEW, step=0)
    assert c.core.version == version + 1
    new.client.close()
