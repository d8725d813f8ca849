"""Emulated hardware for studies on a small machine: a device's speed and the PS's network link."""

from __future__ import annotations

from pydantic import Field

from switchps.config.schema import Section


class DeviceSpec(Section):
    samples_per_s: float | None = Field(None, gt=0)
    """Emulate a device of this speed: each micro-batch takes micro_batch / samples_per_s seconds
    (never less than the real compute), so studies with many workers run honestly on 2 cores."""


class NetworkSpec(Section):
    ps_link_mbit_s: float | None = Field(None, gt=0)
    """Emulate the PS's network link at this rate (full duplex): workers' pushes share its inbound side
    and the parameters sent back its outbound side, so a BSP round's N simultaneous transfers take N
    times as long as one. Loopback alone makes communication nearly free."""
    push_overhead_s: float = Field(0.0, ge=0, le=60)
    """A simulation only: seconds each push costs beyond the link model (serialization, the RPC, the PS's
    work), added to its way in; a real run pays its own. Fit it from a real run with
    `python bench/sim_vs_real.py fit REAL_STUDY_DIR`."""
    push_jitter_s: float = Field(0.0, ge=0, le=60)
    """A simulation only: the mean of an exponential delay added to each push on top of
    ``push_overhead_s``, drawn per (seed, worker, step): the scheduling and RPC noise that keeps real
    workers out of lockstep. Fitted with ``push_overhead_s``."""
