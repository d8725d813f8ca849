"""What the packaged studies share: digits with emulated workers, and config merging."""

from __future__ import annotations

from typing import Any

MOMENTUM = 0.9


MLP = {"name": "mlp", "kwargs": {"hidden": [64]}}


def emulated_digits(seed: int, workers: int, samples_per_s: float, out: str, lr: float, train: dict[str, Any],
                    model: dict[str, Any] = MLP, **sections: dict[str, Any]) -> dict[str, Any]:
    """The config every packaged study starts from: a model (an MLP unless given) on digits with emulated workers."""
    return merge({
        "seed": seed, "cluster": {"workers": workers}, "model": model,
        "data": {"name": "digits"}, "optimizer": {"name": "momentum", "learning_rate": lr, "params": {"momentum": MOMENTUM}},
        "train": train,
        "eval": {"every_s": 1.0}, "output": {"dir": out}, "device": {"samples_per_s": samples_per_s},
    }, sections)


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
