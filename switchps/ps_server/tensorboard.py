"""TensorBoard event files of a run, written by the recorder's flusher with tensorboardX (no TensorFlow).

``RUN_DIR/tensorboard/`` gets, per update (step = model version): training loss, learning rate,
staleness, samples in the update and the protocol in force (its index in ``PROTOCOLS``, and a text
entry at each change); per flush: samples/s; per worker step of workers 0 to 63 (step = the worker's
step): its step time (a larger run's others are in workers.csv: ten thousand tags help nobody, and
cost a simulation a tenth of its time); per evaluation: test accuracy and loss. `tensorboard --logdir
runs/` shows every run.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from tensorboardX import SummaryWriter
from tensorboardX.proto.summary_pb2 import Summary

from switchps.names import PROTOCOLS

PROTOCOL_INDEX = {name: i for i, name in enumerate(PROTOCOLS)}
WORKER_TAGS = 64
"""Workers below this index get a step-time tag."""


class TensorBoard:
    """Turns the recorder's rows into scalars; called only by the recorder's flusher, under its lock."""

    def __init__(self, run_dir: Path) -> None:
        self.writer = SummaryWriter(str(run_dir / "tensorboard"), flush_secs=2)
        self.protocol: str | None = None
        self.last: tuple[float, float] | None = None  # (time_s, samples) at the previous flush
        self.samples = 0.0

    def updates(self, rows: list[dict[str, str]]) -> None:
        w = self.writer
        for r in rows:
            v = int(r["version"])
            for tag, key in (("train/loss", "train_loss"), ("train/learning_rate", "lr"),
                             ("train/staleness_mean", "staleness_mean"), ("train/samples", "samples")):
                if r[key] != "":
                    w.add_scalar(tag, float(r[key]), v)
            w.add_scalar("train/protocol_index", PROTOCOL_INDEX.get(r["protocol"], -1), v)
            if r["protocol"] != self.protocol:
                self.protocol = r["protocol"]
                w.add_text("protocol", f"{r['protocol']} from version {v}", v)
            self.samples += float(r["samples"])
        if rows:
            now = float(rows[-1]["time_s"])
            if self.last is not None and now > self.last[0]:
                w.add_scalar("train/samples_per_s", (self.samples - self.last[1]) / (now - self.last[0]),
                             int(rows[-1]["version"]))
            self.last = (now, self.samples)

    def steps(self, rows: list[tuple], columns: tuple[str, ...]) -> None:
        """Each worker step's time, from ``rows`` of ``columns`` (workers.csv's): one event per step number
        holding every worker's scalar for it, so a BSP round's N steps are one event, not N (an event costs
        a queue put, which dominated a 1,024-worker simulation)."""
        worker, step, compute, sleep = (columns.index(c) for c in ("worker", "step", "compute_s", "sleep_s"))
        by_step: dict[int, list[Summary.Value]] = defaultdict(list)
        for r in rows:
            if int(r[worker]) >= WORKER_TAGS:
                continue
            by_step[int(r[step])].append(Summary.Value(tag=f"workers/step_s/{r[worker]}",
                                                       simple_value=float(r[compute]) + float(r[sleep])))
        for n, values in by_step.items():
            self.writer.file_writer.add_summary(Summary(value=values), n)

    def evaluations(self, rows: list[tuple]) -> None:
        for _, version, loss, acc in rows:
            if acc != "":
                self.writer.add_scalar("eval/test_accuracy", float(acc), int(version))
            if loss != "":
                self.writer.add_scalar("eval/test_loss", float(loss), int(version))

    def close(self) -> None:
        self.writer.close()
