"""Outer optimizers (issue 46): an aggregate of pushed movements is stepped by the outer optimizer its
``Apply.outer`` names, with state of its own that switches, the run's optimizer changes and checkpoints keep."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from harness import Harness
from switchps.config.optimizer import OptimizerSpec
from switchps.config.protocol import AVERAGING as LOCAL_SGD_OUTER
from switchps.ps_server.core.actions import Apply
from switchps.ps_server.core.events import StepReport
from switchps.protos.layout import make_layout
from switchps.ps_server import checkpoint
from switchps.ps_server.checkpointer import Parts, restore, where_applied
from switchps.ps_server.outer import key_of
from switchps.ps_server.shard.checkpoint import capture, file_digest, restore_part
from switchps.ps_server.store import ModelStore
from switchps.optim.optimizers import adjust_optimizer, make_optimizer
from switchps.optim.schedules import make_schedule
from switchps.policies.base import Decision
from switchps.refusals import Rejected

pytest_plugins = ["cluster"]  # cluster_factory: a PS on loopback

SIZE = 300
NESTEROV = OptimizerSpec(name="nesterov", learning_rate=0.7, params={"momentum": 0.9})
AVERAGING = OptimizerSpec(name="sgd", learning_rate=1.0)


def _store() -> ModelStore:
    store = ModelStore(lambda n: make_optimizer("sgd", n, make_schedule("constant", 0.1)), inline_bytes=2**16)
    store.initialize(make_layout([("w", (SIZE,))]), np.zeros(SIZE, np.float32))
    return store


def _update(store: ModelStore, delta: float, samples: int = 2, outer: OptimizerSpec | None = None,
            lr_factor: float = 1.0) -> list[float]:
    """One aggregate of ``delta`` summed over ``samples``; the learning rate its update recorded."""
    lrs: list[float] = []
    aggregate = store.version + 1
    store.join(aggregate, np.full(SIZE, delta * samples, np.float32))
    store.submit(aggregate, samples, lr_factor=lr_factor, on_applied=lrs.append, outer=outer)
    assert store.wait_idle(5)
    return lrs


def test_movements_step_the_outer_optimizer_and_gradients_the_runs():
    store = _store()
    assert _update(store, 1.0) == [np.float32(0.1)]  # a gradient: the run's SGD at 0.1
    np.testing.assert_allclose(store.values, -0.1)
    assert _update(store, 1.0, outer=AVERAGING) == [1.0]  # the mean movement, stepped at lr 1: averaging
    np.testing.assert_allclose(store.values, -1.1, rtol=1e-6)
    assert store.optimizer.iterations == 1 and store.outer.get(AVERAGING).iterations == 1


def test_an_outer_optimizer_keeps_its_state_across_gradients_and_the_runs_changes():
    store, twin = _store(), make_optimizer("nesterov", SIZE, make_schedule("constant", 0.7), momentum=0.9)
    expected = np.zeros(SIZE, np.float32)
    for i, delta in enumerate([1.0, 0.5, 0.25]):
        _update(store, delta, outer=NESTEROV)
        twin.apply(expected, np.full(SIZE, delta, np.float32))
        _update(store, 0.0)  # a gradient in between (zero: values stay) steps the run's optimizer only
        store.control(lambda o: adjust_optimizer(o, lr_scale=0.25, state="reset", state_scale=1.0, momentum=0.0))
    np.testing.assert_allclose(store.values, expected, rtol=1e-6)  # momentum carried over, never reset
    assert store.outer.get(NESTEROV).lr_scale == 1.0 and store.optimizer.lr_scale == 0.25


def test_the_outer_step_is_its_specs_rate_on_its_own_schedule_times_the_lr_factor():
    decay = OptimizerSpec(name="sgd", learning_rate=1.0, schedule={"kind": "exponential", "decay_steps": 1,
                                                                   "decay_rate": 0.5})
    store = _store()
    for _ in range(3):
        _update(store, 1.0)  # the run's optimizer counts these, the outer schedule does not
    store.control(lambda o: adjust_optimizer(o, lr_scale=4.0, state="keep", state_scale=1.0, momentum=None))
    assert _update(store, 1.0, outer=decay, lr_factor=0.5) == [0.5]
    assert _update(store, 1.0, outer=decay, lr_factor=0.5) == [0.25]


def test_one_optimizer_per_distinct_spec_however_written():
    store = _store()
    again = OptimizerSpec.model_validate({"params": {"momentum": 0.9}, "learning_rate": 0.7, "name": "nesterov"})
    assert key_of(again) == key_of(NESTEROV) and store.outer.get(again) is store.outer.get(NESTEROV)
    assert store.outer.get(AVERAGING) is not store.outer.get(NESTEROV) and len(store.outer.made) == 2


def _twin_stores() -> tuple[ModelStore, ModelStore]:
    """A store with momentum in its outer optimizer, and a fresh one to restore into."""
    store = _store()
    _update(store, 1.0, outer=NESTEROV)
    _update(store, 1.0)
    return store, _store()


def test_a_checkpoint_keeps_every_outer_optimizers_state_and_an_older_one_still_loads(tmp_path):
    store, resumed = _twin_stores()
    state: dict = {"core": {}, "layout": np.frombuffer(store.layout.SerializeToString(), np.uint8)}
    where_applied(Parts(core=_NoCore(), model=store), state)  # the model's side of a checkpoint
    saved = checkpoint.read(checkpoint.write(tmp_path, store.version, state)).state
    restore(Parts(core=_NoCore(), model=resumed), saved, store.version, 0.0, crash=False)
    for s in (store, resumed):
        _update(s, 0.5, outer=NESTEROV)
    np.testing.assert_array_equal(resumed.values, store.values)  # the momentum came back
    del saved["outer"]  # a checkpoint from before outer optimizers
    older = _store()
    restore(Parts(core=_NoCore(), model=older), saved, store.version, 0.0, crash=False)
    assert older.outer.made == {} and older.optimizer.iterations == 1


def test_a_shards_part_keeps_its_outer_optimizers(tmp_path):
    store, resumed = _twin_stores()
    path = checkpoint.write(tmp_path, store.version, capture(store))
    restore_part(resumed, tmp_path, store.version, file_digest(path))
    for s in (store, resumed):
        _update(s, 0.5, outer=NESTEROV)
    np.testing.assert_array_equal(resumed.values, store.values)


class _NoCore:
    """A core whose state these tests leave out (they check the model's side)."""

    def load_state_dict(self, state: object, now: float) -> None:
        pass

    def restarted(self, now: float) -> None:
        pass


# ---- the core: which optimizer each update names, across switches (the harness: no sockets, a fake clock) -------


class Outer(Harness):
    """The harness with the store's rule: a gradient steps the run's SGD (at the ``SetOptimizer`` scale), a
    movement the outer SGD its ``Apply`` names, at that spec's rate (never the run's scale)."""

    def apply(self, a: Apply) -> None:
        if a.outer is None:
            return super().apply(a)
        assert a.outer.name == "sgd" and not a.outer.params, "the harness steps plain SGD"
        grad = self.sums.take(a.aggregate.id)
        self.params -= a.outer.learning_rate * a.lr_factor * grad.astype(np.float64) / a.aggregate.samples
        self.applied.append(a)

    def moved(self, worker: int, by: float, steps: int, batch: int = 2, base: int | None = None) -> int:
        """A push of ``steps`` local steps of ``batch`` samples that moved the model by ``by`` (theta_start -
        theta_end): ``samples * by``, as a worker pushes it."""
        samples = steps * batch
        return self.push(worker, samples * by, samples=samples, base=base,
                         report=StepReport(local_steps=steps, local_loss_sums=(1.0,) * steps))

    def kinds(self) -> list[tuple[str, int, bool]]:
        """Per update: its protocol, its pushes, and whether an outer optimizer applies it."""
        return [(a.protocol, len(a.aggregate.members), a.outer is not None) for a in self.applied]


def test_bsp_to_local_sgd_and_back_switches_between_rounds_and_names_the_outer_optimizer_for_movements():
    h = Outer(workers=2, protocol={"batch": 2})
    assert h.core.switching.respec({"name": "local_sgd"}).local_steps == 8, "its own H, not bsp's None"
    a = h.push(0, 2.0, samples=2)
    h.switch(name="local_sgd", local_steps=3)
    assert h.core.spec.name == "bsp" and not h.released(a), "the switch waits for the round in flight"
    b = h.push(1, 2.0, samples=2)
    assert h.core.spec.name == "local_sgd" and h.core.spec.local_steps == 3
    assert [(h.releases[i].order.local.steps, h.releases[i].order.local.batch) for i in (a, b)] == [(3, 2)] * 2
    before = h.params.copy()
    c = h.moved(0, 0.5, 3)
    h.switch(name="bsp")
    assert h.core.spec.name == "local_sgd", "the round of movements goes on"
    d = h.moved(1, 1.5, 3)
    np.testing.assert_allclose(h.params, before - 1.0)  # outer SGD at lr 1: the mean movement, averaging
    assert h.applied[-1].outer == LOCAL_SGD_OUTER and h.applied[-1].aggregate.local_steps == 6
    assert h.core.spec.name == "bsp" and h.core.spec.local_steps is None
    assert all(h.releases[i].order.local is None for i in (c, d)), "the orders after it are gradients'"
    h.push(0, 1.0, samples=2)
    h.push(1, 1.0, samples=2)
    assert h.kinds() == [("bsp", 2, False), ("local_sgd", 2, True), ("bsp", 2, False)]
    h.check_books()


def test_asp_to_async_local_sgd_applies_the_gradients_in_flight_alone_with_the_runs_optimizer():
    h = Outer(workers=3, protocol={"name": "asp", "batch": 2})
    h.push(0, 2.0, samples=2)
    h.switch(name="async_local_sgd", local_steps=2)
    assert h.core.spec.name == "async_local_sgd"
    g = [h.push(w, 2.0, samples=2, base=0) for w in (1, 2)]  # computed before the switch
    assert h.kinds()[1:] == [("async_local_sgd", 1, False)] * 2, "each alone, as a gradient"
    assert all(h.releases[i].order.local is not None for i in g)
    m = h.moved(1, 1.0, 2)
    assert h.kinds()[-1] == ("async_local_sgd", 1, True) and h.releases[m].outcome.applied
    assert h.applied[-1].aggregate.members[0].local_steps == 2
    h.check_books()


def test_async_local_sgd_to_bsp_applies_the_movements_in_flight_alone_with_the_outer_optimizer():
    h = Outer(workers=3, protocol={"name": "async_diloco", "batch": 2, "local_steps": 2,
                                   "outer_optimizer": {"name": "sgd", "learning_rate": 0.5}})
    h.moved(0, 1.0, 2)
    h.switch(name="bsp")
    assert h.core.spec.name == "bsp" and not h.core.spec.local
    before = h.params.copy()
    held = [h.moved(w, 1.0, 2, base=0) for w in (1, 2)]  # in flight from the local phase
    np.testing.assert_allclose(h.params, before - 2 * 0.5)  # each its own outer step at lr 0.5
    assert [a.outer for a in h.applied[1:]] == [OptimizerSpec(name="sgd", learning_rate=0.5)] * 2
    assert all(h.releases[i].outcome.applied and h.releases[i].order.local is None for i in held)
    h.moved(0, 1.0, 2)  # worker 0's order came before the switch: one more movement, alone
    for w in range(3):
        h.push(w, 1.0, samples=2)
    assert h.kinds()[-2:] == [("bsp", 1, True), ("bsp", 3, False)], "then one round of gradients"
    h.check_books()


def test_amb_with_local_steps_is_anytime_local_sgd():
    h = Outer(workers=2, protocol={"name": "amb", "time_budget_s": 1.0, "batch": 4})
    h.push(0, 1.0, samples=8)
    h.push(1, 1.0, samples=4)
    h.switch(local_steps=4)
    assert h.core.spec.name == "amb" and h.core.spec.local_steps == 4
    g = [h.push(w, 1.0, samples=4) for w in (0, 1)]  # ordered before the switch: gradients, each alone
    order = h.releases[g[0]].order
    assert order.local is not None and order.local.steps == 4 and order.time_budget_s == 1.0
    h.moved(0, 1.0, 2, batch=4)  # as many local steps as fit in T: two here, three there
    h.moved(1, 1.0, 3, batch=4)
    h.advance(1.0)
    assert h.kinds() == [("amb", 2, False), ("amb", 1, False), ("amb", 1, False), ("amb", 2, True)]
    assert h.applied[-1].aggregate.local_steps == 5 and h.applied[-1].aggregate.samples == 20
    h.check_books()


def test_the_batch_rule_scales_the_runs_optimizer_never_the_outer_step_which_staleness_damps():
    h = Outer(workers=4, protocol={"batch": 2})
    outer = OptimizerSpec(name="sgd", learning_rate=0.7)
    h.switch(name="async_diloco", local_steps=2, staleness_lr=True, outer_optimizer=outer)
    assert h.lr_scale == pytest.approx(0.25), "the linear rule, on the run's optimizer (gradients)"
    for w in (0, 1):
        h.push(w, 4.0, samples=2)  # ordered before the switch: gradients, at the run's scale
    np.testing.assert_allclose(h.params, -2 * 0.25 * 2.0)
    assert [a.outer for a in h.applied] == [None, None]
    before = h.params.copy()
    h.moved(0, 1.0, 2)
    h.moved(1, 1.0, 2, base=2)  # one update stale
    fresh, stale = h.applied[-2:]
    assert fresh.outer == stale.outer == outer
    np.testing.assert_allclose(h.params, before - 0.7 * 1.5)  # the spec's rate, times 1 and 1/2
    assert (fresh.lr_factor, stale.lr_factor) == (1.0, 0.5), "lr / (1 + staleness), not the batch rule's"
    h.check_books()


# ---- a worker whose loop cannot take local steps (a user's own) --------------------------------------------


def test_a_worker_that_cannot_take_local_steps_is_refused_at_registration_while_they_are_in_force(cluster_factory):
    c = cluster_factory(workers=2, size=4, protocol={"name": "local_sgd", "batch": 2, "local_steps": 2})
    user = c.workers[1].client
    with pytest.raises(grpc.RpcError) as err:
        user.register(1, c.layout, 100)  # as a user's own loop registers (local_steps False)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.details() == ("worker 1's training loop cannot take local steps, which the protocol in "
                                   "force (local_sgd) asks for")
    assert c.rec.rejections["register:local_steps"] == 1 and c.core.members.gradients_only == set()
    user.register(1, c.layout, 100, local_steps=True)
    gradients = cluster_factory(workers=1, size=4, protocol={"name": "asp"})
    gradients.workers[0].client.register(0, gradients.layout, 100)  # no local steps in force: taken
    assert gradients.core.members.gradients_only == {0}


def test_a_policys_switch_to_local_steps_is_rejected_while_a_worker_cannot_take_them():
    h = Harness(workers=2)
    h.run(h.core.register(1, 100, h.now, local_steps=False))  # worker 1 rejoins from a user's own loop
    h.run(h.core.decide(Decision("try local SGD", protocol="local_sgd"), "manual", h.now))
    assert h.core.spec.name == "bsp" and h.core.switching.pending is None
    (rejected,) = h.events("decision_rejected")
    assert rejected["error"] == "workers [1] cannot take local steps"
    restored = Harness(workers=2, start=False)  # a checkpoint keeps who cannot (an older one: nobody)
    restored.core.load_state_dict(h.core.state_dict(h.now), h.now)
    assert restored.core.members.gradients_only == {1}
    h.run(h.core.register(1, 100, h.now))  # back with the built-in loop
    h.push(0, 1.0)
    h.run(h.core.decide(Decision("try local SGD", protocol="local_sgd"), "manual", h.now))
    assert h.core.switching.pending is not None, "the switch waits for the round in flight"
    with pytest.raises(Rejected, match=r"the protocol switched to \(local_sgd\)"):
        h.core.check_register(1, 100, local_steps=False)  # as good as in force already
    h.push(1, 1.0)
    assert h.core.spec.name == "local_sgd" and len(h.events("decision_rejected")) == 1
