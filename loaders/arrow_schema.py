"""The columns an Arrow or Parquet dataset must hold, with their types (`check_schema`), and what
the files of one Parquet folder must share (`folder_difference`). Reads schemas only, never data.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pyarrow as pa

from loaders.arrow_rows import is_binary, is_list, is_string, plain_type
from maestro_flow import ArrowData, PipelineError

_REQUIRED = "id int64, modalities list<string>, tokens list<int32>"
_REQUIRED_COLUMNS = ("id", "modalities", "tokens")

# Column name -> (type check, expected type in words). Required columns first.
_TYPE_RULES: dict[str, tuple[Any, str]] = {
    "id": (pa.types.is_integer, "an integer type (int64)"),
    "modalities": (lambda t: is_list(t) and is_string(t.value_type), "list<string>"),
    "tokens": (lambda t: is_list(t) and pa.types.is_integer(t.value_type), "a list of integers (list<int32>)"),
    "image": (is_binary, "binary"),
    "audio": (lambda t: is_list(t) and pa.types.is_floating(t.value_type), "a list of floats (list<float32>)"),
    "sample_rate": (pa.types.is_integer, "an integer type (int32)"),
    "num_patches": (pa.types.is_integer, "an integer type (int32)"),
    "num_frames": (pa.types.is_integer, "an integer type (int32)"),
}


def check_schema(schema: pa.Schema, data: ArrowData, path: str) -> None:
    """Refuse, in one line naming the column, a dataset (`schema`, read from `path`) without the
    required columns, the columns `data` names, or the types the readers take."""
    names = schema.names
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise PipelineError(f"data.path: column {dup!r} appears twice in {path}")
    for name in _REQUIRED_COLUMNS:
        if name not in names:
            raise PipelineError(
                f"data.path: required column {name!r} is missing in {path} "
                f"(required: {_REQUIRED}; found: {', '.join(names) or 'none'})"
            )
    for modality, column in data.modality_columns.items():
        if column not in names:
            raise PipelineError(f"data.modality_columns.{modality}: no column {column!r} in {path} "
                                f"(columns: {', '.join(names)})")
    for name, (ok, expected) in _TYPE_RULES.items():
        if name in ("image", "audio") and data.column_of(name) != name:
            continue  # the modality's payload is in another column; this one is just data
        if name in names and not ok(plain_type(schema.field(name).type)):
            raise PipelineError(f"data.path: column {name!r} must be {expected}, got {schema.field(name).type} "
                                f"in {path}")
    if data.column_of("audio") in names and "sample_rate" not in names:
        raise PipelineError(f"data.path: column 'audio' needs a 'sample_rate' column (int32) in {path}")


def _columns(schema: pa.Schema) -> list[tuple[str, pa.DataType]]:
    """Names and types, nullability and dictionary encoding left out at every depth (Parquet writers
    vary them; a dictionary-encoded column is read decoded)."""
    return [(f.name, plain_type(f.type)) for f in schema]


def folder_difference(first: pa.Schema, other: pa.Schema) -> str | None:
    """How the schema of a Parquet folder's file differs from its first file's, or None where they
    hold the same columns with the same types. Nullability may differ (what Parquet writers vary),
    and the columns' order: they are read by name (found in QA: files of one dataset written with
    another column order were refused)."""
    a, b = _columns(first), _columns(other)
    if sorted(a, key=lambda c: c[0]) == sorted(b, key=lambda c: c[0]):  # (by name: types do not sort)
        return None
    types_a, types_b = dict(a), dict(b)
    for name in list(types_a) + [n for n in types_b if n not in types_a]:
        if name not in types_b or name not in types_a:
            return f"column {name!r} is only in {'the first' if name in types_a else 'this one'}"
        if types_a[name] != types_b[name]:
            return f"column {name!r} is {types_b[name]} here, {types_a[name]} in the first"
    # The same names and types, a name repeated a different number of times (found in review)
    counts_a, counts_b = Counter(n for n, _ in a), Counter(n for n, _ in b)
    return f"column {next(n for n in counts_a if counts_a[n] != counts_b[n])!r} appears a different number of times"
