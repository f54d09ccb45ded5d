"""A stage's findings, kept in its JSON file as they come (so a stage cut short leaves its rows)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def _plain(x: Any) -> Any:
    """numpy / jax scalars as Python numbers, anything else JSON cannot hold as text."""
    return x.item() if hasattr(x, "item") else str(x)


def describe_error(e: BaseException, limit: int = 300) -> str:
    """`Type: first line of the message`, cut to `limit` characters."""
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"[:limit]


def write_json(path: Path, data: Any) -> None:
    """Write through a temporary file and rename, so a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=_plain))
    os.replace(tmp, path)


class StageRecord:
    """`info` (facts about the run), `rows` (one per measured case), `problems` (what failed:
    any problem fails the stage) and `error` (the exception that ended it, if one did)."""

    def __init__(self, path: Path, name: str) -> None:
        self.path = path
        self.data: dict[str, Any] = {"name": name, "info": {}, "rows": [], "problems": [], "error": None}
        self.save()

    def info(self, **facts: Any) -> None:
        self.data["info"].update(facts)
        self.save()

    def row(self, row: dict[str, Any]) -> None:
        self.data["rows"].append(row)
        self.save()

    def problem(self, text: str) -> None:
        self.data["problems"].append(text)
        self.save()

    def error(self, text: str) -> None:
        self.data["error"] = text
        self.save()

    def save(self) -> None:
        write_json(self.path, self.data)
