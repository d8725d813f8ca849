"""Bad configs fail before any process starts: exit 2, every problem at once, one line each naming its field."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, get_args, get_origin

import annotated_types as at
import pytest
from pydantic import Tag

import switchps.launch.launcher
from switchps import names
from switchps.cli import main
from switchps.checks import PREFLIGHT
from switchps.config.run import ConfigError, RunConfig, load_config, parse_config
from switchps.config.schema import Section

SWITCHPS = str(Path(sys.executable).parent / "switchps")  # the console script pip installed
PREFIX = "switchps: config error: "
DIRECTORY, MISSING = object(), object()

BAD = [
    # the file itself
    ("empty file", "", [], [("config: ", "bad.yaml is empty (or only comments)")]),
    ("only comments", "# nothing yet\n\n", [], ["is empty"]),
    ("a directory", DIRECTORY, [], ["is a directory"]),
    ("not UTF-8", b"name: caf\xe9\n", [], ["is not UTF-8 text (byte 0xe9 at offset 9)"]),
    ("missing file", MISSING, [], ["config: file not found: "]),
    ("invalid YAML", "protocol: [1, 2", [], ["invalid YAML at line"]),
    ("not a mapping", "- just\n- a list", [], ["config: the top level must be a mapping"]),
    # numbers: finite and bounded
    ("workers 1e10 (a YAML string)", "cluster: {workers: 1e10}", [], ["cluster.workers: "]),
    ("workers 1.0e+10", "cluster: {workers: 1.0e+10}", [], ["cluster.workers: at most 1024 workers"]),
    ("batch 1e20 (a YAML string)", "protocol: {batch: 1e20}", [], ["protocol.batch: "]),
    ("batch 1.0e+20", "protocol: {batch: 1.0e+20}", [], ["protocol.batch: "]),
    ("batch above 2**20", "protocol: {batch: 2000000}", [],
     ["protocol.batch: Input should be less than or equal to 1048576"]),
    ("batch 10**20 as an int", "protocol: {batch: 100000000000000000000}", [],
     ["protocol.batch: Input should be less than or equal to 1048576"]),
    ("learning_rate 1e999", "optimizer: {learning_rate: 1e999}", [],
     ["optimizer.learning_rate: Input should be a finite number (got '1e999')"]),
    ("learning_rate .nan", "optimizer: {learning_rate: .nan}", [],
     ["optimizer.learning_rate: Input should be a finite number"]),
    ("straggler scale .inf", "stragglers: {mixture: {preset: cedar, scale: .inf}}", [],
     ["stragglers.mixture.scale: Input should be a finite number"]),
    ("seed 2**32", "seed: 4294967296", [], ["seed: Input should be less than or equal to 4294967295"]),
    ("steps 1.0e+12", "train: {steps: 1.0e+12}", [], ["train.steps: Input should be less than or equal to"]),
    ("threads 1000", "runtime: {intra_op_threads: 1000}", [], ["runtime.intra_op_threads: "]),
    ("max_grad_norm 0", "runtime: {max_grad_norm: 0}", [],
     ["runtime.max_grad_norm: Input should be greater than 0"]),
    # weight decay and clipping (issue 47)
    ("weight_decay -1", "optimizer: {name: adam, params: {weight_decay: -1}}", [],
     ["optimizer.params.weight_decay: weight_decay must be >= 0, got -1.0"]),
    ("clip_norm -1", "optimizer: {clip_norm: -1}", [], ["optimizer.clip_norm: Input should be greater than 0"]),
    ("both clips, as Keras refuses", "optimizer: {clip_norm: 1, global_clip_norm: 1}", [],
     ["optimizer.global_clip_norm: clip by clip_norm or by global_clip_norm, not both"]),
    ("a global clip over shards", "cluster: {ps: [127.0.0.1:0, 127.0.0.1:0]}\noptimizer: {global_clip_norm: 1}", [],
     ["optimizer.global_clip_norm: clips on one PS process, not 2 shards (no shard sees the whole gradient's norm)"]),
    ("a variable's clip over shards", "cluster: {ps: [127.0.0.1:0, 127.0.0.1:0]}\noptimizer: {clip_norm: 1}", [],
     ["optimizer.clip_norm: clips on one PS process, not 2 shards (a variable above runtime.shard_max_mb is cut"]),
    ("an outer optimizer's clip over shards",
     "cluster: {ps: [127.0.0.1:0, 127.0.0.1:0]}\nprotocol: {name: diloco, outer_optimizer: {global_clip_norm: 1}}", [],
     ["protocol.outer_optimizer.global_clip_norm: clips on one PS process, not 2 shards"]),
    # typos get the nearest key
    ("top-level typo", "protcol: {name: bsp}", [], ["protcol: unknown key (did you mean protocol?)"]),
    ("section typo", "protocol: {batchsize: 3}", [], ["protocol.batchsize: unknown key (did you mean batch?)"]),
    ("schedule typo", "optimizer: {schedule: {kind: cosine, decay_step: 100}}", [],
     ["optimizer.schedule.decay_step: unknown key (did you mean decay_steps?)"]),
    ("on_switch typo", "policy: {on_switch: {optimiser_state: reset}}", [],
     ["policy.on_switch.optimiser_state: unknown key (did you mean optimizer_state?)"]),
    ("transient typo", "stragglers: {transient: {duraton_s: 5, every_s: 10}}", [],
     ["stragglers.transient.duration_s: Field required",
      "stragglers.transient.duraton_s: unknown key (did you mean duration_s?)"]),
    ("pipeline depth", "runtime: {pipeline_depth: 2}", [], ["runtime.pipeline_depth: Input should be 0 or 1"]),
    ("pipeline_sync without depth", "runtime: {pipeline_sync: true}", [],
     ["runtime.pipeline_sync: overlaps steps only with runtime.pipeline_depth: 1"]),
    # what builds the run
    ("optimizer param typo", "optimizer: {name: momentum, params: {momentun: 0.9}}", [],
     ["optimizer.params.momentun: unknown key (did you mean momentum?)"]),
    ("optimizer param values", "optimizer: {name: adam, params: {beta_1: 1.5, epsilon: -1}}", [],
     ["optimizer.params.beta_1: beta_1 must be in [0, 1)", "optimizer.params.epsilon: epsilon must be >= 0"]),
    ("schedule order", "optimizer: {schedule: {kind: step, boundaries: [100, 50], values: [1, 2, 3]}}", [],
     ["optimizer.schedule: boundaries must be strictly increasing"]),
    ("schedule extra field", "optimizer: {schedule: {kind: constant, decay_steps: 10}}", [],
     ["optimizer.schedule: schedule 'constant' does not take decay_steps"]),
    ("unknown model", "model: {name: mpl}", [], ["model.name: unknown model 'mpl' (did you mean mlp?)"]),
    ("unimportable model", "model: {name: 'no_such_module_xyz:build'}", [],
     ["model.name: cannot import model function 'no_such_module_xyz:build': No module named"]),
    ("model kwargs typo", "model: {name: mlp, kwargs: {hiden: [64]}}", [],
     ["model.kwargs.hiden: unexpected keyword argument (did you mean hidden?)"]),
    ("model kwargs set by switchps", "model: {name: logreg, kwargs: {num_classes: 3}}", [],
     ["model.kwargs.num_classes: set by switchps"]),
    ("unknown policy", "policy: {name: gredy}", [], ["policy.name: unknown policy 'gredy' (did you mean greedy?)"]),
    ("policy kwargs typo", "policy: {name: greedy, kwargs: {bsp_fracton: 0.5}}", [],
     ["policy.kwargs.bsp_fracton: unexpected keyword argument (did you mean bsp_fraction?)"]),
    ("missing dataset", "data: {name: mnist}", [], [("data.name: mnist: ", "mnist.npz not found; put it there")]),
    ("missing npz", "data: {name: npz, path: nowhere.npz}", [], ["data.path: npz: nowhere.npz not found"]),
    # a key given twice: YAML forbids it, PyYAML alone would keep the later value
    ("duplicate top-level key", "seed: 1\nname: x\nseed: 2\n", [],
     [("config: ", "bad.yaml: duplicate key 'seed' at line 3 (first at line 1)")]),
    ("duplicate nested key", "protocol:\n  name: bsp\n  batch: 8\n  name: asp\n", [],
     [("config: ", "bad.yaml: duplicate key 'protocol.name' at line 4 (first at line 2)")]),
    ("duplicate key in --set", "train: {steps: 10}", ["model.kwargs={width: 1, width: 2}"],
     ["model.kwargs: --set value '{width: 1, width: 2}' has a duplicate key 'width' at line 1 (first at line 1)"]),
    # several at once, in the schema's order
    ("many at once", "protocol: {name: gossip, batch: 0}\noptimizer: {learning_rate: -1}\ncluster: {workers: 0}\n"
                     "bogus: 1\n", [],
     ["cluster.workers: need at least one worker", "optimizer.learning_rate: Input should be greater than 0",
      "protocol.name: unknown protocol 'gossip'", "protocol.batch: Input should be greater than 0",
      "bogus: unknown key"]),
    # local steps (issue 46)
    ("local_steps 0", "protocol: {name: local_sgd, local_steps: 0}", [],
     ["protocol.local_steps: Input should be greater than or equal to 1 (got 0)"]),
    ("an inner optimizer nobody has", "protocol: {name: diloco, inner_optimizer: {name: lion}}", [],
     ["protocol.inner_optimizer.name: unknown optimizer 'lion'; expected one of sgd"]),
    ("an inner parameter its optimizer lacks",
     "protocol: {name: bsp, local_steps: 4, inner_optimizer: {name: adamw, params: {momentum: 0.9}}}", [],
     ["protocol.inner_optimizer.params.momentum: unknown key; adamw takes beta_1, beta_2, epsilon, weight_decay"]),
    ("a negative outer rate", "protocol: {name: async_diloco, outer_optimizer: {name: sgd, learning_rate: -1}}", [],
     ["protocol.outer_optimizer.learning_rate: Input should be greater than 0 (got -1)"]),
    ("--set bad value", "train: {steps: 10}", ["protocol.batch=lots"],
     ["protocol.batch: Input should be a valid integer, unable to parse string as an integer (got 'lots')"]),
    ("--set malformed twice", "train: {steps: 10}", ["protocol.batch", "model.kwargs={hidden: [1"],
     ["--set 'protocol.batch': expected key.path=value", "model.kwargs: --set value '{hidden: [1' is not valid YAML"]),
]


def _write(tmp_path: Path, content: object) -> Path:
    path = tmp_path / "bad.yaml"
    if content is DIRECTORY:
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        path.write_text(content)
    return path


def _check(err: str, expected: list[str | tuple[str, ...]]) -> None:
    """One line per expected problem, in order, each holding its fragment(s) (the field first)."""
    lines = err.strip().splitlines()
    assert len(lines) == len(expected), err
    for line, fragments in zip(lines, expected):
        for fragment in (fragments,) if isinstance(fragments, str) else fragments:
            assert line.startswith(PREFIX) and fragment in line, (fragment, err)
    assert "Traceback" not in err


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """An empty dataset cache, the temp dir as cwd, and no launcher: a config that passes fails the test."""
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))

    def launched(*args, **kwargs):
        raise AssertionError("the config was accepted and the launcher started")

    monkeypatch.setattr(switchps.launch.launcher, "launch", launched)
    return tmp_path


@pytest.mark.parametrize("content, overrides, expected", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_config_exits_2_before_launching(isolated, capsys, content, overrides, expected):
    path = _write(isolated, content)
    args = [f"--set={o}" for o in overrides]
    assert main(["run", str(path), *args]) == 2
    _check(capsys.readouterr().err, expected)


BOUNDS = {at.Gt: ("gt", "greater than", 0), at.Ge: ("ge", "greater than or equal to", -1),
          at.Lt: ("lt", "less than", 0), at.Le: ("le", "less than or equal to", 1)}
"""Each kind of bound: its attribute, pydantic's words, and a step from the bound that breaks it."""


def _sections(annotation: object, tag: str | None = None) -> list[tuple[type[Section], str | None]]:
    """The sections in ``annotation``, each with the tag that picks it in a discriminated union (a
    protocol's name), if any."""
    if isinstance(annotation, type) and issubclass(annotation, Section):
        return [(annotation, tag)]
    if get_origin(annotation) in (list, dict):  # its items' fields are no --set path (their bounds: as sections)
        return []
    tags = [a.tag for a in get_args(annotation) if isinstance(a, Tag)]
    return [s for a in get_args(annotation) for s in _sections(a, tags[0] if tags else tag)]


def _bounded(model: type[Section] = RunConfig, prefix: str = "", setup: tuple[str, ...] = (),
             wrap: Callable[[list[str]], list[str]] = lambda lines: lines) -> list[tuple[list[str], str, list[str]]]:
    """For every bound on a number anywhere in the schema: the ``--set``s that break it just past the bound
    (a union member's after the one that picks it), and the lines the report must be, in the schema's order
    (the field's, and any required field left out of its section and of the sections around it: ``wrap``)."""
    cases = []
    for name, field in model.model_fields.items():
        def around(inner: list[str], name: str = name) -> list[str]:
            """This section's lines, with ``inner`` where field ``name``'s go."""
            return wrap([line for other, f in model.model_fields.items()
                         for line in (inner if other == name else [f"{prefix}{other}: Field required"]
                                      if f.is_required() else [])])
        for bound in (m for m in field.metadata if type(m) in BOUNDS):
            attr, phrase, step = BOUNDS[type(bound)]
            limit = getattr(bound, attr)
            cases.append(([*setup, f"{prefix}{name}={limit + step}"], type(bound).__name__,
                          around([f"{prefix}{name}: Input should be {phrase} {limit} (got {limit + step})"])))
        for section, tag in _sections(field.annotation):
            if tag != "unknown":  # a name that is no protocol's: reported on its own (test_config_protocols)
                cases += _bounded(section, f"{prefix}{name}.", (*setup, *([f"{prefix}{name}.name={tag}"] * bool(tag))),
                                  around)
    return cases


BOUNDED = _bounded()


def test_the_bounds_are_found_in_every_nested_section():
    """The generated cases below reach the deepest sections (an empty list would pass them vacuously)."""
    fields = {overrides[-1].partition("=")[0] for overrides, *_ in BOUNDED}
    assert {"seed", "protocol.batch", "cluster.ray.ps.num_cpus", "runtime.cpu.worker_nice",
            "stragglers.transient.duration_s", "policy.on_switch.state_scale"} <= fields
    picked = {o for overrides, *_ in BOUNDED for o in overrides[:-1]}
    assert {f"protocol.name={n}" for n in names.PROTOCOLS} <= picked, "every protocol's member"


@pytest.mark.parametrize("overrides, bound, expected", BOUNDED, ids=[f"{','.join(o)}:{b}" for o, b, _ in BOUNDED])
def test_every_bound_in_the_schema_is_one_line_naming_its_field(overrides, bound, expected):
    """Derived from the models: each number's bound, broken, is reported on its field's line (and only
    there), whatever section (or protocol) it sits in."""
    with pytest.raises(ConfigError) as err:
        parse_config({}, overrides)
    assert err.value.problems == expected


@contextmanager
def _unprivileged():
    """chmod 000 does not stop root: run the block with an unprivileged effective uid (or skip)."""
    if os.geteuid() != 0:
        yield
        return
    try:
        os.seteuid(65534)
    except OSError as e:
        pytest.skip(f"running as root and cannot drop privileges: {e}")
    try:
        yield
    finally:
        os.seteuid(0)


def test_unreadable_file(tmp_path, capsys):
    path = tmp_path / "secret.yaml"
    path.write_text("train: {steps: 1}\n")
    path.chmod(0)  # unreadable: nothing inside it is checked
    try:
        with _unprivileged():
            code = main(["ps", str(path)])
    finally:
        path.chmod(0o600)
    assert code == 2
    _check(capsys.readouterr().err, [f"config: cannot read {path}: Permission denied"])


def _script(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k != "PYTHONPATH"}
    return subprocess.run([SWITCHPS, *args], capture_output=True, text=True, timeout=120, cwd=cwd, env=env)


def test_console_script_reports_everything_at_once(tmp_path):
    (tmp_path / "bad.yaml").write_text("cluster: {workers: 1.0e+10}\nprotocol: {batchsize: 8}\n"
                                       "optimizer: {learning_rate: 1e999}\nmodel: {name: mlp, kwargs: {hiden: [8]}}\n")
    proc = _script("run", "bad.yaml", "--set", "seed=-1", cwd=tmp_path)
    assert proc.returncode == 2
    _check(proc.stderr, ["seed: ", "cluster.workers: at most 1024", "model.kwargs.hiden: ", "optimizer.learning_rate: ",
                         "protocol.batchsize: unknown key (did you mean batch?)"])
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("role", [["worker", "--index", "0"], ["evaluator"]])
def test_worker_and_evaluator_say_where_the_dataset_goes(tmp_path, role):
    (tmp_path / "cfg.yaml").write_text("data: {name: cifar10}\nsecurity: {insecure: true}\n")
    proc = _script(role[0], "cfg.yaml", *role[1:], cwd=tmp_path, env={"KERAS_HOME": str(tmp_path / "k")})
    assert proc.returncode == 2
    where = tmp_path / "k" / "datasets" / "cifar-10-batches-py" / "data_batch_1"
    _check(proc.stderr, [f"data.name: cifar10: {where} not found; put it there"])


USER_MODELS = textwrap.dedent("""
    def tiny(input_shape, num_classes, width=8):
        import keras

        x = keras.Input(shape=input_shape, name="x")
        h = keras.layers.Dense(width, activation="relu", name="h")(keras.layers.Flatten(name="flat")(x))
        return keras.Model(x, keras.layers.Dense(num_classes, name="logits")(h))
""")
SWITCHING = (Path(__file__).resolve().parent.parent / "docs" / "switching.md").read_text()
USER_POLICIES = SWITCHING.split("```python\n# my_policies.py\n", 1)[1].split("```", 1)[0]
"""The documentation's own example policy (docs/switching.md), so that it cannot drift from what runs."""


@pytest.fixture
def user_dir(tmp_path):
    (tmp_path / "my_models.py").write_text(USER_MODELS)
    (tmp_path / "my_policies.py").write_text(USER_POLICIES)
    return tmp_path


def test_user_modules_resolve_from_the_working_directory(user_dir):
    """The console script does not put the cwd on sys.path; the kwargs checks prove both modules were imported."""
    (user_dir / "cfg.yaml").write_text("model: {name: 'my_models:tiny', kwargs: {widht: 4}}\n"
                                       "policy: {name: 'my_policies:AspAfterLoss', kwargs: {belo: 0.5}}\n")
    proc = _script("run", "cfg.yaml", cwd=user_dir)
    assert proc.returncode == 2
    _check(proc.stderr, ["model.kwargs.widht: unexpected keyword argument (did you mean width?)",
                         "policy.kwargs.belo: unexpected keyword argument (did you mean below?)"])


@pytest.mark.integration
def test_readme_user_policy_and_model_run_from_the_working_directory(user_dir):
    (user_dir / "cfg.yaml").write_text("cluster: {workers: 1}\nmodel: {name: 'my_models:tiny', kwargs: {width: 4}}\n"
                                       "policy: {name: 'my_policies:AspAfterLoss', kwargs: {below: 5.0}}\n"
                                       "train: {steps: 5}\neval: {every_s: 0.5}\n")
    proc = _script("run", "cfg.yaml", "--quiet", cwd=user_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = next((user_dir / "runs").iterdir()) / "events.jsonl"
    assert '"policy": "asp_after_loss"' in events.read_text()


def test_ps_finds_a_user_model_without_running_it(tmp_path, monkeypatch):
    """The PS stays free of TensorFlow: it checks that the module exists, and only `run` imports it."""
    (tmp_path / "pkg_boom").mkdir()
    (tmp_path / "pkg_boom" / "__init__.py").write_text("raise RuntimeError('package ran in the PS')\n")
    (tmp_path / "pkg_boom" / "models.py").write_text("def build(input_shape, num_classes):\n    pass\n")
    (tmp_path / "cfg.yaml").write_text("model: {name: 'pkg_boom.models:build'}\nsecurity: {insecure: true}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "pkg_boom", raising=False)
    assert load_config("cfg.yaml", role="ps", checks=PREFLIGHT).model.name == "pkg_boom.models:build"
    assert "pkg_boom" not in sys.modules
    with pytest.raises(ConfigError, match="raised RuntimeError: package ran in the PS"):
        load_config("cfg.yaml", role="run", checks=PREFLIGHT)
    (tmp_path / "cfg.yaml").write_text("model: {name: 'pkg_boom.nothing:build'}\nsecurity: {insecure: true}\n")
    with pytest.raises(ConfigError, match="model.name: .*No module named 'pkg_boom.nothing'"):
        load_config("cfg.yaml", role="ps", checks=PREFLIGHT)


def test_zoo_checks_import_no_tensorflow(tmp_path):
    code = textwrap.dedent("""
        import sys
        from switchps.checks import PREFLIGHT
        from switchps.config.run import ConfigError, parse_config
        parse_config({"model": {"name": "cnn", "kwargs": {"filters": [4], "dense": 8}}}, role="run", checks=PREFLIGHT)
        try:
            parse_config({"model": {"name": "cnn", "kwargs": {"filter": [4]}}}, role="run", checks=PREFLIGHT)
        except ConfigError as e:
            print(e)
        print(sorted(m for m in ("keras", "tensorflow") if m in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.stdout.splitlines() == ["model.kwargs.filter: unexpected keyword argument (did you mean filters?)", "[]"]


DUPLICATED = {
    "run": ("train: {steps: 10}\nprotocol:\n  name: bsp\n  batch: 8\nseed: 3\nprotocol: {name: asp}\n",
            "duplicate key 'protocol' at line 6 (first at line 2)"),
    "study": ("study: s\nbase:\n  train: {steps: 5}\narms:\n  a: {}\n  b: {protocol.name: asp}\n"
              "  a: {protocol.name: ssp}\n", "duplicate key 'arms.a' at line 7 (first at line 5)"),
}


@pytest.mark.parametrize("command", sorted(DUPLICATED))
def test_a_key_given_twice_is_one_line_with_both_lines_and_nothing_starts(tmp_path, command):
    content, problem = DUPLICATED[command]
    (tmp_path / "dup.yaml").write_text(content)
    proc = subprocess.run([SWITCHPS, command, "dup.yaml"], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)  # PYTHONPATH kept: the code under test is the one imported
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"{PREFIX}config: dup.yaml: {problem}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dup.yaml"], "no run directory"
