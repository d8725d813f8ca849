"""``bench/transport.py`` for real, at 1 MB: every variant's transfers are checked by the benchmark itself
(an echo of the bytes sent, a push applied with the next version's values), and every figure it prints
is its medians' quotient."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
VARIANTS = ("raw_default", "raw_tuned", "raw_aio_tuned", "switchps", "switchps_auth", "switchps_tls",
            "switchps_shared_memory")
RATIOS = {  # figure: (numerator, denominator), each a variant's median time
    "ratio_vs_stock_grpcio": ("raw_default", "switchps"),
    "ratio_vs_tuned_grpcio": ("raw_tuned", "switchps"),
    "tuned_grpcio_asyncio_over_threads": ("raw_aio_tuned", "raw_tuned"),
    "auth_time_ratio": ("switchps_auth", "switchps"),
    "tls_time_ratio": ("switchps_tls", "switchps"),
    "shared_memory_ratio_vs_tuned_grpcio": ("raw_tuned", "switchps_shared_memory"),
}


def _quotient(a: float, b: float, exact_a: bool = False) -> object:
    """``a / b`` as the benchmark prints it: a quotient of unrounded medians, rounded to 0.001, where the test
    sees the medians as printed, to 0.01 ms (``a`` too unless ``exact_a``); within what the roundings allow."""
    return pytest.approx(a / b, abs=a / b * ((0 if exact_a else 0.005 / a) + 0.005 / b) + 0.0005)


@pytest.mark.integration
def test_transport_checks_its_transfers_and_prints_its_medians_quotients(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    passes = importlib.import_module("transport").PS_PASSES
    out = subprocess.run([sys.executable, str(BENCH / "transport.py"), "--sizes-mb", "1", "--reps", "2",
                          "--blocks", "1"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    printed = json.loads(out.stdout, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
    assert printed["round_trips_per_variant"] == 2
    (r,) = printed["results"]
    ms = {v: r[f"{v}_median_ms"] for v in VARIANTS}
    assert all(t > 0 for t in ms.values()), ms
    for v in VARIANTS:  # 1 MiB up and 1 MiB back per round trip
        assert r[f"{v}_gb_s"] == _quotient(2 * 2**20 / 1e6, ms[v], exact_a=True), v
    for figure, (num, den) in RATIOS.items():
        assert r[figure] == _quotient(ms[num], ms[den]), figure
    assert r["client_copies_per_byte"] == 1.0, "the client copies the gradient into frames and the reply out, once each"
    assert set(r["passes_ms"]) == {*passes, "ps_copy_in"} and all(t > 0 for t in r["passes_ms"].values())
    estimate = ms["raw_tuned"] + sum(r["passes_ms"][k] for k in passes)  # the passes printed to 0.001 ms
    assert r["serial_estimate_ms"] == pytest.approx(estimate, abs=0.005 + 0.0005 * len(passes) + 0.005)
    assert r["switchps_over_estimate"] == _quotient(ms["switchps"], r["serial_estimate_ms"])
