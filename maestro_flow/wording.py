"""Small phrases shared by the messages of several commands (standard library only).

`count(3, "row")` -> "3 rows"; `cut(text, 80)` -> the text, or its first 77 characters and
"..."; `skipped_note(n)` -> " (n bad rows skipped)", or "" for none.
"""

from __future__ import annotations


def count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def skipped_note(skipped: int) -> str:
    """What `validate` and `run` add after the sample count when the source skipped bad rows."""
    return f" ({count(skipped, 'bad row')} skipped)" if skipped else ""
