"""Small phrases shared by the messages of several commands (standard library only).

`count(3, "row")` -> "3 rows"; `cut(text, 80)` -> the text, or its first 77 characters and
"..."; `skipped_note(n)` -> " (n bad rows skipped)", or "" for none; `changed_keys(a, b)` -> where
two settings differ, for a message to name ("config.d_model").
"""

from __future__ import annotations

from typing import Any

ABSENT = object()  # a key one side's dict lacks (not the same as None there)


def count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def skipped_note(skipped: int) -> str:
    """What `validate` and `run` add after the sample count when the source skipped bad rows."""
    return f" ({count(skipped, 'bad row')} skipped)" if skipped else ""


def changed_keys(a: Any, b: Any, levels: int | None = None, where: str = "") -> list[tuple[str, Any, Any]]:
    """The keys where two nested dicts differ, dotted as --set names them, each with both values
    (ABSENT for the side that lacks it). Named `levels` deep (None: all the way; below, a dict is
    one value). A list of dicts with unique "name"s, such as a pipeline's sections, is compared by
    those names, not by position."""
    if isinstance(a, list) and isinstance(b, list) and all(isinstance(x, dict) and "name" in x for x in a + b) and all(
            len({x["name"] for x in xs}) == len(xs) for xs in (a, b)):
        a, b = {x["name"]: x for x in a}, {x["name"]: x for x in b}
    if isinstance(a, dict) and isinstance(b, dict) and levels != 0:
        out = []
        for k in sorted(set(a) | set(b), key=str):
            out += changed_keys(a.get(k, ABSENT), b.get(k, ABSENT), None if levels is None else levels - 1,
                                f"{where}.{k}" if where else str(k))
        return out
    return [] if a == b else [(where, a, b)]
