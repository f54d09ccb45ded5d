"""Sessions on disk: one JSON file per session, replaced atomically, so a crash loses no turn.

A write goes to a temporary file in the same directory (a name the loader never reads: it
starts with "." and ends with ".tmp"), is flushed to the disk (`fsync`), and then renamed over
the session's file (`os.replace`, atomic on POSIX), and the directory entry is synced too. A
process killed at any instant leaves the file at its previous or its new content, plus at
worst a stray temporary file, which the next start removes.

Reading trusts nothing: a file that does not parse, or whose record the caller refuses, is moved
to `quarantine/` with a warning (kept for a person to look at, never silently lost).
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# a session's id, a stored response's, a conversation's (the Conversations API)
SESSION_PREFIX, RESPONSE_PREFIX, CONVERSATION_PREFIX = "sess_", "resp_", "conv_"
SESSION_ID = re.compile(r"^(sess|resp|conv)_[0-9a-f]{24}$")
QUARANTINE = "quarantine"
_TEMP_PREFIX, _TEMP_SUFFIX = ".write-", ".tmp"


class SessionFiles:
    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def _path(self, session_id: str) -> Path:
        if not SESSION_ID.match(session_id):
            raise ValueError(f"not a session id: {session_id!r}")
        return self.directory / f"{session_id}.json"

    def save(self, record: dict[str, Any]) -> None:
        """Replace the session's file with `record` (atomic; raises OSError on failure)."""
        path = self._path(record["id"])
        data = json.dumps(record, ensure_ascii=False).encode("utf-8")
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=_TEMP_PREFIX, suffix=_TEMP_SUFFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._sync_directory()

    def delete(self, session_id: str) -> None:
        self._path(session_id).unlink(missing_ok=True)
        self._sync_directory()

    def _sync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def records(self) -> Iterator[tuple[Path, Any]]:
        """(file, parsed JSON) for each session file; removes stray temporary files, and
        quarantines files that are not named like a session or do not parse."""
        for path in sorted(self.directory.iterdir()):
            if not path.is_file():
                continue
            if path.name.startswith(_TEMP_PREFIX) and path.name.endswith(_TEMP_SUFFIX):
                logger.info("removing %s, left by a write that did not finish", path)
                path.unlink(missing_ok=True)
                continue
            if path.suffix != ".json":
                continue
            if not SESSION_ID.match(path.stem):
                self.quarantine(path, "the file name is not a session id")
                continue
            try:
                yield path, json.loads(path.read_bytes().decode("utf-8"))
            except (OSError, ValueError) as e:  # truncated, not UTF-8, not JSON
                self.quarantine(path, f"it does not parse: {e}")

    def quarantine(self, path: Path, reason: str) -> None:
        """Move a session file the server cannot use to `quarantine/`, with a warning."""
        folder = self.directory / QUARANTINE
        folder.mkdir(exist_ok=True)
        target = folder / path.name
        os.replace(path, target)
        logger.warning("session file %s is unusable (%s); moved to %s", path.name, reason, target)
