"""What a resumed run may change in its config, and the check that refuses the rest before anything starts.

A checkpoint holds a model's parameters, the optimizer state that goes with them, and a position in
training over one data set split one way between N workers. A config that changes any of those would
start a PS that fails later (a layout or optimizer-state mismatch) or, worse, trains on quietly: a
different data split, a different seed. ``REFUSED`` names those fields; every other field is in
``ALLOWED`` and may change between a crash and its resume (``test_preflight`` checks that each field
of the schema is in exactly one of them). The config the checkpoint was made with is the one saved in
the checkpoint itself (``Checkpointer``), or, for a checkpoint older than that, the run directory's
``config.yaml``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from switchps.problems import ConfigError
from switchps.optim.optimizers import OPTIMIZERS
from switchps.yamlfile import read_yaml

if TYPE_CHECKING:
    from switchps.config.run import RunConfig
    from switchps.ps_server.checkpoint import Checkpoint

REFUSED: dict[str, str] = {
    "seed": "it seeds the data split, the initial weights and each worker's sampling",
    "cluster.workers": "worker i trains on every N-th sample (data.sampling: partition)",
    "model": "the checkpoint holds this model's parameters",
    "data": "the run's position and split are in this data set",
    "optimizer.name": "the checkpoint holds this optimizer's state",
    "optimizer.params": "the checkpoint restores its own hyper-parameters, and the state they shape",
}
"""Fields (and sections, by prefix) a resume must keep as they were, each with the reason.
``cluster.workers`` is compared as a count (a list of hosts may replace a number, and hosts may move), and only
under ``partition`` sampling: drawing with replacement, a resume may change the count or the elastic bounds (the
checkpoint's members at indices the new bound excludes have left; an elastic run's N is its members).
``optimizer.params`` are compared with the optimizer's defaults filled in, and only when the name is
unchanged (a changed name is the one line reported)."""

ALLOWED: tuple[str, ...] = (
    "name", "cluster.ps", "cluster.bind", "cluster.startup_timeout_s", "cluster.reconnect_s", "cluster.leave_after_s",
    "cluster.lease_s", "cluster.max_restarts", "cluster.ray", "optimizer.learning_rate", "optimizer.schedule",
    "optimizer.clip_norm", "optimizer.global_clip_norm", "protocol", "train", "eval",
    "output", "runtime", "device", "network", "stragglers", "policy", "checkpoint", "security", "churn",
)
"""Fields a resume may change: how the run is driven, not what it trains. The protocol and policy state
in force at the checkpoint are restored from it (a policy may have switched the protocol)."""


def refuse_incompatible(run_dir: Path, ckpt: Checkpoint, cfg: RunConfig) -> None:
    """Raise ``ConfigError`` with one line per field in ``REFUSED`` that ``cfg`` changes."""
    saved = ckpt.state.get("config")
    if saved is None:
        saved = read_yaml(run_dir / "config.yaml")
    if problems := resume_problems(saved, cfg.model_dump(mode="json")):
        raise ConfigError(*problems)


def resume_problems(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """One line per refused field whose value differs between the ``saved`` and ``now`` config dumps."""
    before, after = _leaves(_comparable(saved, now)), _leaves(_comparable(now, saved))
    lines = []
    for path in dict.fromkeys([*before, *after]):
        rule = next((p for p in REFUSED if path == p or path.startswith(p + ".")), None)
        if rule is not None and before.get(path, _UNSET) != after.get(path, _UNSET):
            lines.append(f"{path}: the checkpoint was made with {_shown(before.get(path, _UNSET))}, this config "
                         f"says {_shown(after.get(path, _UNSET))}; a resume cannot change it ({REFUSED[rule]})")
    return lines


_UNSET = object()


def _comparable(cfg: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with the worker count for ``cluster.workers`` and the optimizer's defaults in its params
    (dropped when ``other`` names another optimizer)."""
    out = {**cfg, "cluster": dict(cfg.get("cluster", {})), "optimizer": dict(cfg.get("optimizer", {}))}
    workers = out["cluster"].get("workers")
    if isinstance(workers, list):
        out["cluster"]["workers"] = len(workers)
    if cfg.get("data", {}).get("sampling") == other.get("data", {}).get("sampling") == "replacement":
        out["cluster"].pop("workers", None)  # every worker draws from the whole set, whoever is in
    opt, other_opt = out["optimizer"], other.get("optimizer", {})
    if opt.get("name") != other_opt.get("name"):
        opt.pop("params", None)
    elif opt.get("name") in OPTIMIZERS:
        opt["params"] = OPTIMIZERS[opt["name"]].defaults | opt.get("params", {})
    return out


def _leaves(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted path -> value for every non-mapping value in ``d``."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        path = f"{prefix}{key}"
        out |= _leaves(value, path + ".") if isinstance(value, dict) else {path: value}
    return out


def _shown(value: Any) -> str:
    return "nothing" if value is _UNSET else repr(value)
