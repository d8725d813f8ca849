"""The `switchps` command line."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc

from switchps import EXIT_CONFIG, EXIT_INTERRUPTED, __version__
from switchps.address import split
from switchps.checks import PREFLIGHT
from switchps.config.run import ConfigError, RunConfig, load_config
from switchps.errors import EXIT_SHARD_LOST, PSUnreachable, RunDirError, ShardLost
from switchps.ps_server.resume_rules import refuse_incompatible
from switchps.launch.role_commands import bind_cpu, cmd_evaluator, cmd_ps, cmd_worker, exit_on_sigint, watch_parent

if TYPE_CHECKING:
    from switchps.launch.ray_backend import RayBackend

PS_HELP = "the PS's address (overrides cluster.ps and TF_CONFIG); `switchps run` passes what the PS published"


def cmd_run(args: argparse.Namespace) -> int:
    resume = Path(args.resume) if args.resume else None
    ckpt = None
    if resume is not None:
        if args.config:
            raise ConfigError("run: give a config or --resume RUN_DIR (which holds its config), not both")
        from switchps.ps_server.drivers import check_resumable

        ckpt = check_resumable(resume)
    cfg = load_config(resume / "config.yaml" if resume else args.config, args.set, role="run", checks=PREFLIGHT)
    if resume is not None and ckpt is not None:
        refuse_incompatible(resume, ckpt, cfg)
    from switchps.launch.launcher import LaunchError, console, launch, summary_table

    if args.address and args.backend != "ray":
        raise ConfigError("run: --address is for --backend ray")
    backend = None
    try:
        if args.backend == "ray":
            backend = _ray_backend(cfg, args.address)
        run_dir, summary = launch(cfg, quiet=args.quiet, resume=resume, backend=backend)
    except LaunchError as e:
        console.print(f"[red]switchps: {e}")
        return 1
    finally:
        if backend is not None:
            backend.close()
    console.print(summary_table(run_dir, summary))
    print(run_dir)
    return 0


def _ray_backend(cfg: RunConfig, address: str | None) -> "RayBackend":
    """Connect to Ray (``address``; none: a local Ray) and reserve the roles' placement group."""
    try:
        from switchps.launch.ray_backend import RayBackend, connect, run_secret
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] != "ray":
            raise
        raise ConfigError('run: --backend ray needs Ray, which is not installed: pip install "switchps[ray]"') from None
    env = run_secret(cfg)
    backend = RayBackend(cfg, env, local=connect(address))
    backend.open()
    return backend


def cmd_scale(args: argparse.Namespace) -> int:
    from switchps.launch.scaling import ask

    if (args.count is None) == (args.workers is None):
        raise ConfigError("scale: give the count (+K, -K or N) or --workers N, one of them")
    running, asked = ask(Path(args.run_dir), args.count if args.workers is None else str(args.workers))
    print(f"{args.run_dir}: asked its launcher for {asked} workers (it runs {running})")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.set, role="simulate", checks=PREFLIGHT)
    run_dir = Path(args.run_dir or cfg.new_run_dir())
    from switchps.launch.launcher import console, summary_table
    from switchps.sim.run import simulate

    signal.signal(signal.SIGINT, signal.default_int_handler)  # even where inherited as ignored (a background job)
    try:
        summary = simulate(cfg, run_dir, time_only=args.time_only, quiet=args.quiet)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print(f"switchps: simulate: interrupted; the partial run is in {run_dir}", file=sys.stderr)
        return EXIT_INTERRUPTED
    console.print(summary_table(run_dir, summary))
    print(run_dir)
    return 0


def cmd_role(args: argparse.Namespace) -> int:
    """Pick this task's role from SLURM, Kubernetes or TF_CONFIG (``switchps.launch.role_plan``) and run that
    role's command in this process."""
    import socket

    from switchps.launch.role_plan import plan

    p = plan(args.config, args.set, args.run_dir, os.environ, socket.gethostname())
    p.run_dir.mkdir(parents=True, exist_ok=True)
    logging.getLogger("switchps").info("switchps role: %s; run directory %s%s", p.placement.describe(), p.run_dir,
                                       " (resuming)" if p.resume else "")
    role_args = parser().parse_args(p.argv)
    return int(role_args.func(role_args))


def cmd_export_model(args: argparse.Namespace) -> int:
    if args.checkpoint != "latest" and not args.checkpoint.isdigit():
        raise ConfigError(f"export: --checkpoint must be latest or a version number, got {args.checkpoint!r}")
    from switchps.runs.export import export

    version = None if args.checkpoint == "latest" else int(args.checkpoint)
    print(export(Path(args.run_dir), version, Path(args.out) if args.out else None))
    return 0


def cmd_export_mlflow(args: argparse.Namespace) -> int:
    from switchps.runs.mlflow_export import export_mlflow

    done = export_mlflow(Path(args.dir), args.tracking_uri, args.experiment)
    print(f"MLflow experiment {done.experiment_id}, run {done.run_id}"
          + (f" with {len(done.children)} nested runs" if done.children else ""))
    return 0


def ps_arg(addresses: str) -> str | list[str]:
    """``--ps HOST:PORT[,HOST:PORT...]``: where the PS serves (every shard, shard 0 first), e.g. as it
    published in ``RUN_DIR/ps.address``."""
    out = addresses.split(",")
    for address in out:
        try:
            _, port = split(address)
        except ValueError:
            port = 0
        if not port:
            raise argparse.ArgumentTypeError(f"expected HOST:PORT with a port from 1 to 65535, got {address!r}")
    return out[0] if len(out) == 1 else out


def run_dir_arg(path: str) -> Path:
    """A run directory given on the command line; ``RunDirError`` (one line, exit 2) if it is not one."""
    missing = [name for name in ("config.yaml", "ps.csv", "eval.csv") if not (Path(path) / name).is_file()]
    if missing:
        raise RunDirError(f"{path} is not a run directory (no {', '.join(missing)})")
    return Path(path)


def cmd_status(args: argparse.Namespace) -> int:
    from switchps.runs.record import console
    from switchps.runs.status import status_table

    console().print(status_table(args.target, args.config))
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from switchps.runs.plots import plot_run

    for path in plot_run(run_dir_arg(args.run_dir), Path(args.out) if args.out else None):
        print(path)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from switchps.runs.compare import compare_runs, results_table
    from switchps.runs.record import console

    results = compare_runs([run_dir_arg(d) for d in args.run_dirs], args.target, Path(args.out))
    console().print(results_table(results, args.target))
    print(args.out)
    return 0


def cmd_study(args: argparse.Namespace) -> int:
    from switchps.studies.runner import PACKAGED, packaged, run_study
    from switchps.studies.spec import load_study

    if args.jobs < 1:
        raise ConfigError(f"--jobs: {args.jobs} processes; give 1 or more")
    path = packaged(args.study) if args.study in PACKAGED else Path(args.study)
    spec = load_study(path, args.set, simulate=args.simulate)
    if args.repeats is not None:
        spec.repeats = args.repeats
    if args.arms:
        keep = [a.strip() for a in args.arms.split(",")]
        unknown = [a for a in keep if a not in spec.arms]
        if unknown:
            raise ConfigError(f"--arms: unknown arm(s) {unknown}; the study has {', '.join(spec.arms)}")
        keep += [a for a in [spec.reference, *spec.compare_with] if a and a not in keep]
        spec.arms = {a: v for a, v in spec.arms.items() if a in keep}
    out = Path(args.out) if args.out else Path("runs") / spec.study
    run_study(spec, out, quiet=args.quiet, jobs=args.jobs)
    print(out / ("sweep.json" if spec.sweep else "study.json"))
    return 0


def cmd_certs(args: argparse.Namespace) -> int:
    from switchps.security.certs import write_dir

    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    try:
        paths = write_dir(Path(args.dir), hosts, args.days)
    except FileExistsError as e:
        raise RunDirError(f"certs: {e}; choose an empty directory") from None
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


def cmd_tune_switch(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.set, role="run", checks=PREFLIGHT)
    from switchps.runs.tune import tune_switch

    tune_switch(cfg, args.tolerance, args.repeats, args.min_fraction, quiet=args.quiet)
    return 0


class Parser(argparse.ArgumentParser):
    """A parser whose sub-command may be left out when it names a ``default_command``: `switchps export
    RUN_DIR`, the form from before `export mlflow`, is `switchps export model RUN_DIR`."""

    def __init__(self, *args: Any, default_command: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.default_command = default_command
        self.commands: dict[str, argparse.ArgumentParser] = {}

    def add_subparsers(self, **kwargs: Any) -> Any:
        action = super().add_subparsers(**kwargs)
        self.commands = action.choices
        return action

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if self.default_command is not None and args is not None:  # as a sub-parser, it is given its args
            if not args or args[0] not in {*self.commands, "-h", "--help"}:
                args = [self.default_command, *args]
        return super().parse_known_args(args, namespace)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="switchps", description="Parameter server with switchable synchronization")
    p.add_argument("--version", action="version", version=f"switchps {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)

    def with_config(name: str, help: str, optional: bool = False) -> argparse.ArgumentParser:
        s = sub.add_parser(name, help=help)
        s.add_argument("config", nargs="?" if optional else None, help="YAML run config")
        s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config field, e.g. --set protocol.name=asp (repeatable)")
        return s

    r = with_config("run", "run a PS, an evaluator and the workers locally (default: the quickstart)", optional=True)
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR from its latest checkpoint")
    r.add_argument("--backend", choices=["local", "ray"], default="local",
                   help="local: child processes (default); ray: Ray actors placed per cluster.ray")
    r.add_argument("--address", help="with --backend ray: auto (the cluster this host joined) or HOST:PORT; "
                                     "default: start a local Ray")
    r.set_defaults(func=cmd_run)
    sc = sub.add_parser("scale", help="change a running elastic run's worker count (cluster.workers: {min, max})")
    sc.add_argument("run_dir")
    sc.add_argument("count", nargs="?", metavar="+K|-K|N", help="workers to add (+K), stop (-K), or run (N)")
    sc.add_argument("--workers", type=int, metavar="N", help="run N workers (the same as COUNT N)")
    sc.set_defaults(func=cmd_scale)
    sim = with_config("simulate", "simulate a run on a virtual clock: the same core, protocols, policies and "
                                  "stragglers, with real gradients (needs device.samples_per_s)")
    sim.add_argument("--time-only", action="store_true", help="no model, no TensorFlow: time, throughput and "
                                                               "staleness only (losses 0, no evaluation)")
    sim.add_argument("--run-dir", help="where to write the run record (default: output.dir/<name>-<time>)")
    sim.add_argument("--quiet", action="store_true", help="no progress bar")
    sim.set_defaults(func=cmd_simulate)
    _role_parsers(with_config)
    _record_parsers(sub)
    t = with_config("tune-switch", "search the smallest BSP fraction (BSP, then ASP) that keeps BSP's accuracy")
    t.add_argument("--tolerance", type=float, default=0.005, help="accuracy loss allowed (0.005 = 0.5 points)")
    t.add_argument("--repeats", type=int, default=1, help="runs per fraction (their mean accuracy counts)")
    t.add_argument("--min-fraction", type=float, default=1 / 64, help="stop halving below this")
    t.add_argument("--quiet", action="store_true")
    t.set_defaults(func=cmd_tune_switch)
    ct = sub.add_parser("certs", help="make a development CA and TLS certificates for the PS and its clients")
    ct.add_argument("dir", help="an empty or new directory for ca.pem, server.pem, client.pem and their keys")
    ct.add_argument("--hosts", default="", help="comma-separated names/IPs clients reach the PS at "
                                                "(localhost and 127.0.0.1 are always included)")
    ct.add_argument("--days", type=int, default=365, help="validity of every certificate")
    ct.set_defaults(func=cmd_certs)
    _study_parser(sub.add_parser("study", help="run a study: arms x seeds, mean ± 95 %% CI per arm"))
    return p


def _role_parsers(with_config: Callable[[str, str], argparse.ArgumentParser]) -> None:
    """The commands that run one role of a run (`ps`, `worker`, `evaluator`, and `role`, which picks one)."""
    s = with_config("ps", "run the parameter server role")
    s.add_argument("--run-dir", help="where to write the run record (default: output.dir/<name>-<time>)")
    s.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR from its latest checkpoint")
    s.add_argument("--shard", type=int, default=0, help="which shard of the PS this is, when cluster.ps lists "
                                                        "several (0, the default, decides; the others follow it)")
    s.add_argument("--ps", type=ps_arg, metavar="HOST:PORT", help="a follower shard: shard 0's address "
                                                                  "(default: cluster.ps's first)")
    s.set_defaults(func=cmd_ps)
    w = with_config("worker", "run one worker role")
    w.add_argument("--index", type=int, help="worker index (or from TF_CONFIG task.index)")
    w.add_argument("--run-dir", help="a run directory on this host: sample resources into its resources.csv")
    w.add_argument("--ps", type=ps_arg, metavar="HOST:PORT[,...]", help=PS_HELP)
    w.set_defaults(func=cmd_worker)
    e = with_config("evaluator", "run the evaluator role")
    e.add_argument("--run-dir", help="where to write the final model.keras (default: output.dir)")
    e.add_argument("--ps", type=ps_arg, metavar="HOST:PORT[,...]", help=PS_HELP)
    e.set_defaults(func=cmd_evaluator)
    ro = with_config("role", "run the role this task of a SLURM job, Kubernetes pod or TF_CONFIG task has: "
                              "the first ranks the PS's shards (one, unless cluster.ps lists several), then the "
                              "evaluator, the rest workers (see examples/slurm)")
    ro.add_argument("--run-dir", help="the run directory all tasks share (default under SLURM: "
                                      "output.dir/<name>-slurm<job id>)")
    ro.set_defaults(func=cmd_role)


def _record_parsers(sub: Any) -> None:
    """The commands that read a run directory (`export`, `status`, `plot`, `compare`)."""
    x = sub.add_parser("export", help="a run's model file from its checkpoint (model, the default), or runs "
                                      "and studies into MLflow (mlflow)", default_command="model")
    forms = x.add_subparsers(dest="form", required=True)
    xm = forms.add_parser("model", help="write the run's model file (Keras or PyTorch) from a checkpoint; "
                                        "`switchps export RUN_DIR` means this")
    xm.add_argument("run_dir")
    xm.add_argument("--checkpoint", default="latest", help="latest, or the version of a kept checkpoint")
    xm.add_argument("--out", help="the model file (default RUN_DIR/model-v<version>.keras, or .pt for PyTorch)")
    xm.set_defaults(func=cmd_export_model)
    xf = forms.add_parser("mlflow", help="log a run directory, or a study directory (a parent run with a nested "
                                         "run per arm and repeat), as MLflow runs; needs switchps[mlflow]")
    xf.add_argument("dir", metavar="RUN_DIR|STUDY_DIR")
    xf.add_argument("--tracking-uri", help="the tracking store, e.g. sqlite:///mlflow.db or http://host:5000 "
                                           "(default: MLflow's, e.g. MLFLOW_TRACKING_URI)")
    xf.add_argument("--experiment", default="switchps", help="the experiment, created if missing (default "
                                                             "switchps)")
    xf.set_defaults(func=cmd_export_mlflow)
    stt = sub.add_parser("status", help="where a run stands: version, protocol, progress, workers, evaluation")
    stt.add_argument("target", metavar="RUN_DIR|HOST:PORT")
    stt.add_argument("--config", help="for HOST:PORT: the run config naming the secret and TLS files")
    stt.set_defaults(func=cmd_status)
    pl = sub.add_parser("plot", help="write PNG plots of a run directory")
    pl.add_argument("run_dir")
    pl.add_argument("--out", help="output directory (default RUN_DIR/plots)")
    pl.set_defaults(func=cmd_plot)
    c = sub.add_parser("compare", help="overlay several runs and tabulate time to a target accuracy")
    c.add_argument("run_dirs", nargs="+")
    c.add_argument("--target", type=float, default=0.9)
    c.add_argument("--out", default="compare.png")
    c.set_defaults(func=cmd_compare)


def _study_parser(st: argparse.ArgumentParser) -> None:
    st.add_argument("study", help="a study file, or a packaged study: amb-vs-fmb, dynamic-batching, "
                                  "local-steps-stragglers, post-local-sgd, scale, sync-switch, switch-config")
    st.add_argument("--out", help="directory for the runs, study.json and study.png (default runs/<study>); "
                                  "run again with the same --out to resume")
    st.add_argument("--repeats", type=int, help="seeds per arm (default: the file's)")
    st.add_argument("--arms", help="comma-separated arms to run (the reference always runs)")
    st.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a field of the study's base config (repeatable)")
    st.add_argument("--simulate", action="store_true",
                    help="run every arm in simulation on a virtual clock, whatever the file's mode")
    st.add_argument("--jobs", type=int, default=1, metavar="N",
                    help="run N repeats at a time, each in its own process (default 1); real runs in parallel "
                         "share the host's cores")
    st.add_argument("--quiet", action="store_true")
    st.set_defaults(func=cmd_study)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.command in ("ps", "worker", "evaluator", "role"):
        bind_cpu(args.command)  # first: the threads started below inherit it
        if os.environ.get("SWITCHPS_PARENT_PID"):  # started by `switchps run`
            exit_on_sigint(args.command)
        watch_parent()
    try:
        return args.func(args)
    except ConfigError as e:
        for problem in e.problems:
            print(f"switchps: config error: {problem}", file=sys.stderr)
        return EXIT_CONFIG
    except RunDirError as e:
        print(f"switchps: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except ShardLost as e:
        print(f"switchps: {args.command}: {e}", file=sys.stderr)
        return EXIT_SHARD_LOST
    except PSUnreachable as e:
        print(f"switchps: {args.command}: {e}", file=sys.stderr)
        return 1
    except grpc.RpcError as e:
        if e.code() not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            raise
        print(f"switchps: {args.command}: the PS refused this process ({e.code().name}: {e.details()}); "
              "does it use the PS's secret (security.secret_file or secret_env)?", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # `launch` has stopped every child before raising it
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a repeated Ctrl-C must not interrupt the exit
        print("switchps: interrupted; all processes stopped", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
