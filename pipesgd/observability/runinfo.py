"""Facts about a run that are saved next to its numbers: code version, atomic JSON files, file digests."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def git_commit() -> str:
    """The commit of the pipesgd checkout, with ``-dirty`` if it has uncommitted changes."""
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def commit_fields(started: str, ended: str) -> dict[str, str]:
    """summary.json's commit fields: ``git_commit`` is the one the run started on (the code it
    imported); ``git_commit_at_end`` is added only where the checkout moved while it ran (a commit,
    a checkout or an edit beside a long run), so a record never names code it did not run."""
    return {"git_commit": started} if ended == started else {"git_commit": started, "git_commit_at_end": ended}


def write_atomic(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> None:
    """``write(f)`` into a temp file in ``path``'s directory, fsync, then rename over ``path``:
    readers see the old file or the complete new one, never a torn one; a failure (even Ctrl-C)
    deletes the temp file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes it 0600
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def file_digest(path: str | os.PathLike, algorithm: str) -> str:
    """Hex digest of a file's bytes by ``hashlib``'s ``algorithm`` ("sha256", "md5"), read in 1 MiB
    chunks (md5: about 0.5 s per 200 MB)."""
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    """Write ``obj`` as indented JSON with :func:`write_atomic`."""
    text = json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n"
    write_atomic(path, lambda f: f.write(text.encode()))
