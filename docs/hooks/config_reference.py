"""An mkdocs hook that writes the configuration reference from the pydantic models themselves, so the
site cannot drift from what ``switchps`` accepts.

A page asks for a reference with a line ``<!-- reference switchps.config.run:RunConfig -->``; the hook
replaces it with one table per section (field, type, default, bounds, and the docstring written under
the field in the source), walking nested sections and listing every member of a union of sections
(``Annotated[A | B, Field(discriminator="name")]``) under the value of its discriminator.
Pydantic keeps a field's docstring only with ``use_attribute_docstrings``, so they are read from the
source with ``ast``.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import re
import textwrap
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

MARKER = re.compile(r"^<!-- reference ([\w.]+):(\w+) -->$", re.MULTILINE)
BOUNDS = {annotated_types.Gt: ">", annotated_types.Ge: "≥", annotated_types.Lt: "<", annotated_types.Le: "≤"}


def on_page_markdown(markdown: str, **_: Any) -> str:
    """mkdocs' hook: each marker becomes the reference of the model it names."""
    return MARKER.sub(lambda m: reference(getattr(importlib.import_module(m[1]), m[2])), markdown)


@functools.cache
def docstrings(cls: type) -> dict[str, str]:
    """Each field's docstring, from the string literal after its annotated assignment in ``cls`` and its
    bases (a subclass's wins)."""
    found: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if not (isinstance(base, type) and issubclass(base, BaseModel)) or base is BaseModel:
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(base))).body[0]
        assert isinstance(body, ast.ClassDef)
        for node, after in zip(body.body, body.body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) \
                    and isinstance(after.value.value, str):
                found[node.target.id] = " ".join(after.value.value.split())
    return found


def models_in(annotation: Any) -> list[type[BaseModel]]:
    """The sections ``annotation`` holds: ``X``, ``X | None``, ``list[X]``, a union of several."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in get_args(annotation) for m in models_in(a)]


def type_name(annotation: Any) -> str:
    origin, args = get_origin(annotation), get_args(annotation)
    if annotation is type(None):
        return "None"
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is Literal:
        return " | ".join(f'"{a}"' if isinstance(a, str) else repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(type_name(a) for a in args)}]"
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def bounds(field: FieldInfo) -> str:
    return ", ".join(f"{sign} {getattr(m, type(m).__name__.lower())}"
                     for m in field.metadata for kind, sign in BOUNDS.items() if isinstance(m, kind))


def default(field: FieldInfo, value: Any) -> str:
    if field.is_required():
        return "required"
    return "—" if isinstance(value, BaseModel) else f"`{value!r}`" if value is not None else "`None`"


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def reference(root: type[BaseModel]) -> str:
    """Markdown: a table per section of ``root``, depth first in the order of the fields."""
    out: list[str] = []
    whole = None if any(f.is_required() for f in root.model_fields.values()) else root()
    section(root, "", whole, out, "###")
    return "\n".join(out)


def section(model: type[BaseModel], path: str, instance: BaseModel | None, out: list[str], level: str,
            title: str = "") -> None:
    """One table for ``model`` at ``path``, then the sections below it. ``instance`` gives the defaults
    a section has as a whole (``train``'s ``epochs: 10``) where there is one."""
    heading = title or f"`{path or 'top level'}`"
    out += [f"{level} {heading} {{ #{anchor(path, title)} }}", ""]
    if doc := model.__dict__.get("__doc__"):
        out += [" ".join(doc.split()), ""]
    out += ["| field | type | default | bounds | description |", "|---|---|---|---|---|"]
    nested: list[tuple[str, FieldInfo, Any]] = []
    for name, field in model.model_fields.items():
        value = getattr(instance, name) if instance is not None else field.get_default(call_default_factory=True)
        where = f"{path}.{name}" if path else name
        text = docstrings(model).get(name, "")
        if models_in(field.annotation):
            nested.append((where, field, value))
            text = (text + " " if text else "") + f"See [`{where}`](#{anchor(where)})."
        out.append(f"| `{name}` | {cell(type_name(field.annotation))} | {cell(default(field, value))} "
                   f"| {bounds(field)} | {cell(text)} |")
    out.append("")
    for where, field, value in nested:
        members = models_in(field.annotation)
        if len(members) == 1:
            section(members[0], where, value if isinstance(value, members[0]) else None, out, level)
            continue
        key = field.discriminator if isinstance(field.discriminator, str) else None
        out += [f"{level} `{where}` {{ #{anchor(where)} }}", "",
                f"One of {len(members)} forms" + (f", told apart by `{key}`" if key else "") + ":", ""]
        for i, member in enumerate(members):
            tag = f"`{key}: {type_name(member.model_fields[key].annotation)}`" if key else f"form {i + 1}"
            section(member, where, value if isinstance(value, member) else None, out, level + "#",
                    f"`{where}`, {tag}")


def anchor(path: str, title: str = "") -> str:
    """A heading's id: the field's path with dashes (``cluster-ray``), and a union member's tag after it."""
    return re.sub(r"[^\w]+", "-", f"{path or 'top-level'} {title.split(',', 1)[1] if title else ''}".lower()).strip("-")
