"""CPU binding of a one-host run's roles: which cores and niceness each role gets (no I/O), the binding as a
real process applies it (its threads inherit it), and the local backend handing it to the named roles only."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from switchps.launch.backends import LocalBackend, RoleSpec
from switchps.config.run import load_config
from switchps.config.cpu_binding import ENV, CpuBinding, CpuBindingSpec, local_bindings
from switchps.launch.launcher import local_backend

from test_launch import CONFIGS


def test_each_worker_gets_its_own_block_of_cores_when_all_fit():
    b = local_bindings(2, 1, CpuBindingSpec(), [1, 0])
    assert b == {"worker-0": CpuBinding((0,), 5), "worker-1": CpuBinding((1,), 5), "evaluator": CpuBinding((), 5)}
    two_threads = local_bindings(2, 2, CpuBindingSpec(worker_nice=0), [0, 1, 2, 3, 4])
    assert two_threads["worker-0"] == CpuBinding((0, 1), 0) and two_threads["worker-1"] == CpuBinding((2, 3), 0)
    assert "ps" not in b, "the PS floats at the launcher's priority"


def test_workers_that_would_share_a_core_float_and_pinning_can_be_turned_off():
    assert {v.cores for v in local_bindings(3, 1, CpuBindingSpec(), [0, 1]).values()} == {()}
    assert {v.cores for v in local_bindings(2, 2, CpuBindingSpec(), [0, 1, 2]).values()} == {()}
    off = local_bindings(2, 1, CpuBindingSpec(pin_workers=False), [0, 1])
    assert off["worker-0"] == off["worker-1"] == CpuBinding((), 5)


def test_a_binding_crosses_the_environment_whole_and_anything_else_is_refused():
    b = CpuBinding((0, 3), 7)
    assert CpuBinding.from_env(b.to_env()) == b
    for bad in ("", "{", "[]", "{}", '{"cores": [0]}', '{"cores": [-1], "nice": 5}', '{"cores": [0], "nice": 20}',
                '{"cores": ["0"], "nice": 5}', '{"cores": [0], "nice": 5, "x": 1}', '{"cores": [0], "nice": true}'):
        with pytest.raises(ValueError, match=ENV):
            CpuBinding.from_env(bad)


PROBE = """
import json, os, threading
from switchps.config.cpu_binding import apply_env
apply_env()
seen = {}
def probe():
    tid = threading.get_native_id()
    seen["thread"] = [sorted(os.sched_getaffinity(tid)), os.getpriority(os.PRIO_PROCESS, tid)]
t = threading.Thread(target=probe)
t.start(); t.join()
seen["main"] = [sorted(os.sched_getaffinity(0)), os.getpriority(os.PRIO_PROCESS, 0)]
print(json.dumps(seen))
"""


def test_a_process_applies_its_binding_and_the_threads_it_starts_inherit_it():
    core = min(os.sched_getaffinity(0))
    env = {**os.environ, ENV: CpuBinding((core,), 3).to_env()}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60, check=True)
    nice = os.getpriority(os.PRIO_PROCESS, 0) + 3
    assert json.loads(out.stdout) == {"main": [[core], nice], "thread": [[core], nice]}


def test_the_local_backend_hands_a_binding_to_the_roles_it_names_only(tmp_path):
    show = f"import os; print(os.environ.get({ENV!r}))"
    backend = LocalBackend([sys.executable, "-c", show], bindings={"worker-0": CpuBinding((0,), 5)})
    for role in ("worker-0", "ps"):
        assert backend.start(RoleSpec(role, [], tmp_path)).wait(30) == 0
    assert (tmp_path / "logs" / "worker-0.log").read_text().strip() == CpuBinding((0,), 5).to_env()
    assert (tmp_path / "logs" / "ps.log").read_text().strip() == "None"


def test_switchps_run_binds_as_the_config_says():
    cfg = load_config(str(CONFIGS / "quickstart.yaml"), ["runtime.cpu.worker_nice=2"])
    bindings = local_backend(cfg).bindings
    assert set(bindings) == {"evaluator", *(f"worker-{i}" for i in range(cfg.cluster.num_workers))}
    assert {b.nice for b in bindings.values()} == {2}


def test_a_worker_that_overlaps_its_push_gets_a_core_more_for_it():
    """With runtime.pipeline_depth 1 a worker pushes on a thread of its own while it computes: pinned to its
    framework's one core, the two took turns."""
    cfg = load_config(str(CONFIGS / "quickstart.yaml"), ["runtime.pipeline_depth=1", "cluster.workers=1"])
    cores = sorted(os.sched_getaffinity(0))
    worker = local_backend(cfg).bindings["worker-0"]
    assert worker.cores == (tuple(cores[:2]) if len(cores) >= 2 else ())


def test_a_role_command_takes_its_binding_first_thing(tmp_path):
    core = min(os.sched_getaffinity(0))
    env = {**os.environ, ENV: CpuBinding((core,), 3).to_env()}
    command = [sys.executable, "-m", "switchps.cli", "worker", str(tmp_path / "missing.yaml"), "--index", "0"]
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert f"worker bound: cores [{core}], nice +3" in out.stderr
