"""The commands one role of a run runs on its own host: `switchps ps`, `worker` and `evaluator` (`switchps
role`, in ``switchps.cli``, picks one of them from a cluster engine's environment: SLURM, Kubernetes,
TF_CONFIG).

`switchps run` starts the same commands as its children (``switchps.launch.backends``); so do Ray's actors
(``switchps.launch.ray_backend``) and an `srun` or a pod. A child of `switchps run` exits when its launcher dies
(``watch_parent``) and on a Ctrl-C in one log line (``exit_on_sigint``).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from pathlib import Path
from types import FrameType

from switchps import EXIT_INTERRUPTED
from switchps.checks import PREFLIGHT
from switchps.launch.cluster_env import read_tf_config
from switchps.config.run import ConfigError, RunConfig, load_config
from switchps.config.cpu_binding import apply_env
from switchps.jsonfile import dumps


def watch_parent() -> None:
    """Exit when the launcher that started this process dies, so no orphan survives it."""
    parent = os.environ.get("SWITCHPS_PARENT_PID")
    if not parent:
        return

    def watch() -> None:
        while os.getppid() == int(parent):
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def exit_on_sigint(role: str) -> None:
    """Make a Ctrl-C (it reaches the launcher's whole process group) end this child at once, in one log line.

    The launcher stops the whole run anyway. ``os._exit``, not KeyboardInterrupt: raised inside gRPC or
    TF code, the exception can leave a lock held that the interpreter's exit then waits on. The launcher
    spawns children with SIGINT blocked, so one that arrived during the imports is delivered here, once
    the handler is in place.
    """

    def handler(signum: int, frame: FrameType | None) -> None:
        os.write(2, f"switchps {role}: interrupted (SIGINT), exiting\n".encode())
        os._exit(EXIT_INTERRUPTED)

    signal.signal(signal.SIGINT, handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def apply_tf_config(cfg: RunConfig, role: str, index: int | None) -> int | None:
    """Apply TF_CONFIG's cluster to ``cfg``; returns the task index it names (if any)."""
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        return index
    cluster, task = read_tf_config(raw)
    if cluster.get("ps"):  # several: the PS's shards, shard 0 first
        cfg.cluster.ps = cluster["ps"][0] if len(cluster["ps"]) == 1 else list(cluster["ps"])
    if cluster.get("worker"):
        cfg.cluster.workers = list(cluster["worker"])
    if task and task.get("type") != role:
        raise ConfigError(f"TF_CONFIG: task.type is {task.get('type')!r} but this is the {role} command")
    return index if index is not None else task.get("index")


def cmd_ps(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.set, role="ps", checks=PREFLIGHT)
    apply_tf_config(cfg, "ps", None)
    from switchps.ps_server.rpc.main import run_ps

    if args.resume and args.run_dir and Path(args.resume) != Path(args.run_dir):
        raise ConfigError("ps: --resume names the run directory; --run-dir, if given, must be the same")
    run_dir = Path(args.resume or args.run_dir or cfg.new_run_dir())
    if not 0 <= args.shard < len(cfg.cluster.shards):
        raise ConfigError(f"ps: --shard {args.shard} outside [0, {len(cfg.cluster.shards)}) (cluster.ps lists "
                          f"{len(cfg.cluster.shards)} shards)")
    if args.shard:
        from switchps.ps_server.shard.follower_main import run_follower

        run_follower(cfg, run_dir, args.shard, args.ps if isinstance(args.ps, str) else cfg.cluster.shards[0])
        return 0
    summary = run_ps(cfg, run_dir, resume=bool(args.resume))
    print(dumps(summary))
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.set, role="worker", checks=PREFLIGHT)
    index = apply_tf_config(cfg, "worker", args.index)
    cfg.cluster.ps = args.ps or cfg.cluster.ps
    if index is None:
        raise ConfigError("worker: give --index or a TF_CONFIG with task.index")
    if not 0 <= index < cfg.cluster.max_workers:
        raise ConfigError(f"worker: index {index} outside [0, {cfg.cluster.max_workers})")
    from switchps.worker.main import run_worker

    _sample_resources(f"worker-{index}", args.run_dir)
    steps = run_worker(cfg, index)
    logging.getLogger("switchps").info("worker %d finished after %d steps", index, steps)
    return 0


def cmd_evaluator(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.set, role="evaluator", checks=PREFLIGHT)
    apply_tf_config(cfg, "evaluator", None)
    cfg.cluster.ps = args.ps or cfg.cluster.ps
    from switchps.worker.evaluator import run_evaluator

    _sample_resources("evaluator", args.run_dir)
    run_evaluator(cfg, Path(args.run_dir) if args.run_dir else Path(cfg.output.dir))
    return 0


def bind_cpu(role: str) -> None:
    """Take the cores and priority the launcher gave this role (``switchps.config.cpu_binding``); call it before
    the process starts a thread."""
    binding = apply_env()
    if binding is not None:
        logging.getLogger("switchps").info("%s bound: cores %s, nice +%d", role, list(binding.cores) or "any",
                                           binding.nice)


def _sample_resources(role: str, run_dir: str | None) -> None:
    """Sample this process's resources into RUN_DIR/resources.csv, if it was given a run directory."""
    if run_dir and Path(run_dir).is_dir():
        from switchps.resources import ResourceSampler

        ResourceSampler(role, Path(run_dir) / "resources.csv")
