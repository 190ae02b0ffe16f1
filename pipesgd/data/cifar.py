"""CIFAR-10, python version: find / fetch / verify / extract the archive, then load its pickles.

Where ``prepare()`` looks, in order:

1. an extracted ``cifar-10-batches-py/`` under ``root`` (or under the cache directory);
2. ``root/cifar-10-python.tar.gz`` (or the same name in the cache directory);
3. ``url``: a local path or ``file://`` URL is read in place; a network URL is downloaded into
   the cache directory, only if ``download``.

Archives are extracted into the cache directory (``cache_dir``, else ``root`` if writable, else
``$PIPESGD_CACHE`` or ``~/.cache/pipesgd``) through a temporary directory renamed into place, so
``root`` may be read-only and no half-extracted tree is ever visible.

md5 policy: a caller-given ``md5`` is strict for whatever archive is used. Without one, a download
of the official URL must match the official md5; any other archive whose md5 differs from the
official one is accepted, with a warning, only if it extracts and validates.

Batches are pickles, read by a restricted unpickler that can only rebuild numpy arrays, so a
crafted file cannot run code.
"""

from __future__ import annotations

import http.client
import logging
import pickle
import tarfile
import zlib
from pathlib import Path, PurePosixPath
from typing import IO, Any

import numpy as np
import torch

from pipesgd.data.base import ImageDataset, check_md5
from pipesgd.data.download import (
    atomic_dir,
    dir_lock,
    download,
    local_source,
    make_dir,
    resolve_cache_dir,
)
from pipesgd.data.errors import DatasetError
from pipesgd.data.split import Split
from pipesgd.observability.runinfo import file_digest

log = logging.getLogger(__name__)

OFFICIAL_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
OFFICIAL_MD5 = "c58f30108f718f92721af3b95e74349a"
OFFICIAL_SIZE = 170_498_071  # bytes
ARCHIVE = "cifar-10-python.tar.gz"
FOLDER = "cifar-10-batches-py"
TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCH = "test_batch"
REQUIRED = (*TRAIN_BATCHES, TEST_BATCH)
_OPTIONAL = ("batches.meta", "readme.html")
ROWS_PER_BATCH = 10_000
_PIXELS = 3 * 32 * 32
_MAX_MEMBER_BYTES = 64 << 20  # a real batch is 31 MB; refuse decompression bombs
_EXPECTED = "expected the CIFAR-10 python archive (cifar-10-batches-py/data_batch_1..5, test_batch)"


def _latin1_encode(text: str, encoding: str = "utf-8") -> bytes:
    """``_codecs.encode`` as Python 3 uses it to write bytes at protocol 2, latin-1 only."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(
            f"unexpected _codecs.encode({type(text).__name__}, {encoding!r})"
        )
    return text.encode("latin1")


# The only globals a batch may reference: numpy array reconstruction (under the module names
# numpy 1.x and 2.x write, protocols 2-5) and latin-1 bytes. None of them can run other code.
_RECONSTRUCT = np.zeros(0).__reduce__()[0]
_FROMBUFFER = np.zeros(0).__reduce_ex__(5)[0]
_SAFE_GLOBALS: dict[tuple[str, str], Any] = {
    ("numpy.core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy._core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy.core.numeric", "_frombuffer"): _FROMBUFFER,
    ("numpy._core.numeric", "_frombuffer"): _FROMBUFFER,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): _latin1_encode,
}


class _BatchUnpickler(pickle.Unpickler):
    """Unpickles a CIFAR batch: builtins plus numpy array reconstruction, nothing else."""

    def __init__(self, file: IO[bytes], path: Path) -> None:
        super().__init__(file, encoding="bytes")
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _SAFE_GLOBALS[(module, name)]
        except KeyError:
            raise DatasetError(
                f"refusing to unpickle {self._path}: it references {module}.{name}; a CIFAR-10 "
                f"batch may only contain numpy arrays, lists, bytes and ints"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise DatasetError(f"refusing to unpickle {self._path}: it uses persistent ids")


def read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """``(data uint8 ROWS x 3072, labels int64 ROWS)`` of one batch file, validated."""
    try:
        with open(path, "rb") as f:
            obj = _BatchUnpickler(f, path).load()
    except DatasetError:
        raise
    except OSError as e:
        raise DatasetError(f"cannot read CIFAR-10 batch {path}: {e.strerror or e}") from e
    except Exception as e:  # a corrupt pickle can fail in many ways; all mean the same here
        raise DatasetError(
            f"corrupt CIFAR-10 batch {path}: {type(e).__name__}: {e}; expected a pickled dict "
            f"with 'data' and 'labels'"
        ) from e
    if not isinstance(obj, dict):
        raise DatasetError(
            f"corrupt CIFAR-10 batch {path}: expected a dict, got {type(obj).__name__}"
        )
    batch = {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in obj.items()}
    data, labels = batch.get("data"), batch.get("labels")
    if (
        not isinstance(data, np.ndarray)
        or data.dtype != np.uint8
        or data.shape != (ROWS_PER_BATCH, _PIXELS)
    ):
        got = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise DatasetError(
            f"bad CIFAR-10 batch {path}: expected 'data' a {ROWS_PER_BATCH}x{_PIXELS} uint8 "
            f"array, got {got}"
        )
    try:
        label_arr = np.asarray(labels, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        label_arr = np.zeros(0, dtype=np.int64)
    if label_arr.shape != (ROWS_PER_BATCH,) or label_arr.min() < 0 or label_arr.max() > 9:
        raise DatasetError(
            f"bad CIFAR-10 batch {path}: expected 'labels' {ROWS_PER_BATCH} integers in 0..9"
        )
    return data, label_arr


def _read_split(folder: Path, names: tuple[str, ...]) -> Split:
    parts = [read_batch(folder / name) for name in names]
    data = np.concatenate([d for d, _ in parts]) if len(parts) > 1 else parts[0][0].copy()
    labels = np.concatenate([y for _, y in parts])
    images = torch.from_numpy(data.reshape(-1, 3, 32, 32))  # rows are R plane, G plane, B plane
    return Split(images=images, labels=torch.from_numpy(labels))


def _complete(folder: Path) -> bool:
    """Whether ``folder`` holds every required batch; DatasetError if it holds only some."""
    if not folder.is_dir():
        return False
    missing = [name for name in REQUIRED if not (folder / name).is_file()]
    if missing:
        raise DatasetError(
            f"incomplete {folder}: missing {', '.join(missing)}; delete it (or restore the files) "
            f"and run again"
        )
    return True


def extract(archive: Path, dest: Path) -> None:
    """Extract the CIFAR batches of ``archive`` to ``dest`` (a ``cifar-10-batches-py``
    directory) atomically, then parse every batch to validate them; DatasetError on any
    problem, with nothing left behind. Only the expected member names are read, as regular
    files, so a crafted archive cannot write elsewhere."""
    wanted = {*REQUIRED, *_OPTIONAL}
    with atomic_dir(dest) as tmp:
        try:
            with tarfile.open(archive, mode="r:gz") as tar:
                for member in tar:
                    parts = PurePosixPath(member.name).parts
                    if len(parts) != 2 or parts[0] != FOLDER or parts[1] not in wanted:
                        continue
                    if not member.isfile() or member.size > _MAX_MEMBER_BYTES:
                        raise DatasetError(
                            f"corrupt archive {archive}: member {member.name} is not a regular "
                            f"file of at most {_MAX_MEMBER_BYTES} bytes; {_EXPECTED}"
                        )
                    src = tar.extractfile(member)
                    assert src is not None  # isfile() members always have data
                    _copy(src, tmp / parts[1])
        except DatasetError:
            raise
        except EOFError as e:  # gzip: "Compressed file ended before the end-of-stream marker"
            raise DatasetError(
                f"truncated archive {archive}: its compressed data stops after "
                f"{archive.stat().st_size} bytes (the official archive has {OFFICIAL_SIZE}); the "
                f"download or copy was cut short: delete it and fetch it again"
            ) from e
        except (tarfile.TarError, zlib.error, OSError) as e:
            raise DatasetError(f"corrupt archive {archive}: {e}; {_EXPECTED}") from e
        missing = [f"{FOLDER}/{name}" for name in REQUIRED if not (tmp / name).is_file()]
        if missing:
            raise DatasetError(
                f"corrupt archive {archive}: missing {', '.join(missing)}; {_EXPECTED}"
            )
        for name in REQUIRED:
            read_batch(tmp / name)


def _copy(src: IO[bytes], dst: Path) -> None:
    """Copy an archive member out; write errors are reported as such, not as a corrupt archive."""
    with open(dst, "wb") as out:
        while chunk := src.read(1 << 20):
            try:
                out.write(chunk)
            except OSError as e:
                raise DatasetError(f"cannot write {dst}: {e.strerror or e}") from e


class CIFAR10(ImageDataset):
    """CIFAR-10: 50,000 train / 10,000 test 3x32x32 images in 10 classes.

    See the module docstring for where the data is looked for and how it is verified.
    ``augment`` turns on the standard random crop (4-pixel padding) + horizontal flip.
    """

    num_classes = 10
    train_size = len(TRAIN_BATCHES) * ROWS_PER_BATCH
    in_channels = 3
    image_size = 32
    mean = (0.4914, 0.4822, 0.4465)
    std = (0.2470, 0.2435, 0.2616)

    def __init__(
        self,
        root: str,
        url: str | None = None,
        md5: str | None = None,
        download: bool = True,
        cache_dir: str | None = None,
        batch_size: int = 128,
        eval_batch_size: int = 1000,
        augment: bool = True,
    ) -> None:
        super().__init__(root, url, download, cache_dir, batch_size, eval_batch_size, augment)
        self.md5 = None if md5 is None else check_md5(type(self).__name__, "md5", md5)

    def _folders(self) -> list[Path]:
        root = self.root_path
        cache = resolve_cache_dir(root, self.cache_dir)
        return [root / FOLDER] + ([cache / FOLDER] if cache != root else [])

    def _find_extracted(self) -> Path | None:
        return next((f for f in self._folders() if _complete(f)), None)

    def prepare(self) -> None:
        """Make an extracted, validated ``cifar-10-batches-py`` available (see module doc)."""
        found = self._find_extracted()
        if found is not None:
            log.info("CIFAR-10 found at %s", found)
            return
        root = self.root_path
        cache = resolve_cache_dir(root, self.cache_dir)
        if self._local_archive(root, cache) is None and not self.download:
            raise DatasetError(
                f"CIFAR-10 not found: looked for {self._looked_for(root, cache)} and download is "
                f"off; set data.root to a directory holding {ARCHIVE} (e.g. "
                f"data.root=../shared/data), data.url to a local copy, or data.download=true"
            )
        make_dir(cache)
        with dir_lock(cache):
            found = self._find_extracted()  # another process may have finished meanwhile
            if found is not None:
                log.info("CIFAR-10 found at %s", found)
                return
            archive = self._local_archive(root, cache)
            if archive is not None:
                md5 = file_digest(archive, "md5")
                if self.md5 is not None and md5 != self.md5:
                    raise DatasetError(
                        f"md5 mismatch for {archive}: expected {self.md5}, got {md5}"
                    )
            else:
                archive, md5 = cache / ARCHIVE, self._download(root, cache)
            log.info("extracting %s -> %s", archive, cache / FOLDER)
            extract(archive, cache / FOLDER)
            if self.md5 is None and md5 != OFFICIAL_MD5:
                log.warning(
                    "%s has md5 %s, not the official %s; accepted because it extracts and "
                    "validates as CIFAR-10 (pass data.md5=%s to make this check strict)",
                    archive,
                    md5,
                    OFFICIAL_MD5,
                    md5,
                )
            log.info("CIFAR-10 ready at %s", cache / FOLDER)

    def _local_archive(self, root: Path, cache: Path) -> Path | None:
        """The archive in ``root`` or the cache, else the one a local ``url`` names, else None."""
        for candidate in dict.fromkeys([root / ARCHIVE, cache / ARCHIVE]):
            if candidate.is_file():
                return candidate
        local = local_source(self.url or OFFICIAL_URL)
        if local is not None and not local.is_file():
            raise DatasetError(f"CIFAR-10 archive not found at {local} (from data.url={self.url})")
        return local

    @staticmethod
    def _looked_for(root: Path, cache: Path) -> str:
        looked = [root / FOLDER, root / ARCHIVE]
        if cache != root:
            looked += [cache / FOLDER, cache / ARCHIVE]
        return ", ".join(str(p) for p in looked)

    def _download(self, root: Path, cache: Path) -> str:
        """Fetch the network ``url`` to ``cache/ARCHIVE``; returns its md5."""
        url = self.url or OFFICIAL_URL
        expected = self.md5 or (OFFICIAL_MD5 if url == OFFICIAL_URL else None)
        try:
            return download(url, cache / ARCHIVE, md5=expected)
        except DatasetError as e:
            if not isinstance(e.__cause__, (OSError, http.client.HTTPException)):
                raise  # the download arrived but was rejected (md5): the message says it all
            raise DatasetError(
                f"CIFAR-10 not found: looked for {self._looked_for(root, cache)}, then {e}; set "
                f"data.root to a directory holding {ARCHIVE} (e.g. data.root=../shared/data) or "
                f"data.url to a local copy"
            ) from e

    def load(self) -> tuple[Split, Split]:
        """(train 50,000, test 10,000) from the extracted batches; reads about 180 MB."""
        folder = self._find_extracted()
        if folder is None:
            raise DatasetError(
                f"CIFAR-10 is not prepared: no {FOLDER}/ in "
                f"{' or '.join(str(f.parent) for f in self._folders())}; call prepare() in the "
                f"launching process first"
            )
        return _read_split(folder, TRAIN_BATCHES), _read_split(folder, (TEST_BATCH,))
