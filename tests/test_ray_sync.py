"""The driver's run directory kept from roles' node-local stages (``switchps.launch.ray_sync``), without Ray:
two directories, a role writing into one the way switchps's roles write, batches applied to the other."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from switchps.launch.ray_sync import Batch, Change, Mirror, Stage, staged


def driver_dir(tmp_path: Path) -> Mirror:
    root = tmp_path / "driver"
    (root / "checkpoints").mkdir(parents=True)
    (root / "logs").mkdir()
    (root / "config.yaml").write_text("name: x\n")
    (root / "checkpoints" / "v20.ckpt").write_bytes(b"\x00ckpt20")
    (root / "logs" / "worker-0.log").write_text("worker 0\n")
    (root / "events.jsonl").write_text('{"event": "ray_placed"}\n')
    return Mirror(root)


def replace(path: Path, data: bytes) -> None:
    """An atomic write, as switchps writes checkpoints, summary.json and ps.address."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def tree(root: Path, skip: tuple[str, ...] = ()) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*")
            if p.is_file() and not p.name.startswith(".") and p.relative_to(root).parts[0] not in skip}


def test_a_ps_stage_is_seeded_with_the_record_and_checkpoints_and_the_others_with_the_config(tmp_path):
    mirror = driver_dir(tmp_path)
    ps = mirror.seed("ps")
    assert ps == {"config.yaml": b"name: x\n", "checkpoints/v20.ckpt": b"\x00ckpt20",
                  "events.jsonl": b'{"event": "ray_placed"}\n'}, "no logs: a resumed PS does not read them"
    assert mirror.seed("worker-3") == {"config.yaml": b"name: x\n"}
    stage = Stage.seeded(tmp_path / "node" / "ps.1", ps)
    assert tree(stage.root) == ps and stage.root.stat().st_mode & 0o777 == 0o700
    assert stage.changes() == Batch(), "the seed is what the driver already has"


def test_what_a_ps_writes_reaches_the_driver_appended_replaced_or_deleted(tmp_path):
    mirror = driver_dir(tmp_path)
    stage = Stage.seeded(tmp_path / "node" / "ps.1", mirror.seed("ps"))
    events = stage.root / "events.jsonl"
    with events.open("a") as f:
        f.write('{"event": "resumed"}\n')
    (stage.root / "ps.csv").write_text("version\n1\n")
    replace(stage.root / "checkpoints" / "v40.ckpt", b"\x00ckpt40")
    (stage.root / "checkpoints" / "v20.ckpt").unlink()  # pruned
    (stage.root / "checkpoints" / ".v60.ckpt.99.tmp").write_bytes(b"half")  # being written
    batch = stage.changes()
    assert Change("events.jsonl", b'{"event": "resumed"}\n', offset=len(b'{"event": "ray_placed"}\n')) in batch.changes
    assert Change("ps.csv", b"version\n1\n", offset=0) in batch.changes
    assert Change("checkpoints/v40.ckpt", b"\x00ckpt40") in batch.changes
    assert batch.deleted == ["checkpoints/v20.ckpt"] and len(batch.changes) == 3, "no temporary file"
    with (mirror.root / "events.jsonl").open("a") as f:  # the driver's own event, meanwhile
        f.write('{"event": "ray_restarted"}\n')
    assert mirror.apply(batch) == []
    assert (mirror.root / "events.jsonl").read_text().splitlines() == [
        '{"event": "ray_placed"}', '{"event": "ray_restarted"}', '{"event": "resumed"}']
    driver, node = tree(mirror.root, skip=("logs",)), tree(stage.root)
    del driver["events.jsonl"], node["events.jsonl"]
    assert driver == node, "every other file as the PS wrote it, v20.ckpt gone"
    assert stage.changes() == Batch(), "each change is sent once"


def test_a_record_rewritten_by_a_rename_or_truncated_is_sent_whole(tmp_path):
    stage = Stage.seeded(tmp_path / "stage", {"ps.csv": b"version\n1\n2\n3\n"})
    replace(stage.root / "ps.csv", b"version\n1\n2\n3\n4\n")  # a resumed PS rewrites its table
    assert stage.changes().changes == [Change("ps.csv", b"version\n1\n2\n3\n4\n")]
    with (stage.root / "ps.csv").open("w") as f:
        f.write("v\n")
    assert stage.changes().changes == [Change("ps.csv", b"v\n")]


def test_appends_arrive_in_pieces_and_the_driver_copy_is_byte_identical(tmp_path):
    mirror, stage = Mirror(tmp_path / "driver"), Stage.seeded(tmp_path / "stage", {})
    mirror.root.mkdir()
    log = stage.root / "logs" / "ps.log"
    log.parent.mkdir()
    for i in range(5):
        with log.open("a") as f:
            f.write(f"line {i}\n" * (i + 1))
        mirror.apply(stage.changes())
    assert (mirror.root / "logs" / "ps.log").read_bytes() == log.read_bytes()


def test_a_csv_several_roles_append_to_keeps_one_header(tmp_path):
    mirror = Mirror(tmp_path / "driver")
    mirror.root.mkdir()
    header = "unix_time,role,pid\n"
    for role in ("ps", "worker-0", "worker-1"):
        stage = Stage.seeded(tmp_path / role, {})
        (stage.root / "resources.csv").write_text(f"{header}1.0,{role},7\n")
        mirror.apply(stage.changes())
    assert (mirror.root / "resources.csv").read_text() == header + "".join(
        f"1.0,{r},7\n" for r in ("ps", "worker-0", "worker-1"))


@pytest.mark.parametrize("path", ["../escape", "/etc/passwd", "a/../../b", ""])
def test_a_batch_cannot_write_or_delete_outside_the_run_directory(tmp_path, path):
    mirror = Mirror(tmp_path / "driver")
    mirror.root.mkdir()
    (tmp_path / "escape").write_text("kept")
    refused = mirror.apply(Batch([Change(path, b"x"), Change("ok.json", b"{}")], deleted=[path]))
    assert refused == [path, path] and (tmp_path / "escape").read_text() == "kept"
    assert (mirror.root / "ok.json").read_text() == "{}", "the rest of the batch is applied"


def test_a_roles_arguments_name_its_stage_instead_of_the_drivers_run_directory():
    args = ["worker", "runs/a/config.yaml", "--run-dir", "runs/a", "--ps", "h:1", "--x", "runs/ab"]
    assert staged(args, "runs/a", "/tmp/s/worker-0.7") == [
        "worker", "/tmp/s/worker-0.7/config.yaml", "--run-dir", "/tmp/s/worker-0.7", "--ps", "h:1", "--x", "runs/ab"]


def test_a_stage_removed_whole_deletes_nothing_on_the_driver(tmp_path):
    stage = Stage.seeded(tmp_path / "stage", {"config.yaml": b"name: x\n", "resources.csv": b"h\n"})
    shutil.rmtree(stage.root)
    assert stage.changes() == Batch()


def test_a_line_being_written_waits_for_the_next_batch_unless_the_role_has_ended(tmp_path):
    mirror, stage = Mirror(tmp_path / "driver"), Stage.seeded(tmp_path / "stage", {"events.jsonl": b""})
    mirror.root.mkdir()
    (mirror.root / "events.jsonl").write_bytes(b"")
    events = stage.root / "events.jsonl"
    events.write_bytes(b'{"event": "a"}\n{"event": "b')  # the PS is mid-line
    mirror.apply(stage.changes())
    with (mirror.root / "events.jsonl").open("a") as f:  # the driver's own line lands between batches
        f.write('{"event": "ray_restarted"}\n')
    with events.open("ab") as f:
        f.write(b'"}\n{"event": "c"}')
    mirror.apply(stage.changes())
    assert (mirror.root / "events.jsonl").read_text().splitlines() == [
        '{"event": "a"}', '{"event": "ray_restarted"}', '{"event": "b"}'], "no line cut in two"
    mirror.apply(stage.changes(final=True))
    assert (mirror.root / "events.jsonl").read_text().endswith('{"event": "b"}\n{"event": "c"}'), \
        "the last line, without its newline, once the role has ended"


def test_a_follower_shards_stage_is_seeded_with_its_own_parts_and_shard_zeros_without_them(tmp_path):
    mirror = driver_dir(tmp_path)
    for k in (1, 2):
        (mirror.root / "checkpoints" / f"shard-{k}").mkdir()
        (mirror.root / "checkpoints" / f"shard-{k}" / "v20.ckpt").write_bytes(f"part {k}".encode())
        (mirror.root / f"ps-{k}.address").write_text(f"h:{k}\n")
    assert mirror.seed("ps-2") == {"config.yaml": b"name: x\n", "checkpoints/shard-2/v20.ckpt": b"part 2",
                                   "ps-2.address": b"h:2\n"}
    assert not any(path.startswith("checkpoints/shard-") for path in mirror.seed("ps")), "shard 0 needs its own"
    assert "checkpoints/v20.ckpt" in mirror.seed("ps")
