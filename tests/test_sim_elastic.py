"""Elastic membership in the simulator (``churn``): workers depart and arrive on virtual time, as a trace says
or as Poisson preemptions draw; the core notices a departure by its own rule (``cluster.leave_after_s`` of
silence), N in force follows, every push is counted once, a run is a pure function of its config and seed,
and a bad churn is one line naming its field. No sockets, no sleeps."""

from __future__ import annotations

import json
import subprocess
from importlib.resources import files
from pathlib import Path
from typing import Any

import pytest
import yaml

from switchps.config.run import RunConfig, parse_config
from switchps.problems import ConfigError
from switchps.sim.run import simulate
from test_sim import SWITCHPS, rows

LEAVE_AFTER_S = 1.0


def elastic(churn: dict[str, Any], **sections: Any) -> dict[str, Any]:
    """An elastic run of 4 to start with (2 to 6), ASP, batches of 10 at 100 samples/s (0.1 s a step), 6 s of
    virtual time; ``sections`` replace the base's."""
    raw: dict[str, Any] = {
        "name": "elastic", "cluster": {"workers": {"min": 2, "max": 6, "start": 4}, "leave_after_s": LEAVE_AFTER_S},
        "model": {"name": "logreg"}, "data": {"name": "digits", "sampling": "replacement"},
        "train": {"seconds": 6.0}, "device": {"samples_per_s": 100.0}, "protocol": {"name": "asp", "batch": 10},
        "optimizer": {"name": "sgd", "learning_rate": 0.1}, "eval": {"every_s": 0.5}, "churn": churn}
    raw.update(sections)
    return raw


def trace(path: Path, *changes: tuple[float, int, str]) -> str:
    path.write_text("time_s,worker,event\n" + "".join(f"{t},{w},{e}\n" for t, w, e in changes))
    return str(path)


def events(run: Path, name: str) -> list[dict[str, Any]]:
    lines = (json.loads(line) for line in (run / "events.jsonl").read_text().splitlines())
    return [e for e in lines if e["event"] == name]


def counted_once(run: Path, s: dict[str, Any]) -> None:
    """Every push the PS received is one row of workers.csv, one worker step, accepted or dropped; every accepted
    one is in exactly one update."""
    pushes = rows(run, "workers.csv")
    assert len({(p["worker"], p["step"]) for p in pushes}) == len(pushes), "no step pushes twice"
    assert s["pushes_rejected"] == 0 and s["pushes_accepted"] + s["pushes_dropped"] == len(pushes)
    applied = [w for u in rows(run) for w in u["workers"].split(";")]
    assert len(applied) == s["pushes_accepted"]
    assert sum(int(u["samples"]) for u in rows(run)) == s["samples"]


def test_members_per_update_follow_a_trace_and_every_push_counts_once(tmp_path: Path) -> None:
    joins = {4: 1.05, 5: 2.05}  # between steps' ends (every 0.1 s): no tie with an update
    churn = {"trace": trace(tmp_path / "churn.csv", (1.05, 4, "join"), (2.05, 5, "join"), (3.05, 0, "leave"),
                            (3.05, 1, "leave"), (3.05, 2, "leave"))}
    run = tmp_path / "r"
    s = simulate(parse_config(elastic(churn), role="simulate"), run, time_only=True)
    left = {e["worker"]: e["time_s"] for e in events(run, "worker_left")}
    assert sorted(left) == [0, 1, 2]
    assert all(3.05 < t <= 3.05 + LEAVE_AFTER_S for t in left.values()), "noticed after leave_after_s of silence"
    updates = rows(run)
    for u in updates:
        t = float(u["time_s"])
        expected = 4 + sum(t >= at for at in joins.values()) - sum(t >= at for at in left.values())
        assert int(u["members"]) == expected, u
    assert {int(u["members"]) for u in updates} == {3, 4, 5, 6}
    pushes = rows(run, "workers.csv")
    assert not [p for p in pushes if p["worker"] in "012" and float(p["time_s"]) > 3.05], "a departed worker stops"
    for w, at in joins.items():
        assert min(float(p["time_s"]) for p in pushes if p["worker"] == str(w)) > at, "a newcomer starts at its join"
    assert [(e["worker"], e["change"]) for e in events(run, "churn")] == [(4, "join"), (5, "join"), (0, "leave"),
                                                                          (1, "leave"), (2, "leave")]
    assert s["updates"] == len(updates) and not s["stalled"]
    counted_once(run, s)


def test_with_notice_a_departing_worker_is_gone_at_once_and_its_push_in_flight_is_lost(tmp_path: Path) -> None:
    """``churn.notice``: the worker tells the PS it leaves (as one stopped with SIGTERM does): N drops at the
    departure, not ``leave_after_s`` later; a push it sent that arrives after is lost with it (never counted)."""
    # pushes take 0.02 s to arrive, so workers 0 and 1 send every 0.12 s: at 2.98 s their step 24's push leaves,
    # to arrive at 3.0 s, after they left at 2.99 s
    churn = {"notice": True, "trace": trace(tmp_path / "churn.csv", (1.05, 4, "join"), (2.99, 0, "leave"),
                                             (2.99, 1, "leave"))}
    run = tmp_path / "r"
    s = simulate(parse_config(elastic(churn, network={"push_overhead_s": 0.02}), role="simulate"), run,
                 time_only=True)
    assert [(e["worker"], e["time_s"], e["reason"]) for e in events(run, "worker_left")] == [
        (0, 2.99, "exited"), (1, 2.99, "exited")]
    for u in rows(run):
        t = float(u["time_s"])
        assert int(u["members"]) == 4 + (t >= 1.05) - 2 * (t >= 2.99), u
    pushes = rows(run, "workers.csv")
    assert [(p["time_s"], p["step"]) for p in pushes if p["worker"] == "0"][-1] == ("2.88", "23"), "24 is lost"
    assert not s["stalled"]
    counted_once(run, s)


def test_a_departed_step_is_lost_and_what_crossed_to_it_is_dropped_with_gradients(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over a slow link (parameters take 0.04 s or more to cross), workers depart mid-step and while replies
    cross to them, and come back: the steps lost, the parameters nobody started from, and every version a
    step referred to are let go (the learner holds none at the end), and the run trains to its end."""
    from switchps.sim.gradients import Real

    learners: list[Real] = []
    calls = {"lost": 0, "unused": 0}
    init, lost, unused = Real.__init__, Real.lost, Real.unused

    def made(self: Real, *args: Any) -> None:
        init(self, *args)
        learners.append(self)

    def losing(self: Real, work: Any) -> None:
        calls["lost"] += 1
        lost(self, work)

    def unusing(self: Real, version: int) -> None:
        calls["unused"] += 1
        unused(self, version)

    for name, spy in (("__init__", made), ("lost", losing), ("unused", unusing)):
        monkeypatch.setattr(Real, name, spy)
    changes = [(0.15 + 0.23 * i, i % 3, "leave") for i in range(6)]
    changes = [c for i, c in enumerate(changes) for c in (c, (c[0] + 0.03 + 0.01 * i, c[1], "join"))]
    churn = {"trace": trace(tmp_path / "churn.csv", *changes)}
    cfg = parse_config(elastic(churn, cluster={"workers": {"min": 2, "max": 3, "start": 3},
                                               "leave_after_s": LEAVE_AFTER_S},
                               train={"steps": 40}, network={"ps_link_mbit_s": 0.5}), role="simulate")
    run = tmp_path / "r"
    s = simulate(cfg, run)
    assert calls["lost"] > 0 and calls["unused"] > 0, calls
    (learner,) = learners
    assert not learner.refs and list(learner.params) == [40] and not learner.unscored
    assert s["updates"] == 40 and s["final_test_accuracy"] is not None
    pushes = rows(run, "workers.csv")
    steps = {w: [int(p["step"]) for p in pushes if p["worker"] == w] for w in "012"}
    assert any(b > a + 1 for ss in steps.values() for a, b in zip(ss, ss[1:])), "a lost step is a gap"
    counted_once(run, s)


def test_a_worker_the_core_no_longer_counts_registers_again_and_its_push_counts(tmp_path: Path) -> None:
    """Worker 2's steps take 2 s, longer than leave_after_s: the core lets it go at 1 s, refuses its push
    (``unknown_worker``) at 2 s, and it registers again, as a real worker does; its push is then taken."""
    cfg = parse_config(elastic({}, stragglers={"slowdown": {"factors": {2: 20.0}}},
                               cluster={"workers": {"min": 1, "max": 3, "start": 3}, "leave_after_s": LEAVE_AFTER_S}),
                       role="simulate")
    run = tmp_path / "r"
    s = simulate(cfg, run, time_only=True)
    mine = [(e["event"], e["time_s"]) for e in events(run, "worker_left") + events(run, "worker_joined")
            if e["worker"] == 2 and e["time_s"] > 0]
    assert sorted(mine, key=lambda x: x[1])[:2] == [("worker_left", 1.0), ("worker_joined", 2.0)]
    assert [p["time_s"] for p in rows(run, "workers.csv") if p["worker"] == "2"][:1] == ["2"]
    assert not s["stalled"]
    counted_once(run, s)


def poisson(seed: int, workers: int = 1000, train: dict[str, Any] | None = None, **churn: Any) -> RunConfig:
    """BSP at ``workers`` (as many at most, half at least) for 3 s of virtual time, preempted at 36 an hour each
    (about 30 preemptions in all), back after 1 s."""
    spec = {"preempt_per_hour": 36.0, "rejoin_after_s": 1.0, **churn}
    raw = elastic(spec, seed=seed, protocol={"name": "bsp", "batch": 10}, train=train or {"seconds": 3.0},
                  cluster={"workers": {"min": workers // 2, "max": workers}, "leave_after_s": 0.5},
                  eval={"every_s": 100.0})
    raw["cluster"]["workers"]["start"] = workers
    return parse_config(raw, role="simulate")


def test_poisson_churn_at_1000_workers_is_deterministic_and_costs_rounds(tmp_path: Path) -> None:
    runs = {name: simulate(poisson(seed=3), tmp_path / name, time_only=True) for name in ("a", "b")}
    for table in ("ps.csv", "workers.csv", "events.jsonl"):
        assert (tmp_path / "a" / table).read_bytes() == (tmp_path / "b" / table).read_bytes(), table
    run, s = tmp_path / "a", runs["a"]
    departed = [e for e in events(run, "churn") if e["change"] == "leave"]
    # 1,000 workers x 3 s x 36 / 3600 s = 30 expected; the Poisson count's 5-sigma interval
    assert 3 <= len(departed) <= 58, len(departed)
    back = [e for e in events(run, "churn") if e["change"] == "join"]
    assert back and all(e["worker"] in {d["worker"] for d in departed} for e in back), "an index comes back"
    left = [e["time_s"] for e in events(run, "worker_left")]
    joined = [e["time_s"] for e in events(run, "worker_joined") if e["time_s"] > 0]
    assert left and joined
    for u in rows(run):  # N in force: the departures the core noticed, and the returns (either order at a tie)
        t, n = float(u["time_s"]), int(u["members"])
        assert 1000 - sum(x <= t for x in left) + sum(x < t for x in joined) <= n, u
        assert n <= 1000 - sum(x < t for x in left) + sum(x <= t for x in joined), u
    assert s["updates"] < 30, "each departure stalls BSP rounds until the core notices it (a round is 0.1 s)"
    counted_once(run, s)
    other = simulate(poisson(seed=4), tmp_path / "c", time_only=True)
    assert (tmp_path / "c" / "events.jsonl").read_bytes() != (run / "events.jsonl").read_bytes(), "seeded"
    assert other["updates"] > 0


def test_a_run_whose_workers_all_depart_for_good_ends_stalled(tmp_path: Path) -> None:
    cfg = poisson(seed=0, workers=4, train={"steps": 10**6}, preempt_per_hour=3600.0, rejoin_after_s=None)
    s = simulate(cfg, tmp_path / "r", time_only=True)
    assert s["stalled"] and s["updates"] < 10**6
    (stall,) = events(tmp_path / "r", "simulation_stalled")
    assert stall["members"] < 2, "below min: nothing can train"


@pytest.mark.parametrize("churn, rows_, field", [
    ({"preempt_per_hour": -1.0}, None, "churn.preempt_per_hour"),
    ({}, "time_s,worker,event\n1.0,6,join\n", "churn.trace: {trace}:2: worker 6 is outside [0, cluster.workers.max)"),
    ({}, "time_s,worker,event\n1.0,4,arrive\n", "churn.trace: {trace}:2: event 'arrive' is neither join nor leave"),
    ({}, "time_s,worker,event\n1.0,3,join\n", "churn.trace: {trace}:2: worker 3 joins at 1.0 s but is already running"),
], ids=["negative-rate", "index-beyond-max", "unknown-event", "join-of-a-running-worker"])
def test_bad_churn_exits_2_with_one_line_naming_the_field(tmp_path: Path, churn: dict[str, Any], rows_: str | None,
                                                         field: str) -> None:
    path = tmp_path / "churn.csv"
    if rows_ is not None:
        path.write_text(rows_)
        churn = {"trace": str(path)}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(elastic(churn)))
    proc = subprocess.run([SWITCHPS, "simulate", "cfg.yaml", "--time-only", "--quiet"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert field.format(trace=path) in line, line


@pytest.mark.parametrize("role, cluster, expected", [
    ("run", None, "churn: only `switchps simulate` injects churn"),
    ("simulate", {"workers": 4}, "churn: joins and leaves need elastic workers"),
])
def test_churn_is_refused_outside_an_elastic_simulation(role: Any, cluster: dict[str, Any] | None,
                                                       expected: str) -> None:
    raw = elastic({"preempt_per_hour": 1.0}, **({"cluster": cluster} if cluster else {}))
    with pytest.raises(ConfigError, match=expected.replace("`", ".")):
        parse_config(raw, role=role)


EXAMPLE = Path(str(files("switchps.examples"))) / "churn.yaml"


def test_the_packaged_churn_example_simulates_and_switchps_run_refuses_it(tmp_path: Path) -> None:
    small = ["--set", "cluster.workers={min: 4, max: 8, start: 8}", "--set", "train.seconds=3",
             "--set", "churn.preempt_per_hour=1800", "--set", "churn.rejoin_after_s=0.5",
             "--set", "cluster.leave_after_s=0.3", "--set", f"output.dir={tmp_path}"]
    proc = subprocess.run([SWITCHPS, "simulate", str(EXAMPLE), "--time-only", "--quiet", "--run-dir",
                           str(tmp_path / "r"), *small], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert s["simulated"] and not s["stalled"] and s["virtual_time_s"] == pytest.approx(3.0)
    assert {e["change"] for e in events(tmp_path / "r", "churn")} == {"join", "leave"}
    counted_once(tmp_path / "r", s)
    proc = subprocess.run([SWITCHPS, "run", str(EXAMPLE), "--quiet", *small], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "churn: only `switchps simulate` injects churn" in line, line
