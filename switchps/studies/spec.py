"""A study file: a base run config, named arms that override it, repeats, a target and the metrics.

```yaml
study: amb-vs-fmb
base: {...}                  # a run config, as in examples/*.yaml
arms:                        # run in this order in every repeat; the first records the straggler trace
  fmb: {protocol.name: fmb}  # overrides of the base, with the keys of --set
  amb: {protocol.name: amb, protocol.time_budget_s: 1.6}
repeats: 3                   # seeds base.seed, base.seed + 1, ...
reference: fmb               # ratios are against this arm, paired by seed
target: {absolute: 0.9}      # or {reference_minus_points: 0.5}: the reference's final accuracy minus 0.5
final_evals: 5               # "final accuracy" is the mean of the last n evaluations
metrics: [time_to_target_s, final_accuracy, samples_per_s]
mode: run                    # or simulate: every run on a virtual clock (`switchps simulate`)
simulation:                  # in simulation only: keys of --set on the base, before the user's --set
  set: {network.push_overhead_s: 0.006765, network.push_jitter_s: 0.007017}
  source: fitted by `python bench/sim_vs_real.py fit ...`   # where the values come from (in study.json)
sweep: {cluster.workers: [8, 64], train.seconds: [60, 30]}  # optional: the whole study once per column
                             # of values (OUT/cluster.workers=8/, ...), the first key naming it
```
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from switchps.checks import PREFLIGHT
from switchps.config.run import ConfigError, RunConfig, Section, parse_config
from switchps.problems import describe
from switchps.yamlfile import apply_override, read_yaml

METRICS = {
    "time_to_target_s": "time to the target (s)",
    "epochs_to_target": "epochs to the target",
    "final_accuracy": "final accuracy",
    "samples_per_s": "samples/s",
    "worker_utilization": "worker utilization",
    "seconds_per_update": "s / update",
    "samples_per_worker_step": "samples / worker-step",
    "switches": "switches",
    "switch_overhead_s": "switch overhead (s)",
    "total_time_s": "total time (s)",
    "updates": "updates",
    "bytes_sent": "bytes sent",
    "dip_points": "dip after the switch (points)",
    "recovery_s": "recovery after the switch (s)",
}
"""Every metric a study may report, with its column title (computed by ``studies.metrics``)."""
RATIO_METRICS = {"time_to_target_s": "speedup to the target", "total_time_s": "speedup in total time",
                 "bytes_sent": "fewer bytes sent"}
"""Metrics also reported as the reference's value over the arm's, paired by seed (higher is faster, or for
bytes sent, less)."""


class Target(Section):
    absolute: float | None = Field(None, gt=0, le=1)
    reference_minus_points: float | None = Field(None, ge=0, le=100)

    @model_validator(mode="after")
    def _one(self) -> "Target":
        if (self.absolute is None) == (self.reference_minus_points is None):
            raise ValueError("give exactly one of absolute and reference_minus_points")
        return self


class Simulation(Section):
    """What a study's runs take only in simulation: what the simulator cannot know of the real system,
    such as a real push's cost beyond the link model, fitted from real runs (``bench/sim_vs_real.py fit``).
    A real run pays its own, so a real study ignores this."""

    set: dict[str, Any] = Field(default_factory=dict)
    """Config keys (as in --set) and their values, applied to the base before the user's --set (which so
    wins), and before the arms' overrides."""
    source: str = ""
    """Where the values come from, e.g. the command that fitted them."""


class StudySpec(Section):
    study: str
    description: str = ""
    base: dict[str, Any]
    arms: dict[str, dict[str, Any]] = Field(min_length=1)
    repeats: int = Field(3, ge=1, le=100)
    reference: str | None = None
    compare_with: list[str] = Field(default_factory=list)
    """Further arms every arm is compared with, paired by seed (e.g. the offline hybrid)."""
    target: Target = Field(default_factory=lambda: Target(absolute=0.9))
    final_evals: int = Field(5, ge=1, le=1000)
    metrics: list[str] = Field(default_factory=lambda: ["time_to_target_s", "final_accuracy", "samples_per_s"])
    smooth_evals: int = Field(5, ge=1, le=1000)
    """Time to target uses the trailing mean of this many evaluations (one digits evaluation moves by a point)."""
    mode: Literal["run", "simulate"] = "run"
    """run: real processes (`switchps run`); simulate: on a virtual clock (`switchps simulate`)."""
    simulation: Simulation = Field(default_factory=Simulation)
    sweep: dict[str, list[Any]] | None = None
    """Config keys (as in --set) and their values, lists of one length: the whole study runs once per
    position, with every key set to its value there; the first key names the point and is the x axis.
    ``arms.ARM.KEY`` sets one arm's field (e.g. the backup workers, as a share of the workers)."""

    @model_validator(mode="after")
    def _consistent(self) -> "StudySpec":
        unknown = [m for m in self.metrics if m not in METRICS]
        if unknown:
            raise ValueError(f"unknown metric(s) {unknown}; choose from {sorted(METRICS)}")
        if self.reference is not None and self.reference not in self.arms:
            raise ValueError(f"reference {self.reference!r} is not an arm ({', '.join(self.arms)})")
        missing = [a for a in self.compare_with if a not in self.arms]
        if missing:
            raise ValueError(f"compare_with names no arm: {missing}")
        if self.target.reference_minus_points is not None and self.reference is None:
            raise ValueError("target.reference_minus_points needs a reference arm")
        if self.sweep is not None and (not self.sweep or len({len(v) for v in self.sweep.values()}) != 1
                                       or not next(iter(self.sweep.values()))):
            raise ValueError("sweep: give config keys with non-empty lists of values, all of one length")
        bad = [k for k in self.sweep or {} if k.startswith("arms.") and (arm_field(k)[0] not in self.arms
                                                                        or not arm_field(k)[1])]
        if bad:
            raise ValueError(f"sweep: {bad} name no arm's field (arms.ARM.KEY)")
        if self.sweep and next(iter(self.sweep)).startswith("arms."):
            raise ValueError("sweep: the first key names the points and is the base's (e.g. cluster.workers)")
        return self

    def points(self) -> list[tuple[str, "StudySpec"]]:
        """The studies a sweep makes (``KEY=VALUE`` of its first key, and the study with the base so set),
        or this one alone."""
        if self.sweep is None:
            return [("", self)]
        out = []
        for column in zip(*self.sweep.values()):
            base, arms = json.loads(json.dumps(self.base)), json.loads(json.dumps(self.arms))
            for key, v in zip(self.sweep, column):
                if key.startswith("arms."):
                    arm, field = arm_field(key)
                    if arm in arms:  # not left out by --arms
                        arms[arm][field] = v
                else:
                    apply_override(base, f"{key}={json.dumps(v)}")
            point = f"{next(iter(self.sweep))}={column[0]}"
            out.append((point, self.model_copy(update={"base": base, "arms": arms, "sweep": None})))
        return out

    def run_config(self, arm: str, repeat: int, out: Path, trace: Path | None) -> RunConfig:
        """The config of ``arm`` in ``repeat``: the base, the arm's overrides, the repeat's seed, and the
        straggler trace recorded by the repeat's first arm (if any)."""
        raw = json.loads(json.dumps(self.base))
        raw["seed"] = int(raw.get("seed", 0)) + repeat
        raw["name"] = arm
        raw.setdefault("output", {})["dir"] = str(out)
        overrides = [f"{key}={json.dumps(value)}" for key, value in self.arms[arm].items()]
        if trace is not None:
            overrides.append("stragglers=" + json.dumps({"trace": str(trace)}))
        cfg = parse_config(raw, overrides, role="simulate" if self.mode == "simulate" else None, checks=PREFLIGHT)
        if self.mode == "simulate":
            from switchps.sim.run import check

            check(cfg, time_only=False)
        return cfg


def arm_field(key: str) -> tuple[str, str]:
    """A sweep key ``arms.ARM.KEY``'s arm and field (the field empty if it names none)."""
    arm, _, field = key.removeprefix("arms.").partition(".")
    return arm, field


def load_study(path: Path, overrides: Sequence[str] = (), simulate: bool = False) -> StudySpec:
    """A study file, checked whole: the spec, then every arm's run config at every sweep value (one line
    per problem). ``simulate``: in simulation whatever the file's ``mode``; a simulated study's base
    takes ``simulation.set``, then ``overrides`` (--set)."""
    raw = read_yaml(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a study file is a mapping (study, base, arms, ...)")
    if simulate:
        raw["mode"] = "simulate"
    try:
        spec = StudySpec.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(*describe(err, raw, StudySpec)) from None
    settings = [f"{k}={json.dumps(v)}" for k, v in spec.simulation.set.items()] if spec.mode == "simulate" else []
    for o in [*settings, *overrides]:
        apply_override(spec.base, o)
    problems: list[str] = []
    for point, study in spec.points():
        for arm in study.arms:
            try:
                study.run_config(arm, 0, Path("runs"), None)
            except ConfigError as e:
                where = f"sweep {point}: arms.{arm}" if point else f"arms.{arm}"
                problems += [f"{where}: {p}" for p in e.problems]
    if problems:
        raise ConfigError(*problems)
    return spec
