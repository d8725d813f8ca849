"""Reading a YAML config file, where every way it can fail is one line naming the file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from switchps.problems import ConfigError

MERGE_TAG = "tag:yaml.org,2002:merge"


class DuplicateKeyError(yaml.YAMLError):
    """A mapping that gives one key twice: YAML forbids it, and PyYAML would silently keep the later value."""


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a duplicate key anywhere in the document, naming its dotted path
    and both lines, so that an edit lower in a file cannot quietly override a setting made above it."""

    def construct_document(self, node: yaml.Node) -> Any:
        self._refuse_duplicates(node, [])
        return super().construct_document(node)

    def _refuse_duplicates(self, node: yaml.Node, path: list[str]) -> None:
        """Walk ``node``'s mappings and sequences; keys compare as constructed (``1`` and ``'1'`` differ).
        Merge keys (``<<``) are YAML's way of overriding on purpose and are not checked."""
        if isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._refuse_duplicates(item, [*path, str(i)])
        if not isinstance(node, yaml.MappingNode):
            return
        first: dict[Any, yaml.Node] = {}
        for key_node, value_node in node.value:
            if key_node.tag == MERGE_TAG or not isinstance(key_node, yaml.ScalarNode):
                continue
            key = self.construct_object(key_node)
            if key in first:
                dotted = ".".join([*path, str(key)])
                raise DuplicateKeyError(f"duplicate key {dotted!r} at line {key_node.start_mark.line + 1} "
                                        f"(first at line {first[key].start_mark.line + 1})")
            first[key] = key_node
            self._refuse_duplicates(value_node, [*path, str(key)])


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
        raw = yaml.load(text, Loader=UniqueKeyLoader)
    except DuplicateKeyError as e:
        raise ConfigError(f"config: {path}: {e}") from None
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
        node[leaf] = yaml.load(value, Loader=UniqueKeyLoader)
    except DuplicateKeyError as e:
        raise ConfigError(f"{key}: --set value {value!r} has a {e}") from None
    except yaml.YAMLError:
        raise ConfigError(f"{key}: --set value {value!r} is not valid YAML") from None
