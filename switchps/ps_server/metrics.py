"""The PS's Prometheus series (``runtime.metrics_port``), read from its state when they are scraped.

Each PS process serves its own registry: shard 0 (or an unsharded PS) the run's series (``RunSeries``),
a follower shard those of its part (``ShardSeries``), on ``metrics_port + K`` for shard K, so that the shards
of one PS on one host never ask for the same port (``serve``). A scrape reads the state the PS keeps anyway
(the core's membership and version, the refusal counts, the bytes of payloads) plus what the push path
notes in ``Tally``: a few attribute updates per push, no lock and no label lookup, so that metrics cost the
push path nothing measurable. The scrape runs on the HTTP server's thread while the event loop changes that
state: it copies each set and dict in one call (atomic under the GIL: their keys are ints and strings), so a
scrape never sees one half-changed, though two series of one scrape may straddle an event.

Every series is listed, with its type, labels and meaning, in docs/metrics.md (a test checks that the list
and the endpoint agree).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from switchps.ps_server.core.actions import Apply
from switchps.ps_server.core.aggregation import required
from switchps.ps_server.core.machine import Core

log = logging.getLogger("switchps.ps")
STATES = ("active", "inactive", "excluded")
"""A worker's state as the PS knows it: ``active``; ``inactive`` (it missed a deadline: slow or gone, until its
next push); ``excluded`` by a policy (elastic), out of the barrier."""


@dataclass
class WorkerTally:
    """One worker's pushes as the PS took them in (a retried push counts once, as in workers.csv)."""

    pushes: int = 0
    samples: int = 0
    step_s: float = 0.0
    """The compute seconds of its last push's step, as its push reported them."""
    staleness: int = 0
    last_push: float | None = None


@dataclass
class LastUpdate:
    """The update applied last, noted by the applier (``Tally.applied``)."""

    pushes: int
    lr: float
    wait_s: float
    at: float


@dataclass
class Tally:
    """What the push path and the applier note for the series (plain attributes; ``RunSeries`` reads them)."""

    clock: Callable[[], float] = time.monotonic
    workers: dict[int, WorkerTally] = field(default_factory=dict)
    outcomes: Counter[str] = field(default_factory=Counter)
    """Pushes answered: ``applied`` or ``dropped``."""
    updates: int = 0
    last: LastUpdate | None = None
    born: float = field(init=False)
    """When this PS process began (a resumed run's training started before it)."""

    def __post_init__(self) -> None:
        self.born = self.clock()

    def pushed(self, worker: int, samples: int, step_s: float, staleness: int, at: float) -> None:
        w = self.workers.get(worker)
        if w is None:
            w = self.workers[worker] = WorkerTally()
        w.pushes += 1
        w.samples += samples
        w.step_s, w.staleness, w.last_push = step_s, staleness, at

    def applied(self, a: Apply, lr: float) -> None:
        """Update ``a`` was applied at rate ``lr`` (on the applier's thread: one assignment publishes it)."""
        self.last = LastUpdate(len(a.aggregate.members), lr, a.wait_s, self.clock())
        self.updates += 1


def traffic(t: Counter[str]) -> Iterator[Metric]:
    """Payload bytes received and sent, by transport: ``grpc`` bytes, or a ``shared``-memory segment (a worker on
    the PS's host). ``t``: the ``in``, ``out`` (all) and ``in_shared``, ``out_shared`` counts the PS keeps."""
    t = Counter(dict(t))
    for way, name, doc in (("in", "switchps_received_bytes", "Payload bytes received: pushes, initial values"),
                           ("out", "switchps_sent_bytes", "Payload bytes sent: replies' and pulls' values")):
        c = CounterMetricFamily(name, doc, labels=["transport"])
        c.add_metric(["grpc"], t[way] - t[f"{way}_shared"])
        c.add_metric(["shared"], t[f"{way}_shared"])
        yield c


def refusals(counts: Counter[str]) -> CounterMetricFamily:
    """Refused calls by RPC and reason (``rejections.RejectionCounter``'s ``rpc:reason`` counts)."""
    c = CounterMetricFamily("switchps_refusals", "Calls refused, by RPC and reason", labels=["rpc", "reason"])
    for kind, n in sorted(dict(counts).items()):
        rpc, _, reason = kind.partition(":")
        c.add_metric([rpc, reason], n)
    return c


@dataclass(eq=False)  # a registry keys its collectors by identity
class RunSeries(Collector):
    """Shard 0's (or an unsharded PS's) series: the run's updates, workers, pushes, bytes and refusals."""

    core: Core
    tally: Tally
    traffic: Counter[str]
    rejections: Counter[str]
    """``rpc:reason`` counts of refused calls (the run record's)."""

    def collect(self) -> Iterator[Metric]:
        core, t, now = self.core, self.tally, self.tally.clock()
        yield GaugeMetricFamily("switchps_model_version", "Current model version", value=core.version)
        yield CounterMetricFamily("switchps_updates", "Updates applied by this PS process", t.updates)
        yield CounterMetricFamily("switchps_samples", "Samples in the updates applied", core.samples)
        protocol = GaugeMetricFamily("switchps_protocol", "The protocol in force (1)", labels=["name"])
        protocol.add_metric([core.spec.name], 1)
        yield protocol
        yield GaugeMetricFamily("switchps_workers_in_force",
                                "Workers the protocol's rule counts (active, not excluded)",
                                value=len(required(core.members)))
        yield GaugeMetricFamily("switchps_members", "N in force: the configured count, or an elastic run's "
                                                    "members", value=core.members.num_workers)
        yield GaugeMetricFamily("switchps_paused", "1 while an elastic run has fewer members than its min",
                                value=int(core.members.paused))
        started = None if core.started_at is None else max(core.started_at, t.born)
        yield from self._update(t.last, started, now)
        yield from self._workers(now)
        pushes = CounterMetricFamily("switchps_pushes", "Pushes by outcome", labels=["outcome"])
        for outcome, n in (("applied", t.outcomes["applied"]), ("dropped", t.outcomes["dropped"]),
                           ("rejected", sum(n for k, n in dict(self.rejections).items() if k.startswith("push:")))):
            pushes.add_metric([outcome], n)
        yield pushes
        yield from traffic(self.traffic)
        yield refusals(self.rejections)

    @staticmethod
    def _update(last: LastUpdate | None, started: float | None, now: float) -> Iterator[Metric]:
        """The last update's rate, wait and pushes, and the seconds since it (before this process's first: since
        ``started``, when training started or this process resumed it; before that, none: nothing is late yet)."""
        if last is not None:
            yield GaugeMetricFamily("switchps_learning_rate", "The learning rate the last update applied",
                                    value=last.lr)
            yield GaugeMetricFamily("switchps_update_wait_seconds",
                                    "How long the last update's aggregation waited (ps.csv's wait_s)",
                                    value=last.wait_s)
            yield GaugeMetricFamily("switchps_update_pushes", "Pushes aggregated into the last update",
                                    value=last.pushes)
        since = last.at if last is not None else started
        if since is not None:
            yield GaugeMetricFamily("switchps_seconds_since_update",
                                    "Seconds since the last update was applied (or since training started)",
                                    value=now - since)

    def _workers(self, now: float) -> Iterator[Metric]:
        m = self.core.members
        active, excluded = frozenset(m.active), frozenset(m.excluded)
        tallies = dict(self.tally.workers)
        workers = sorted(set(m.registered) | tallies.keys())
        families = [(kind(f"switchps_worker_{name}", f"The worker's {what}, as its pushes told the PS",
                          labels=["worker"]), read)
                    for name, kind, what, read in (
                        ("pushes", CounterMetricFamily, "pushes", lambda w: w.pushes),
                        ("samples", CounterMetricFamily, "samples pushed", lambda w: w.samples),
                        ("step_seconds", GaugeMetricFamily, "compute seconds of its last step", lambda w: w.step_s),
                        ("staleness", GaugeMetricFamily, "staleness of its last push", lambda w: w.staleness))]
        since = GaugeMetricFamily("switchps_worker_seconds_since_push", "Seconds since the worker's last push",
                                  labels=["worker"])
        state = GaugeMetricFamily("switchps_worker_state", "The worker's state (1 on the one it is in)",
                                  labels=["worker", "state"])
        for w in workers:
            tally, label = tallies.get(w, WorkerTally()), str(w)
            for family, read in families:
                family.add_metric([label], read(tally))
            if tally.last_push is not None:
                since.add_metric([label], now - tally.last_push)
            now_in = "excluded" if w in excluded else "active" if w in active else "inactive"
            for s in STATES:
                state.add_metric([label, s], float(s == now_in))
        yield from (family for family, _ in families)
        yield since
        yield state


@dataclass(eq=False)
class ShardSeries(Collector):
    """A follower shard's series: its part's version, bytes and refusals."""

    version: Callable[[], int]
    traffic: Counter[str]
    rejections: Counter[str]

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("switchps_model_version", "Current model version", value=self.version())
        yield from traffic(self.traffic)
        yield refusals(self.rejections)


def registry(*collectors: Collector) -> CollectorRegistry:
    """A PS process's own registry: ``collectors``, and the process's CPU, memory, threads and GC."""
    reg = CollectorRegistry()
    for c in collectors:
        reg.register(c)
    for standard in (ProcessCollector, PlatformCollector, GCCollector):
        standard(registry=reg)
    return reg


def port_of(metrics_port: int, shard: int) -> int:
    """Where shard ``shard`` serves its series: ``metrics_port + shard`` (0: a port the OS picks, each its own)."""
    return metrics_port + shard if metrics_port else 0


def serve(reg: CollectorRegistry, metrics_port: int, shard: int = 0) -> WSGIServer:
    """Serve ``reg`` over HTTP on every interface at ``port_of(metrics_port, shard)``; ``OSError`` if taken.
    The caller stops it (``stop``)."""
    server, _ = start_http_server(port_of(metrics_port, shard), registry=reg)
    log.info("PS shard %d serving Prometheus metrics on port %d", shard, server.server_port)
    return server


def stop(server: WSGIServer) -> None:
    """Stop serving and free the port."""
    server.shutdown()
    server.server_close()
