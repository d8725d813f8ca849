"""The outer optimizers of local steps (issue 46): one per distinct outer ``OptimizerSpec``, each with state of
its own, kept across switches.

A push under local steps carries what the worker's copy moved (``samples * (theta_start - theta_end)``), so
an aggregate of such pushes is a pseudo-gradient that the outer optimizer of the protocol in force steps by
(``actions.Apply.outer``); a gradient always goes to the run's optimizer. Two protocols naming the same outer
spec share its optimizer (keyed by the spec's canonical JSON), so a switch from ``diloco`` to
``async_diloco`` and back keeps its Nesterov momentum, while the run's ``SetOptimizer`` (the batch rule's lr
scale, a momentum or state change on a switch) never touches an outer optimizer. An outer optimizer's
learning rate is its spec's, on its spec's schedule counting its own updates (``Optimizer.iterations``), times
the update's ``lr_factor`` (staleness damping, the switch ramp).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from switchps.config.optimizer import OptimizerSpec
from switchps.optim.optimizers import Optimizer, optimizer_factory


def key_of(spec: OptimizerSpec) -> str:
    """The spec's canonical JSON: the same spec, however written, is the same optimizer."""
    return json.dumps(spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


class OuterOptimizers:
    """The outer optimizers made so far, for a model of ``size`` trainable values (``variables``: their
    variables' sizes, per-variable clipping's boundaries; None: one variable); not thread-safe (the store's
    writer, or the simulator, is their one user)."""

    def __init__(self, size: int = 0, variables: Sequence[int] | None = None) -> None:
        self.size = size
        self.variables = variables
        self.made: dict[str, Optimizer] = {}

    def get(self, spec: OptimizerSpec) -> Optimizer:
        """The optimizer of ``spec``, made on first use with fresh state."""
        key = key_of(spec)
        if key not in self.made:
            self.made[key] = optimizer_factory(spec)(self.size)
            if self.variables is not None:
                self.made[key].set_variables(self.variables)
        return self.made[key]

    def state_dict(self, copy: bool = True) -> dict[str, dict]:
        """Checkpoint: each optimizer's ``state_dict``, keyed by its spec's canonical JSON."""
        return {key: opt.state_dict(copy) for key, opt in self.made.items()}

    def load_state_dict(self, d: dict[str, dict]) -> None:
        """Restore a ``state_dict`` (an older checkpoint has none: ``{}``), replacing what was made."""
        self.made = {}
        for key, state in d.items():
            self.get(OptimizerSpec.model_validate_json(key)).load_state_dict(state)
