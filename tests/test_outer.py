"""Outer optimizers (issue 46): an aggregate of pushed movements is stepped by the outer optimizer its
``Apply.outer`` names, with state of its own that switches, the run's optimizer changes and checkpoints keep."""

from __future__ import annotations

import numpy as np

from switchps.config.optimizer import OptimizerSpec
from switchps.protos.layout import make_layout
from switchps.ps_server import checkpoint
from switchps.ps_server.checkpointer import Parts, restore, where_applied
from switchps.ps_server.outer import key_of
from switchps.ps_server.shard.checkpoint import capture, file_digest, restore_part
from switchps.ps_server.store import ModelStore
from switchps.optim.optimizers import adjust_optimizer, make_optimizer
from switchps.optim.schedules import make_schedule

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
