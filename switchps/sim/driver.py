"""The simulator's driver of the core: events on virtual time in, the core's actions executed.

It does what the gRPC service does (``ps_server.service``), minus the I/O: a worker's push is checked
when it is sent, takes ``network.push_overhead_s`` plus an exponential jitter of mean
``network.push_jitter_s`` (drawn per worker and step, ``switchps.step_random``), crosses the link's inbound side, is recorded and
handed to the core; the actions come
back in order: ``Join`` a push to its aggregate, ``Free`` a dropped one, ``Apply`` an aggregate with the
store's update rule (``optimizers.apply_update``) and record it, ``Release`` a reply (its parameters cross the
link's outbound side, then the worker's next step starts), ``SetOptimizer``, ``Record``, ``Count``. The
core's timers become events; the latest version is evaluated every ``eval.every_s`` of virtual time and
when training ends.

Elastic membership (``churn``): a worker ``arrive``s (registers, pulls the latest version across the link,
steps) and ``depart``s (stops: its step under way is lost, as a preempted process loses what it computed; a
push it had sent still arrives, as it had left the worker, unless the PS counted the worker gone meanwhile;
a pull or a reply crossing to it is dropped on arrival). The PS is not told (the core notices the silence after ``cluster.leave_after_s``, its own rule),
unless ``churn.notice``: then the worker says it leaves (``Core.leave``, the Leave RPC's), as a real one
stopped with SIGTERM does.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import partial

import numpy as np

from switchps.config.run import RunConfig
from switchps.protos.wire_dtype import wire_nbytes
from switchps.ps_server.core.machine import Core
from switchps.ps_server.core.actions import (Action, Apply, Count, Free, Join, Record, Release, SetOptimizer,
                                             execute)
from switchps.ps_server.core.events import Push, StepReport, WorkOrder
from switchps.ps_server.link import DuplexLink
from switchps.optim.optimizers import Optimizer, adjust_optimizer, apply_update
from switchps.ps_server.outer import OuterOptimizers
from switchps.ps_server.records import RunRecorder
from switchps.refusals import Rejected
from switchps.sim.churn import Churn
from switchps.sim.learner import Learner, Score
from switchps.sim.loop import Event, Loop
from switchps.sim.network import Wire
from switchps.sim.workers import SimWorker, Work
from switchps.step_random import StepRandom, Stream


@dataclass
class Drive:
    """What the simulator drives: the core, the model's side, the optimizer, the run record, and the training
set's ``rows`` (``np.arange(n)``) its workers draw from."""

    core: Core
    learner: Learner
    optimizer: Optimizer
    rec: RunRecorder
    rows: np.ndarray
    link: DuplexLink | None = None


class Simulator:
    """One run on virtual time (see the module docstring); ``start`` it, then run ``loop``."""

    def __init__(self, cfg: RunConfig, parts: Drive, loop: Loop) -> None:
        self.cfg, self.parts, self.loop = cfg, parts, loop
        self.core, self.learner, self.rec = parts.core, parts.learner, parts.rec
        nbytes = wire_nbytes(parts.learner.values.size, cfg.runtime.wire_dtype)  # the link carries the wire's type
        self.inbound = Wire(loop, parts.link.inbound if parts.link else None, nbytes)
        self.outbound = Wire(loop, parts.link.outbound if parts.link else None, nbytes)
        self.workers = {i: SimWorker(cfg, i, parts.rows) for i in range(cfg.cluster.num_workers)}
        """Index -> the worker: the starting ones, and each other from its first arrival on."""
        self.works: dict[int, Work] = {}  # push id -> its step, until the push is applied or dropped
        self.lives: dict[int, int] = {}  # push id -> its worker's life when it pushed, until its reply
        self.joined: dict[int, list[int]] = defaultdict(list)  # aggregate id -> its pushes, in join order
        self.told_stop: set[int] = set()
        self.final: Score | None = None
        self.evaluated = False  # the final evaluation is done
        self._ids = 0
        self.random = StepRandom(cfg.seed)
        self._timer: tuple[float, Event] | None = None  # when the core's timer is armed, and its event
        self.outer = OuterOptimizers(parts.learner.trainable, parts.optimizer.variables)  # ``Apply.outer``'s
        self.churn = Churn(cfg, loop, self)

    @property
    def done(self) -> bool:
        return self.core.done

    def start(self) -> None:
        """The starting workers (``cluster.num_workers``) register at time 0, the model is initialized, and
        each worker pulls it."""
        core, now = self.core, self.loop.now
        workers = list(self.workers.values())
        for w in workers:
            w.arrive()
            self._execute(core.register(w.index, w.registered, now))
        self.rec.event("model_initialized", worker=0, parameters=int(self.learner.values.size))
        self._execute(core.initialized_at(now))
        assert core.started_at is not None, "every worker registered and the model is initialized"
        self.rec.start(core.started_at)
        for w in workers:
            self._pull(w)
        self.churn.start()
        self._evaluate()

    # ---- workers --------------------------------------------------------------------------------

    def _worker(self, index: int) -> SimWorker:
        w = self.workers.get(index)
        if w is None:
            w = self.workers[index] = SimWorker(self.cfg, index, self.parts.rows)
        return w

    def arrive(self, index: int) -> None:
        """Worker ``index`` joins (a new index) or comes back: it registers, pulls and steps."""
        w = self._worker(index)
        assert not w.running, f"worker {index} arrives while running"
        w.arrive()
        self.rec.event("churn", worker=index, change="join")
        self._execute(self.core.register(index, w.registered, self.loop.now))
        self._pull(w)

    def depart(self, index: int) -> None:
        """Worker ``index`` stops (see the module docstring); with ``churn.notice`` it tells the PS first, as a
        real worker stopped with SIGTERM does (if the PS still counts it)."""
        w = self.workers[index]
        assert w.running, f"worker {index} departs while not running"
        w.depart()
        self.rec.event("churn", worker=index, change="leave")
        if self.cfg.churn.notice and index in self.core.members.registered:
            self._execute(self.core.leave(index, self.loop.now))

    def _pull(self, w: SimWorker) -> None:
        order = self.core.issue(w.index, self.loop.now)
        self.learner.sent(order.version)
        self.outbound.send(partial(self._pulled, w, order, w.life))

    def _pulled(self, w: SimWorker, order: WorkOrder, life: int) -> None:
        if life != w.life:  # it departed while the parameters crossed
            self.learner.unused(order.version)
            return
        w.started = self.loop.now
        self._begin(w, order)

    def _begin(self, w: SimWorker, order: WorkOrder) -> None:
        work = w.begin(order, self.loop.now)
        self.learner.started(work)
        self.loop.at(work.done_at, self._send, w, work, w.life)

    def _send(self, w: SimWorker, work: Work, life: int) -> None:
        """The step is done: its push is checked as its header arrives, then crosses the link (unless its
        worker departed while computing it: then it is lost)."""
        if life != w.life:
            self.learner.lost(work)
            return
        now = w.pushed_at = self.loop.now
        work.loss_sum = self.learner.loss(work)
        report = work.report()
        session = life + 1  # a worker's every life is a new process: it never resends, and may skip a step
        try:
            self.core.check_push(work.worker, work.samples, work.version, report, now, session)
        except Rejected as e:  # the PS no longer counts it (silent too long): it registers again, as a real one
            if e.reason != "unknown_worker":
                raise
            self._execute(self.core.register(w.index, w.registered, now))
            self.core.check_push(work.worker, work.samples, work.version, report, now, session)
        self._ids += 1
        p = Push(self._ids, work.worker, work.version, work.samples, report.loss_sum, now, step=work.step,
                 session=session)
        self.works[p.id] = work
        self.lives[p.id] = life
        overhead = self._overhead(work)
        if overhead:
            self.loop.at(now + overhead, self.inbound.send, partial(self._arrived, p, report))
        else:
            self.inbound.send(partial(self._arrived, p, report))

    def _overhead(self, work: Work) -> float:
        """The push's cost beyond the link: the fitted constant and its random jitter."""
        net = self.cfg.network
        if not net.push_jitter_s:
            return net.push_overhead_s
        draw = self.random.at(work.worker, Stream.PUSH_JITTER, work.step).exponential(net.push_jitter_s)
        return net.push_overhead_s + float(draw)

    def _arrived(self, p: Push, report: StepReport) -> None:
        """The push is in; if the PS counted its worker gone while it crossed, it is lost with a departed
        worker (as a real one's, cut mid-stream or refused), and a running worker registers again first."""
        p.arrived = now = self.loop.now
        if p.worker not in self.core.members.registered:
            w = self.workers[p.worker]
            if self.lives[p.id] != w.life:
                del self.lives[p.id]
                self.learner.done(self.works.pop(p.id))
                return
            self._execute(self.core.register(w.index, w.registered, now))
        self.rec.step(p.worker, p.base_version, p.samples, report)
        self._execute(self.core.push(p, report, now))

    # ---- the core's actions (``actions.Executor``) --------------------------------------------------

    def release(self, r: Release) -> None:
        """A held reply goes out: a stop ends the worker, else its parameters cross the link; a reply to a
        push of a worker's earlier life reaches nobody."""
        w, life = self.workers[r.worker], self.lives.pop(r.push_id)
        if life != w.life:
            return
        if r.order.stop:
            self.told_stop.add(r.worker)
            return
        self.learner.sent(r.order.version)
        self.outbound.send(partial(self._replied, w, r, life))

    def _replied(self, w: SimWorker, r: Release, life: int) -> None:
        if life != w.life:  # it departed while the reply crossed
            self.learner.unused(r.order.version)
            return
        w.replied(self.loop.now, r.outcome.wait_s)
        self._begin(w, r.order)

    def _execute(self, actions: list[Action]) -> None:
        """Carry out the core's actions in order, as the service does; then re-arm its timer."""
        execute(actions, self)
        self._arm()
        if self.core.done and not self.evaluated:
            self.evaluated = True
            self.final = self._score()

    def join(self, a: Join) -> None:
        self.joined[a.aggregate_id].append(a.push_id)

    def free(self, a: Free) -> None:
        self.learner.done(self.works.pop(a.push_id))

    def set_optimizer(self, a: SetOptimizer) -> None:
        adjust_optimizer(self.parts.optimizer, lr_scale=a.lr_scale, state=a.state, state_scale=a.state_scale,
                         momentum=a.momentum)

    def record(self, a: Record) -> None:
        self.rec.event(a.event, **a.fields)

    def count(self, a: Count) -> None:
        self.rec.count(a.what, a.reason)

    def apply(self, a: Apply) -> None:
        """The aggregate's gradient sum, then the store's update rule, as version ``a.version``: with the run's
        optimizer, or, for movements, with the outer one ``a.outer`` names (as the store's)."""
        works = [self.works.pop(i) for i in self.joined.pop(a.aggregate.id)]
        assert [w.worker for w in works] == [m.worker for m in a.aggregate.members], "joins are the members"
        grad = self.learner.gradient(works)
        for w in works:
            self.learner.done(w)
        learner, opt = self.learner, self.parts.optimizer if a.outer is None else self.outer.get(a.outer)
        for _ in apply_update(opt, learner.values, learner.trainable, grad, a.aggregate.samples, len(works),
                              a.lr_factor):
            pass
        learner.applied(a.version)
        self.rec.update(a, opt.last_lr)

    def _arm(self) -> None:
        """Schedule the core's timer when it wants it (cancelling the one before, if it moved)."""
        at, armed = self.core.next_timer(), self._timer
        if armed is not None and armed[0] == at:
            return
        if armed is not None:
            armed[1].cancel()
        self._timer = None if at is None else (at, self.loop.at(at, self._fire))

    def _fire(self) -> None:
        self._timer = None
        self._execute(self.core.timer(self.loop.now))

    # ---- evaluation -----------------------------------------------------------------------------

    def _evaluate(self) -> None:
        """Evaluate the latest version every ``eval.every_s`` while training runs."""
        if self.core.done:
            return
        if self._score() is not None:
            self.loop.at(self.loop.now + self.cfg.eval.every_s, self._evaluate, background=True)

    def _score(self) -> Score | None:
        score = self.learner.evaluate(self.core.version)
        if score is not None:
            self.rec.evaluation(score.version, score.test_loss, score.test_accuracy)
        return score
