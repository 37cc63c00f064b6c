"""Safe reading of spec files (YAML or JSON) and translation of validation errors.

Only `yaml.safe_load` and `json.loads` are used: a spec file can never execute code.
"""

from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

from plait.errors import SpecError

M = TypeVar("M", bound=BaseModel)


def read_mapping(path: str | Path, what: str) -> dict[str, Any]:
    """Read a YAML or JSON file that must hold a mapping; `what` names it in errors."""
    p = Path(path)
    if not p.is_file():
        raise SpecError(what, f"{str(p)!r} " + ("is not a regular file" if p.exists() else
                                                 "does not exist"),
                        "pass an existing YAML or JSON file")
    try:
        text = p.read_text(encoding="utf-8")
        data = json.loads(text) if p.suffix.lower() == ".json" else yaml.safe_load(text)
    except (UnicodeDecodeError, RecursionError) as exc:
        raise SpecError(what, f"{p} cannot be read: {type(exc).__name__}",
                        "pass a UTF-8 YAML or JSON file of plain (not deeply nested) values"
                        ) from exc
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise SpecError(what, f"{p} is not valid {'JSON' if p.suffix == '.json' else 'YAML'}: "
                        f"{exc}".replace("\n", " "), "correct the file's syntax") from exc
    if not isinstance(data, dict):
        raise SpecError(what, f"{p} holds a {type(data).__name__}, not a mapping",
                        "write the spec as key: value pairs")
    return data


def validate(model: type[M], data: dict[str, Any], what: str) -> M:
    """Build `model` from `data`, turning pydantic's error into a `SpecError` naming the field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "(root)"
        fix = "remove it" if err["type"] == "extra_forbidden" else _fix_hint(model, err)
        raise SpecError(f"{what}.{loc}", err["msg"], fix) from exc


_BOUNDS = {"greater_than": ("gt", ">"), "greater_than_equal": ("ge", ">="),
           "less_than": ("lt", "<"), "less_than_equal": ("le", "<=")}


def _fix_hint(model: type[BaseModel], err: ErrorDetails) -> str:
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind == "finite_number":
        return "use a finite number (no inf or nan)"
    if kind in _BOUNDS and _BOUNDS[kind][0] in ctx:
        return f"use a value {_BOUNDS[kind][1]} {ctx[_BOUNDS[kind][0]]}"
    if kind == "value_error":
        return "correct the value as the message says"
    if kind == "missing":
        return "add it"
    field = _field_at(model, err["loc"])
    if field is not None and field.description:
        return f"set it to {field.description[0].lower()}{field.description[1:]}"
    return "see the field's documentation in the spec class"


def _field_at(model: type[BaseModel], loc: tuple[int | str, ...]) -> FieldInfo | None:
    """The field an error's location names, through nested models (`moe.experts`: the
    `experts` of the model the `moe` field holds)."""
    field: FieldInfo | None = None
    current: type[BaseModel] | None = model
    for part in loc:
        if current is None or (field := current.model_fields.get(str(part))) is None:
            return None
        kinds = typing.get_args(field.annotation) or (field.annotation,)
        current = next((k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)),
                       None)
    return field
