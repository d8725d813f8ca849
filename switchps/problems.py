"""Everything wrong with a config as one report: one line per problem, each naming its field.

Pydantic reports every schema error at once; ``describe`` turns them into lines
(``protocol.batch: ...``), adds the nearest valid key to unknown ones, and keeps
only the union alternative that fits the input (``workers: 1e10`` is about the
count, not about a list of addresses). Validators that find several problems
raise ``Problems`` so that each one gets its own line and field.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterable
from typing import Any, get_args

from pydantic import BaseModel, Tag, ValidationError

Problem = tuple[str, str]
"""(sub-path below the field being validated, "" for the field itself; message)."""


class ConfigError(ValueError):
    """A bad config: ``problems`` holds one line per problem, each starting with the field it names."""

    def __init__(self, *problems: str) -> None:
        self.problems = [" ".join(p.split()) for p in problems]  # one line each, whatever the source said
        super().__init__("\n".join(self.problems))


class Problems(ValueError):
    """Raised by a validator to report several problems, each at its own path below the field."""

    def __init__(self, items: list[Problem]) -> None:
        self.items = items
        super().__init__("; ".join(f"{path}: {msg}" if path else msg for path, msg in items))


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean X?)`` for the closest of ``choices``, or "" when none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def under(prefix: str, problems: list[Problem]) -> list[Problem]:
    """``problems`` re-rooted below ``prefix`` (a sub-path of the field being validated)."""
    return [(f"{prefix}.{path}" if path else prefix, msg) for path, msg in problems]


def kwargs_problems(fn: Callable[..., Any], kwargs: dict[str, Any], fixed: dict[str, Any]) -> list[Problem]:
    """Why ``fn(**fixed, **kwargs)`` would not bind, per keyword, with the nearest accepted name.

    ``fixed`` are the arguments switchps passes itself, so they are not the user's to give.
    """
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no introspectable signature: the call itself will tell
        return []
    named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in fixed]
    open_ended = any(p.kind is p.VAR_KEYWORD for p in params.values())
    bad = [(k, "set by switchps, not in kwargs") for k in kwargs if k in fixed]
    bad += [(k, "unexpected keyword argument" + (did_you_mean(k, named) or f"; takes {', '.join(named) or 'none'}"))
            for k in kwargs if k not in fixed and k not in named and not open_ended]
    if bad:
        return bad
    try:
        inspect.signature(fn).bind(**fixed, **kwargs)
    except TypeError as e:
        return [("", str(e))]
    return []


def _model_in(annotation: Any, tags: frozenset[str] = frozenset()) -> type[BaseModel] | None:
    """The model class inside ``annotation`` (``X``, ``X | None``; of a discriminated union, the member
    whose ``Tag`` is in ``tags``), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    args = get_args(annotation)
    tagged = [a for a in args if any(isinstance(m, Tag) and m.tag in tags for m in get_args(a))]
    return next((m for a in tagged or args if (m := _model_in(a, tags)) is not None), None)


def _fields_at(root: type[BaseModel], path: list[Any], tags: frozenset[str] = frozenset()) -> list[str]:
    """Field names of the section at ``path`` (none if ``path`` is not a section; ``tags``: the union
    members pydantic's location names)."""
    cls: type[BaseModel] | None = root
    for part in path:
        field = cls.model_fields.get(str(part)) if cls else None
        cls = _model_in(field.annotation, tags) if field else None
    return list(cls.model_fields) if cls else []


def _locate(loc: tuple[Any, ...], raw: Any, keep_last: bool) -> tuple[list[Any], tuple[Any, ...] | None, bool]:
    """Split pydantic's ``loc`` into the path present in the input and the union alternative tried.

    Parts of ``loc`` that are not in the input name union alternatives (``int``,
    ``list[str]``), except a missing field's own name (``keep_last``). Returns
    (path, the union's path or None if no union was involved, whether the
    alternative fits the input there).
    """
    node, path, union, fits = raw, [], None, True
    for i, part in enumerate(loc):
        if isinstance(node, dict) and part in node or isinstance(node, list) and isinstance(part, int) \
                and 0 <= part < len(node):
            node = node[part]
            path.append(part)
        elif keep_last and i == len(loc) - 1:
            path.append(part)
        elif union is None:
            union, fits = tuple(path), _fits(str(part), node)
    return path, union, fits


def _fits(tag: str, value: Any) -> bool:
    """Whether union alternative ``tag`` is the one the input was meant for: a sequence, a mapping (a
    ``dict[...]`` or a model, which pydantic tags by its class name) or a scalar."""
    tag = tag.removeprefix("function-after[").rpartition(", ")[2] if tag.startswith("function-after[") else tag
    sequence, model = tag.startswith(("list[", "tuple[", "set[")), tag[:1].isupper()
    mapping = tag.startswith("dict[") or model
    if isinstance(value, dict):
        return mapping
    return sequence if isinstance(value, list) else not (sequence or mapping)


def _message(e: Any, root: type[BaseModel], path: list[Any]) -> str:
    if e["type"] == "extra_forbidden":
        tags = frozenset(map(str, e["loc"]))
        return "unknown key" + did_you_mean(str(path[-1]), _fields_at(root, path[:-1], tags))
    return e["msg"].removeprefix("Value error, ")


def _got(e: Any) -> str:
    """`` (got X)`` for a scalar input that pydantic's message does not show."""
    if e["type"] in ("value_error", "extra_forbidden") or not isinstance(e["input"], (str, int, float)):
        return ""
    shown = repr(e["input"])
    return f" (got {shown if len(shown) <= 40 else shown[:37] + '...'})"


def _line(path: list[Any], msg: str) -> str:
    return f"{'.'.join(str(p) for p in path)}: {msg}" if path else msg


Alternative = tuple[bool, list[Any], str, str]
"""One union alternative's error: (whether it fits the input's shape, path, message, got)."""


def _union_lines(alternatives: list[Alternative]) -> list[str]:
    """A failed union: the alternatives that fit the input's shape (all if none does), one line per path."""
    kept = [a for a in alternatives if a[0]] or alternatives
    by_path: dict[str, tuple[list[Any], str, list[str]]] = {}
    for _, path, msg, got in kept:
        by_path.setdefault(".".join(map(str, path)), (path, got, []))[2].append(msg)
    return [_line(path, "; or ".join(dict.fromkeys(msgs)) + got) for path, got, msgs in by_path.values()]


def describe(err: ValidationError, raw: Any, root: type[BaseModel]) -> list[str]:
    """One line per problem in ``err`` (validated from ``raw`` as ``root``), in the schema's order."""
    entries: list[str | list[Alternative]] = []
    unions: dict[tuple[Any, ...], list[Alternative]] = {}
    for e in err.errors():
        path, union, fits = _locate(e["loc"], raw, keep_last=e["type"] == "missing")
        error = e.get("ctx", {}).get("error")
        if isinstance(error, Problems):
            entries += [_line([*path, sub] if sub else path, msg) for sub, msg in error.items]
        elif union is None:
            entries.append(_line(path, _message(e, root, path) + _got(e)))
        else:
            if union not in unions:
                entries.append(unions.setdefault(union, []))
            unions[union].append((fits, path, _message(e, root, path), _got(e)))
    lines = [line for entry in entries for line in ([entry] if isinstance(entry, str) else _union_lines(entry))]
    return list(dict.fromkeys(lines))
