"""The names a run config may give, held below both the config and the roles that implement them.

Config checks a name against these tuples without importing the code that builds the thing, so
validating a config loads no role. Each implementation keeps its own registry (``ps_server.protocols
.PROTOCOLS``, ``optim.optimizers.OPTIMIZERS``, ``optim.schedules.SCHEDULES``); ``tests/
test_layers.py`` checks that every registry's keys are these names, in this order, so they cannot drift.
"""

PROTOCOLS: tuple[str, ...] = ("bsp", "fmb", "amb", "asp", "ssp", "kasync", "timed", "backup", "local_sgd", "diloco",
                              "async_local_sgd", "async_diloco")
"""Synchronization protocols; the order is also the protocol's index on TensorBoard."""
OPTIMIZERS: tuple[str, ...] = ("sgd", "momentum", "nesterov", "rmsprop", "adam", "adagrad", "adamw")
SCHEDULES: tuple[str, ...] = ("constant", "step", "exponential", "cosine")
"""Learning-rate schedule kinds."""
DATASETS: tuple[str, ...] = ("digits", "synthetic", "mnist", "fashion_mnist", "cifar10", "cifar100", "npz")
