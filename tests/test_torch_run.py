"""`model.framework: torch` end to end: the quickstart trains torch workers on digits, its model file loads
in plain torch and scores the same, `switchps export` writes it again; a TF worker and a torch worker in one
run are refused at registration, naming both frameworks."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

pytest_plugins = ["cluster"]  # cluster_factory: a PS on loopback


def test_a_second_framework_is_refused_at_registration_naming_both(cluster_factory):
    """The fake workers registered as an older client does (no framework): the first one to name its
    framework sets the run's; another framework is refused (FAILED_PRECONDITION, counted, nothing changed),
    never as a layout's digest, and a client that names none is still judged by its layout."""
    from switchps.protos.layout import make_layout

    c = cluster_factory(workers=2, size=4, protocol={"name": "asp"})
    tf, torch = (w.client for w in c.workers)
    assert c.ps.framework == ""
    tf.register(0, c.layout, 100, framework="tensorflow", device="cpu")
    with pytest.raises(grpc.RpcError) as err:
        torch.register(1, make_layout([("fc.weight", (2, 2))]), 100, framework="torch", device="cuda:0")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.details() == ("worker 1 runs model.framework torch, the PS's workers tensorflow: "
                                   "one framework per run (the same on every worker)")
    assert (c.ps.framework, c.ps.devices, c.ps.layout) == ("tensorflow", {"cpu"}, c.layout)
    assert c.rec.rejections["register:framework"] == 1
    assert [e["reason"] for e in c.events("register_rejected")] == ["framework"]
    with pytest.raises(grpc.RpcError) as err:
        torch.register(1, make_layout([("fc.weight", (2, 2))]), 100)
    assert "its model layout differs" in err.value.details()
    torch.register(1, c.layout, 100, framework="tensorflow", device="cpu")
    assert c.workers[1].push(np.ones(4, np.float32), 2).reply.applied
