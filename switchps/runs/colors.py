"""Each protocol's colour, the same in every figure: a run's plots and a study's lanes."""

from __future__ import annotations

PROTOCOL_COLORS = {"bsp": "tab:blue", "fmb": "tab:purple", "amb": "tab:red", "asp": "tab:orange",
                   "ssp": "tab:green", "kasync": "tab:brown", "timed": "tab:pink", "backup": "tab:olive",
                   "local_sgd": "tab:cyan", "diloco": "tab:gray", "async_local_sgd": "teal",
                   "async_diloco": "black"}
"""One per name of ``switchps.names.PROTOCOLS``, in its order."""


def protocol_color(protocol: str) -> str:
    """``protocol``'s colour (grey for a name that is none of them)."""
    return PROTOCOL_COLORS.get(protocol, "grey")
