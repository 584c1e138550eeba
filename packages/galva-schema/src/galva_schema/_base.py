"""Shared pydantic configuration and file I/O for every contract."""

from __future__ import annotations

import json
import os
import types
from collections import abc
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationError

from galva_schema.errors import SchemaError, from_validation_error
from galva_schema.files import write_json_atomic
from galva_schema.vocabulary import SCHEMA_VERSION

T = TypeVar("T", bound="GalvaFile")


class GalvaModel(BaseModel):
    """Frozen, strict-keyed base: unknown keys are errors, values are validated on construction."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        validate_default=True,
        populate_by_name=True,
        protected_namespaces=(),
        allow_inf_nan=False,  # NaN and Infinity are not JSON; a profile holding them is a bug upstream
        # validators are built on a class's first use, not when its module is imported: a command pays only for
        # the files it reads and writes, and a model used only inside another is never built on its own
        defer_build=True,
    )


class GalvaFile(GalvaModel):
    """A top-level Galva file: carries ``schema_version`` and a ``kind`` tag so files are never misread. Files are
    validated strictly (no string or boolean coerced into a number, no number into a boolean)."""

    KIND: ClassVar[str]
    """The file's ``kind`` tag, taken from its class's ``kind`` field (the one place each file type states it)."""

    schema_version: Literal[1] = 1  # SCHEMA_VERSION, stated once for every file type

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        kind = cls.model_fields.get("kind")
        if kind is not None:
            cls.KIND = kind.default

    @classmethod
    def from_dict(cls: type[T], data: Any, *, source: str | os.PathLike[str] | None = None) -> T:
        """Validate a decoded JSON object; errors become a one-line :class:`SchemaError`."""
        if not isinstance(data, dict):
            raise SchemaError(f"expected a JSON object, got {type(data).__name__}", source=_src(source))
        kind = data.get("kind")
        expected = getattr(cls, "KIND", None)
        if expected is not None and kind is not None and kind != expected:
            raise SchemaError(f"kind: expected {expected!r}, got {kind!r} (wrong file type?)", source=_src(source))
        version = data.get("schema_version")
        if version is not None and version != SCHEMA_VERSION:
            raise SchemaError(
                f"schema_version: this galva-schema reads version {SCHEMA_VERSION}, the file has {version!r}",
                source=_src(source),
            )
        problem = strict_problem(cls, data)
        if problem is not None:
            raise SchemaError(problem, source=_src(source))
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            raise from_validation_error(err, _src(source)) from None

    @classmethod
    def load(cls: type[T], path: str | os.PathLike[str]) -> T:
        """Read and validate a JSON file."""
        return cls.from_dict(load_json_object(path), source=path)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (enums as values)."""
        return self.model_dump(mode="json", by_alias=True)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write atomically: a temporary file in the same directory, then rename."""
        return write_json_atomic(path, self.to_dict())


def strict_problem(model: type[BaseModel], data: Any, path: str = "") -> str | None:
    """The first value of ``data`` whose JSON type is not its field's (as the exported JSON Schema says), as
    ``field.path: expected an integer, got '2' (a string)``; None if every number, integer and boolean is one.

    pydantic's lax mode would turn ``"2"`` into 2 and ``"yes"`` into True; a file is a contract, so no coercion.
    """
    if not isinstance(data, dict):
        return None
    by_key = {}
    for name, field in model.model_fields.items():
        by_key[name] = field
        if field.alias:
            by_key[field.alias] = field
    for key, value in data.items():
        if key in by_key:
            problem = _strict_value(by_key[key].annotation, value, f"{path}{key}")
            if problem is not None:
                return problem
    return None


def _strict_value(annotation: Any, value: Any, path: str) -> str | None:
    if value is None or annotation is None:
        return None
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _strict_value(args[0], value, path)
    if origin in (Union, types.UnionType):
        problems = [_strict_value(arg, value, path) for arg in args if arg is not type(None)]
        return None if any(p is None for p in problems) else problems[0]
    if annotation is bool:
        return None if isinstance(value, bool) else _expected(path, "a boolean (true or false)", value)
    if annotation is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        return None if ok else _expected(path, "an integer", value)
    if annotation is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else _expected(path, "a number", value)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return strict_problem(annotation, value, path + ".")
    if origin in (tuple, list, set, frozenset, abc.Sequence) and isinstance(value, list):
        many = origin is not tuple or (len(args) == 2 and args[1] is Ellipsis)
        for index, item in enumerate(value):
            arg = (args[0] if args else None) if many else (args[index] if index < len(args) else None)
            problem = _strict_value(arg, item, f"{path}[{index}]")
            if problem is not None:
                return problem
    if origin in (dict, abc.Mapping) and isinstance(value, dict) and len(args) == 2:
        for key, item in value.items():
            problem = _strict_value(args[1], item, f"{path}.{key}")
            if problem is not None:
                return problem
    return None


def _expected(path: str, what: str, value: Any) -> str:
    kind = {bool: "a boolean", str: "a string", float: "a number", int: "an integer", list: "an array"}.get(
        type(value), "an object" if isinstance(value, dict) else type(value).__name__
    )
    shown = json.dumps(value) if isinstance(value, (str, bool, int, float)) else kind
    return f"{path}: expected {what}, got {shown} ({kind}); files are not coerced"


def load_json_object(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a JSON file that must hold an object; every failure is a :class:`SchemaError` naming the file.

    This is the one reader of Galva's JSON files. A key given twice in one object is refused (``json`` would keep the
    last one silently), and so are a file that is not UTF-8 text and nesting deeper than Python's parser can follow.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SchemaError("file not found", source=str(path)) from None
    except UnicodeDecodeError as err:
        raise SchemaError(f"not a JSON text file (byte {err.start} is not UTF-8)", source=str(path)) from None
    except OSError as err:
        raise SchemaError(f"cannot read file: {err.strerror}", source=str(path)) from None
    try:
        data = json.loads(text, object_pairs_hook=_refuse_duplicate_keys)
    except json.JSONDecodeError as err:
        message = f"not valid JSON: {err.msg} at line {err.lineno} column {err.colno}"
        raise SchemaError(message, source=str(path)) from None
    except _DuplicateKey as err:
        message = f"key {err.key!r} appears twice in one object; JSON readers keep only the last: remove one"
        raise SchemaError(message, source=str(path)) from None
    except RecursionError:
        raise SchemaError("not valid JSON: nested too deeply to read", source=str(path)) from None
    if not isinstance(data, dict):
        raise SchemaError(f"expected a JSON object, got {type(data).__name__}", source=str(path))
    return data


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _src(source: str | os.PathLike[str] | None) -> str | None:
    return None if source is None else str(source)
