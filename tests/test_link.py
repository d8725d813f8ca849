"""The emulated PS link: fair-sharing arithmetic, and what BSP and ASP pay for it on a real PS."""

from __future__ import annotations

import numpy as np

from switchps.ps_server.link import DuplexLink, Link

pytest_plugins = ["cluster"]  # cluster_factory: a PS on loopback

G = np.float32


def test_transfers_in_flight_share_the_link_equally():
    link = Link(bytes_per_s=1000.0)
    a, b = link.admit(1000, now=0.0), link.admit(1000, now=0.0)
    assert link.finish_time(a) == link.finish_time(b) == 2.0, "two at once: each at half the rate"
    c = link.admit(500, now=0.5)  # a and b have 250 bytes each by now
    assert link.finish_time(c) == 2.0, "500 bytes at a third of the rate"
    assert link.finish_time(a) == 2.5, "then a and b share the link for their last 250 bytes each"
    link.advance(2.0)
    assert link.done(c) and not link.done(a)
    link.advance(3.0)
    assert link.done(a) and link.done(b)
    assert link.busy_s == 2.5 and link.transfers == 3
    d = link.admit(1000, now=10.0)
    assert link.finish_time(d) == 11.0, "an idle link carries a transfer at the full rate"


def test_duplex_link_summary_reports_each_direction():
    link = DuplexLink(mbit_s=8.0)  # 1e6 bytes/s
    link.inbound.admit(500_000, now=0.0)
    link.inbound.advance(1.0)
    s = link.summary(wall_s=2.0)
    assert s["inbound_utilization"] == 0.25 and s["outbound_utilization"] == 0.0


def test_bsp_round_shares_the_link_among_its_replies(cluster_factory):
    size = 25_000  # 100 kB: 0.2 s per transfer at 4 Mbit/s
    per_transfer = size * 4 / (4e6 / 8)
    c = cluster_factory(workers=3, size=size, link_mbit_s=4.0)
    link = c.ps.link
    assert link.outbound.transfers == 3, "each worker's first pull crosses the link"
    before = link.outbound.delay_s
    pending = [w.push_async(np.ones(size, G), 1) for w in c.workers]
    for p in pending:
        assert p.result().reply.applied
    assert link.inbound.transfers == 3 and link.outbound.transfers == 6
    # The round releases all three replies at once; sharing the link, each takes about three transfer
    # times instead of one.
    assert link.outbound.delay_s - before > 3 * per_transfer
    np.testing.assert_array_equal(c.workers[0].params, c.params)


def test_asp_push_alone_finds_the_link_idle_and_evaluator_pulls_are_free(cluster_factory):
    size = 25_000
    per_transfer = size * 4 / (4e6 / 8)
    c = cluster_factory(workers=2, size=size, protocol={"name": "asp"}, link_mbit_s=4.0)
    link = c.ps.link
    delays = link.inbound.delay_s, link.outbound.delay_s
    w = c.workers[0]
    for _ in range(2):
        w.push(np.ones(size, G), 1)
    assert link.inbound.transfers == 2 and link.outbound.transfers == 2 + 2
    assert link.inbound.delay_s - delays[0] < per_transfer and link.outbound.delay_s - delays[1] < per_transfer, \
        "sequential pushes have the link to themselves"
    transfers = link.outbound.transfers
    w.client.pull(np.empty(size, G))  # worker=-1: the evaluator, outside the emulated cluster
    assert link.outbound.transfers == transfers
