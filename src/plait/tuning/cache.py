"""The tuning cache: decisions that outlive the job, keyed by what they depend on.

One JSON file holds a fingerprint (device name and count, torch, NCCL and plait versions)
and the decisions by signature key. A file that cannot be read, is not a tuning cache, or
was written for another fingerprint is ignored with one warning line naming it and why;
tuning starts afresh and the next save replaces it. Saving merges with what other jobs
wrote meanwhile, under an advisory lock, and replaces the file atomically, so concurrent
jobs never leave a torn file.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from plait.tuning.decide import Decision

FORMAT = "plait-tuning/1"
ENV = "PLAIT_TUNING_CACHE"  # a path, or "off"
OFF = "off"


def default_path() -> Path | None:
    """`$PLAIT_TUNING_CACHE` ("off": none), else the user's cache directory."""
    env = os.environ.get(ENV)
    if env is not None:
        return None if env.strip().lower() in (OFF, "") else Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "plait" / "tuning.json"


class TuningCache:
    """Decisions read from and written to `path` (None: kept in memory only)."""

    def __init__(self, path: Path | None, fingerprint: Mapping[str, str],
                 warn: Callable[[str], None]) -> None:
        self.path, self.fingerprint, self.warn = path, dict(fingerprint), warn

    def load(self) -> dict[str, Decision]:
        if self.path is None or not self.path.exists():
            return {}
        read = self._read(self.path, self.warn)
        if read is None:
            return {}
        fingerprint, entries = read
        if fingerprint != self.fingerprint:
            differs = sorted(k for k in {*fingerprint, *self.fingerprint}
                             if fingerprint.get(k) != self.fingerprint.get(k))
            self.warn(f"tuning cache {self.path} was written for another machine or "
                      f"version ({', '.join(differs)} differ): its {len(entries)} decisions "
                      "are ignored and tuning starts afresh")
            return {}
        return entries

    @staticmethod
    def _read(path: Path, warn: Callable[[str], None]
              ) -> tuple[dict[str, str], dict[str, Decision]] | None:
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict) or data.get("format") != FORMAT:
                raise ValueError(f"not a {FORMAT} file")
            fingerprint = {str(k): str(v) for k, v in dict(data["fingerprint"]).items()}
            entries = {str(k): Decision.from_dict(v) for k, v in dict(data["entries"]).items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            warn(f"tuning cache {path} is unreadable ({type(exc).__name__}: {exc}): "
                 "it is ignored and tuning starts afresh")
            return None
        return fingerprint, entries

    def save(self, decisions: Mapping[str, Decision]) -> None:
        """Merge `decisions` into the file (theirs kept for other keys), atomically."""
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with _locked(self.path):
                entries: dict[str, Decision] = {}
                if self.path.exists():
                    read = self._read(self.path, _ignore)  # another job's torn write
                    if read is not None and read[0] == self.fingerprint:
                        entries = read[1]
                entries.update(decisions)
                _write_atomic(self.path, {
                    "format": FORMAT, "fingerprint": self.fingerprint,
                    "entries": {k: d.to_dict() for k, d in sorted(entries.items())}})
        except OSError as exc:
            self.warn(f"tuning cache {self.path} could not be written ({exc}): decisions "
                      "are kept for this job only")

def _ignore(_: str) -> None:
    return None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An advisory lock beside `path` (POSIX), so read-merge-write is one job at a time."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: the atomic replace alone
        yield
        return
    with open(f"{path}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _write_atomic(path: Path, data: Mapping[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
