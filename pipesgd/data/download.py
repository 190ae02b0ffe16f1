"""Getting dataset files onto local disk safely: cache location, a cross-process lock, atomic
writes, and fetching a URL with an md5 check.

Every writer here goes through a temporary name in the destination directory and ``os.replace``,
so a reader never sees a partial file or directory, and any failure (including Ctrl-C) deletes
the temporary. Network access happens only in :func:`download`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import http.client
import logging
import os
import shutil
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from pipesgd.data.errors import DatasetError

try:
    import fcntl
except ImportError:  # not POSIX: prepare() is then only safe from one process at a time
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

CACHE_ENV = "PIPESGD_CACHE"
_CHUNK = 1 << 20


def _writable(path: Path) -> bool:
    """Whether ``path`` is, or could be created as, a directory this process can write into.

    A directory with no write bit at all counts as read-only even for root (who may write
    anywhere), so a shared data directory marked ``a-w`` is never used as a cache.
    """
    p = path.absolute()
    while not p.exists():
        if p.parent == p:
            return False
        p = p.parent
    return p.is_dir() and os.access(p, os.W_OK | os.X_OK) and bool(p.stat().st_mode & 0o222)


def resolve_cache_dir(root: Path, cache_dir: str | os.PathLike[str] | None) -> Path:
    """Where extracted or downloaded files go: ``cache_dir`` if given, else ``root`` if it is
    writable, else ``$PIPESGD_CACHE``, else ``~/.cache/pipesgd``. Only inspects the disk."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if _writable(root):
        return root
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pipesgd"


def make_dir(path: Path) -> Path:
    """``mkdir -p`` that fails with a DatasetError saying how to pick another directory."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DatasetError(
            f"cannot create cache directory {path}: {e.strerror or e}; "
            f"set data.cache_dir (or ${CACHE_ENV}) to a writable directory"
        ) from e
    if not os.access(path, os.W_OK | os.X_OK):
        raise DatasetError(
            f"cache directory {path} is not writable; "
            f"set data.cache_dir (or ${CACHE_ENV}) to a writable directory"
        )
    return path


@contextlib.contextmanager
def dir_lock(directory: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``directory`` itself (flock on the directory, so no lock
    file is left behind). Serialises concurrent ``prepare()`` calls on one cache directory."""
    if fcntl is None:
        yield
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process that is preparing data in %s", directory)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a fresh empty directory beside ``final``; rename it to ``final`` when the block
    succeeds, delete it when the block raises. If ``final`` appeared meanwhile (another process
    won a race), it is kept and ours is discarded."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        try:
            os.replace(tmp, final)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not final.is_dir():
                raise
            log.info("%s was created concurrently; keeping that copy", final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def atomic_file(final: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``final`` for the block to write; rename it to ``final``
    when the block succeeds, delete it when the block raises."""
    fd, name = tempfile.mkstemp(prefix=f".{final.name}.part-", dir=final.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600
        os.replace(tmp, final)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def local_source(url: str) -> Path | None:
    """The local file a ``file://`` URL or a plain path names, or None for a network URL."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "file":
        return Path(urllib.request.url2pathname(parsed.path))
    if parsed.scheme == "" or len(parsed.scheme) == 1:  # a plain path (or a Windows drive letter)
        return Path(url).expanduser()
    return None


def download(
    url: str,
    dest: Path,
    *,
    md5: str | None = None,
    check: Callable[[Path], object] | None = None,
    timeout: float = 60.0,
) -> str:
    """Fetch ``url`` to ``dest`` atomically and return the md5 of the bytes received.

    With ``md5`` the bytes must match it; ``check(tmp_path)`` may inspect the complete file before
    it is renamed into place and raise DatasetError to reject it. On any failure nothing is left
    at ``dest`` or beside it.
    """
    log.info("downloading %s -> %s", url, dest)
    start = time.perf_counter()
    request = urllib.request.Request(url, headers={"User-Agent": "pipesgd"})
    with atomic_file(dest) as tmp:
        h = hashlib.md5()
        received = 0
        try:
            with urllib.request.urlopen(request, timeout=timeout) as resp, open(tmp, "wb") as out:
                length = resp.headers.get("Content-Length")
                while chunk := resp.read(_CHUNK):
                    out.write(chunk)
                    h.update(chunk)
                    received += len(chunk)
                out.flush()
                os.fsync(out.fileno())  # the rename below must not publish unwritten blocks
        except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
            reason = getattr(e, "reason", None) or e
            raise DatasetError(f"could not download {url}: {reason}") from e
        if length is not None and length.isdigit() and int(length) != received:
            raise DatasetError(
                f"truncated download of {url}: got {received} of {int(length)} bytes"
            )
        actual = h.hexdigest()
        if md5 is not None and actual != md5.lower():
            raise DatasetError(
                f"md5 mismatch for {url} (downloaded to {dest}): expected {md5}, got {actual}"
            )
        if check is not None:
            check(tmp)
    log.info("downloaded %s (%.1f MB in %.1f s)", dest, received / 1e6, time.perf_counter() - start)
    return actual
