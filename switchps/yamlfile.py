"""Reading a YAML config file, where every way it can fail is one line naming the file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from switchps.problems import ConfigError


def read_yaml(path: Path) -> Any:
    """The YAML document in ``path``; each way reading it can fail is one ConfigError naming the file."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"config: file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"config: {path} is a directory, not a YAML file") from None
    except OSError as e:
        raise ConfigError(f"config: cannot read {path}: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        where = f"byte 0x{data[e.start]:02x} at offset {e.start}"
        raise ConfigError(f"config: {path} is not UTF-8 text ({where})") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"config: {path}: invalid YAML{where}: {getattr(e, 'problem', e)}") from None
    if raw is None:
        raise ConfigError(f"config: {path} is empty (or only comments); a run needs at least one section, "
                          "e.g. train: {epochs: 1}")
    return raw


def apply_override(raw: dict[str, Any], assignment: str) -> None:
    """Apply one ``dotted.key=value`` override; the value is parsed as YAML."""
    key, sep, value = assignment.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set {assignment!r}: expected key.path=value")
    *parents, leaf = key.split(".")
    node = raw
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{key}: {part} is not a section")
        node = child
    try:
        node[leaf] = yaml.safe_load(value)
    except yaml.YAMLError:
        raise ConfigError(f"{key}: --set value {value!r} is not valid YAML") from None
