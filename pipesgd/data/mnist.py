"""MNIST and Fashion-MNIST from their four IDX files, ``.gz`` or raw.

``prepare()`` takes the first directory that holds all four files, in this order: ``root``,
``root/mnist`` (``root/fashion-mnist``), ``root/MNIST/raw`` (``root/FashionMNIST/raw``), for
Fashion-MNIST the Debian package's ``/usr/share/datasets/fashion-mnist`` (``apt-get install
dataset-fashion-mnist``), then the cache directory's ``mnist/`` (``fashion-mnist/``). If none has
them and ``download`` is on, the ``.gz`` files are fetched from ``url`` (a base URL, default the
official mirror) into that cache directory, each atomically.

Every file is checked for its IDX header (magic number and sizes) and the md5 of its
DECOMPRESSED contents against the official value, since repackaged copies (Debian, recompressed
mirrors) keep the contents but not the gzip bytes. ``md5`` may override those values per file
(a mapping from file name, without ``.gz``, to md5). ``load()`` re-checks headers, not md5s.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import http.client
import logging
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from pipesgd.data.base import ImageDataset, check_md5
from pipesgd.data.download import dir_lock, download, local_source, make_dir, resolve_cache_dir
from pipesgd.data.errors import DatasetError
from pipesgd.data.split import Split

log = logging.getLogger(__name__)

_UBYTE = 0x08


@dataclass(frozen=True)
class IdxFile:
    """One IDX file: its name (without ``.gz``), official md5 of its contents, and shape."""

    name: str
    md5: str
    shape: tuple[int, ...]

    @property
    def magic(self) -> int:
        return (_UBYTE << 8) | len(self.shape)

    @property
    def nbytes(self) -> int:
        return 4 + 4 * len(self.shape) + int(np.prod(self.shape))


def _files(md5s: tuple[str, str, str, str]) -> tuple[IdxFile, IdxFile, IdxFile, IdxFile]:
    """train images, train labels, test images, test labels."""
    return (
        IdxFile("train-images-idx3-ubyte", md5s[0], (60_000, 28, 28)),
        IdxFile("train-labels-idx1-ubyte", md5s[1], (60_000,)),
        IdxFile("t10k-images-idx3-ubyte", md5s[2], (10_000, 28, 28)),
        IdxFile("t10k-labels-idx1-ubyte", md5s[3], (10_000,)),
    )


def read_idx(path: Path, spec: IdxFile, md5: str | None = None) -> np.ndarray:
    """The array stored in IDX file ``path``, raw or gzip-compressed (detected from its bytes).

    Checks the magic number, dimensions and length against ``spec`` and, if given, the md5 of the
    decompressed bytes; raises DatasetError naming the file otherwise. Reads at most one byte
    more than the expected size, so a bad file cannot exhaust memory.
    """
    try:
        with open(path, "rb") as raw:
            compressed = raw.read(2) == b"\x1f\x8b"  # gzip magic; IDX files start with 0x0000
            raw.seek(0)
            with gzip.GzipFile(fileobj=raw) if compressed else raw as f:
                data = f.read(spec.nbytes + 1)
    except EOFError as e:  # gzip: "Compressed file ended before the end-of-stream marker"
        raise DatasetError(
            f"truncated file {path}: its gzip stream stops after {path.stat().st_size} bytes; the "
            f"download or copy was cut short: delete it and fetch it again ({spec.name})"
        ) from e
    except (OSError, zlib.error) as e:
        raise DatasetError(f"cannot read {path}: {e}; expected the IDX file {spec.name}") from e
    header = 4 + 4 * len(spec.shape)
    if len(data) < 4 or struct.unpack(">I", data[:4])[0] != spec.magic:
        got = f"0x{struct.unpack('>I', data[:4])[0]:08x}" if len(data) >= 4 else "nothing"
        raise DatasetError(
            f"bad IDX file {path}: magic number {got}, expected 0x{spec.magic:08x} "
            f"(unsigned-byte array of {len(spec.shape)} dimensions, {spec.name})"
        )
    dims = struct.unpack(f">{len(spec.shape)}I", data[4:header]) if len(data) >= header else ()
    if dims != spec.shape or len(data) != spec.nbytes:
        raise DatasetError(
            f"bad IDX file {path}: dimensions {dims} and {len(data) - header}+ bytes of data, "
            f"expected {spec.shape} and exactly {spec.nbytes - header} bytes ({spec.name})"
        )
    if md5 is not None and (actual := hashlib.md5(data).hexdigest()) != md5:
        raise DatasetError(
            f"md5 mismatch for the contents of {path}: expected {md5}, got {actual} ({spec.name})"
        )
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(spec.shape).copy()


class _IdxDataset(ImageDataset):
    """MNIST-format dataset; subclasses name the files, folders and URLs."""

    in_channels = 1
    image_size = 28
    train_size = 60_000
    files: ClassVar[tuple[IdxFile, IdxFile, IdxFile, IdxFile]]
    subdirs: ClassVar[tuple[str, ...]]  # under root; the first is also the cache folder name
    system_dirs: ClassVar[tuple[str, ...]] = ()
    official_url: ClassVar[str]

    def __init__(
        self,
        root: str,
        url: str | None = None,
        md5: Mapping[str, str] | None = None,
        download: bool = True,
        cache_dir: str | None = None,
        batch_size: int = 64,
        eval_batch_size: int = 1000,
        augment: bool = False,
    ) -> None:
        super().__init__(root, url, download, cache_dir, batch_size, eval_batch_size, augment)
        owner = type(self).__name__
        names = [f.name for f in self.files]
        if md5 is not None and not isinstance(md5, Mapping):
            raise ValueError(
                f"{owner}: md5 must be null or a mapping from file name ({', '.join(names)}) to "
                f"the md5 of its decompressed contents, got {md5!r}"
            )
        overrides = {str(k).removesuffix(".gz"): v for k, v in (md5 or {}).items()}
        unknown = sorted(set(overrides) - set(names))
        if unknown:
            raise ValueError(f"{owner}: md5 has unknown file names {unknown}; allowed: {names}")
        self.md5: dict[str, str] | None = (
            {k: check_md5(owner, f"md5[{k}]", v) for k, v in overrides.items()} if md5 else None
        )

    def _expected_md5(self, spec: IdxFile) -> str:
        return (self.md5 or {}).get(spec.name, spec.md5)

    def _cache_folder(self) -> Path:
        return resolve_cache_dir(self.root_path, self.cache_dir) / self.subdirs[0]

    def _candidates(self) -> list[Path]:
        root = self.root_path
        dirs = [root, *(root / d for d in self.subdirs), *map(Path, self.system_dirs)]
        return list(dict.fromkeys([*dirs, self._cache_folder()]))

    @staticmethod
    def _file_in(folder: Path, spec: IdxFile) -> Path | None:
        for name in (spec.name, spec.name + ".gz"):
            if (folder / name).is_file():
                return folder / name
        return None

    def _all_in(self, folder: Path) -> list[Path] | None:
        """The four files in ``folder``, or None unless all four are there."""
        paths = [p for spec in self.files if (p := self._file_in(folder, spec)) is not None]
        return paths if len(paths) == len(self.files) else None

    def _locate(self) -> list[Path] | None:
        """The four files from the first candidate folder that has all of them, else None."""
        return next(filter(None, map(self._all_in, self._candidates())), None)

    def prepare(self) -> None:
        """Find the four IDX files (or download them) and verify headers and content md5s."""
        paths = self._locate()
        if paths is None:
            paths = self._download()
        for path, spec in zip(paths, self.files, strict=True):
            self._verify(path, spec)
        log.info("%s verified in %s", type(self).__name__, paths[0].parent)

    def _download(self) -> list[Path]:
        owner = type(self).__name__
        looked = ", ".join(str(p) for p in self._candidates())
        if not self.download:
            raise DatasetError(
                f"{owner} not found: looked for {', '.join(f.name for f in self.files)} (raw or "
                f".gz) in {looked} and download is off; set data.root to a directory holding "
                f"them or data.download=true"
            )
        base = self.url or self.official_url
        if (local := local_source(base)) is not None:  # a plain directory: urllib needs file://
            base = local.absolute().as_uri()
        base = base.rstrip("/") + "/"
        folder = make_dir(self._cache_folder())
        with dir_lock(folder):
            for spec in self.files:
                if self._file_in(folder, spec) is not None:  # done by a concurrent process
                    continue
                try:
                    download(
                        base + spec.name + ".gz",
                        folder / (spec.name + ".gz"),
                        check=functools.partial(self._verify, spec=spec),
                    )
                except DatasetError as e:
                    if not isinstance(e.__cause__, (OSError, http.client.HTTPException)):
                        raise  # the download arrived but was rejected: the message says it all
                    raise DatasetError(
                        f"{owner} not found: looked in {looked}, then {e}; set data.root to a "
                        f"directory holding the four IDX files"
                    ) from e
        paths = self._all_in(folder)
        assert paths is not None  # every missing file was just downloaded
        return paths

    def _verify(self, path: Path, spec: IdxFile) -> None:
        read_idx(path, spec, md5=self._expected_md5(spec))

    def load(self) -> tuple[Split, Split]:
        """(train 60,000, test 10,000) 1x28x28 images; headers re-checked, md5s not."""
        paths = self._locate()
        if paths is None:
            raise DatasetError(
                f"{type(self).__name__} is not prepared: no folder among "
                f"{', '.join(str(p) for p in self._candidates())} holds all four IDX files; call "
                f"prepare() in the launching process first"
            )
        arrays = [read_idx(path, spec) for path, spec in zip(paths, self.files, strict=True)]
        for path, labels in ((paths[1], arrays[1]), (paths[3], arrays[3])):
            if labels.max() >= self.num_classes:
                raise DatasetError(
                    f"bad labels in {path}: found {int(labels.max())}, expected "
                    f"0..{self.num_classes - 1}"
                )
        train, test = (
            Split(
                images=torch.from_numpy(images).unsqueeze(1),
                labels=torch.from_numpy(labels.astype(np.int64)),
            )
            for images, labels in (arrays[:2], arrays[2:])
        )
        return train, test


class MNIST(_IdxDataset):
    """MNIST handwritten digits: 60,000 train / 10,000 test 1x28x28 images in 10 classes."""

    mean = (0.1307,)
    std = (0.3081,)
    files = _files(
        (
            "6bbc9ace898e44ae57da46a324031adb",
            "a25bea736e30d166cdddb491f175f624",
            "2646ac647ad5339dbf082846283269ea",
            "27ae3e4e09519cfbb04c329615203637",
        )
    )
    subdirs = ("mnist", "MNIST/raw")
    official_url = "https://ossci-datasets.s3.amazonaws.com/mnist/"


class FashionMNIST(_IdxDataset):
    """Zalando's Fashion-MNIST: 60,000 train / 10,000 test 1x28x28 images in 10 classes."""

    mean = (0.2860,)
    std = (0.3530,)
    files = _files(
        (
            "f4a8712d7a061bf5bd6d2ca38dc4d50a",
            "9018921c3c673c538a1fc5bad174d6f9",
            "8181f5470baa50b63fa0f6fddb340f0a",
            "15d484375f8d13e6eb1aabb0c3f46965",
        )
    )
    subdirs = ("fashion-mnist", "FashionMNIST/raw")
    system_dirs = ("/usr/share/datasets/fashion-mnist",)
    official_url = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
