"""The PS binds first, then publishes its address (RUN_DIR/ps.address): `switchps ps` with port 0, its
restart on the same port, and on another when that one is taken; `switchps status` finds it there."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import pytest

from switchps.address import Stamp, published_since, split, stamp
from switchps.worker.client import PSClient, wait_for_ps

from test_launch import CONFIGS, SWITCHPS

pytestmark = pytest.mark.integration


def published_address(run_dir: Path, ps: subprocess.Popen, before: Stamp | None = None,
                      timeout_s: float = 60) -> str:
    """The address ``ps`` publishes in ``run_dir`` (a publication newer than ``before``)."""
    deadline = time.monotonic() + timeout_s
    while (address := published_since(run_dir, before)) is None:
        assert ps.poll() is None, f"the PS exited with code {ps.returncode}"
        assert time.monotonic() < deadline, "the PS published no address"
        time.sleep(0.05)
    return address


def serves(address: str) -> bool:
    wait_for_ps(address, 30)
    client = PSClient(address, timeout_s=5)
    try:
        return client.status().version == 0
    finally:
        client.close()


def test_a_ps_on_port_0_publishes_its_port_and_comes_back_on_it(tmp_path, processes):
    cfg = tmp_path / "ps.yaml"
    cfg.write_text("cluster: {ps: '127.0.0.1:0', workers: 1, startup_timeout_s: 60}\nsecurity: {insecure: true}\n")
    run_dir = tmp_path / "run"

    def start_ps(*args: str) -> subprocess.Popen:
        return processes([SWITCHPS, "ps", str(cfg), *args], cwd=tmp_path, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)

    def kill(ps: subprocess.Popen) -> Stamp | None:
        ps.kill()
        ps.wait(10)
        return stamp(run_dir)

    ps = start_ps("--run-dir", str(run_dir))
    address = published_address(run_dir, ps)
    host, port = split(address)
    assert host == "127.0.0.1" and port > 0 and serves(address)
    status = subprocess.run([SWITCHPS, "status", str(run_dir)], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0 and address in status.stdout, status.stderr

    before = kill(ps)  # restarted as `switchps run` restarts it: the clients' address still holds
    ps = start_ps("--resume", str(run_dir))
    assert published_address(run_dir, ps, before) == address and serves(address)

    before = kill(ps)
    with socket.socket() as squatter:  # another process took the port meanwhile: the PS binds another
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the port may have TIME_WAITs
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        ps = start_ps("--resume", str(run_dir))
        moved = published_address(run_dir, ps, before)
        assert split(moved)[0] == "127.0.0.1" and split(moved)[1] not in (0, port) and serves(moved)


def test_worker_and_evaluator_refuse_a_ps_address_without_a_port(tmp_path):
    for role in (["worker", "--index", "0"], ["evaluator"]):
        proc = subprocess.run([SWITCHPS, role[0], str(CONFIGS / "asp.yaml"), *role[1:], "--ps", "127.0.0.1:0"],
                              capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert proc.returncode == 2 and "--ps: expected HOST:PORT with a port from 1 to 65535" in proc.stderr
