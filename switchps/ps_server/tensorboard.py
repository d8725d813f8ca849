"""TensorBoard event files of a run, written by the recorder's flusher with tensorboardX (no TensorFlow).

``RUN_DIR/tensorboard/`` gets, per update (step = model version): training loss, learning rate,
staleness, samples in the update and the protocol in force (its index in ``PROTOCOLS``, and a text
entry at each change); per flush: samples/s; per worker step (step = the worker's step): its step
time; per evaluation: test accuracy and loss. `tensorboard --logdir runs/` shows every run.
"""

from __future__ import annotations

from pathlib import Path

from tensorboardX import SummaryWriter

from switchps.names import PROTOCOLS

PROTOCOL_INDEX = {name: i for i, name in enumerate(PROTOCOLS)}


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

    def steps(self, rows: list[dict[str, str]]) -> None:
        for r in rows:
            self.writer.add_scalar(f"workers/step_s/{r['worker']}", float(r["compute_s"]) + float(r["sleep_s"]),
                                   int(r["step"]))

    def evaluations(self, rows: list[tuple]) -> None:
        for _, version, loss, acc in rows:
            if acc != "":
                self.writer.add_scalar("eval/test_accuracy", float(acc), int(version))
            if loss != "":
                self.writer.add_scalar("eval/test_loss", float(loss), int(version))

    def close(self) -> None:
        self.writer.close()
