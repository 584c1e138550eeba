"""Shared pydantic configuration and file I/O for every contract."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, ClassVar, TypeVar

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
    )


class GalvaFile(GalvaModel):
    """A top-level Galva file: carries ``schema_version`` and a ``kind`` tag so files are never misread."""

    KIND: ClassVar[str]

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


def load_json_object(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a JSON file that must hold an object; every failure is a :class:`SchemaError` naming the file."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise SchemaError("file not found", source=str(path)) from None
    except OSError as err:
        raise SchemaError(f"cannot read file: {err.strerror}", source=str(path)) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        message = f"not valid JSON: {err.msg} at line {err.lineno} column {err.colno}"
        raise SchemaError(message, source=str(path)) from None
    if not isinstance(data, dict):
        raise SchemaError(f"expected a JSON object, got {type(data).__name__}", source=str(path))
    return data


def _src(source: str | os.PathLike[str] | None) -> str | None:
    return None if source is None else str(source)
