"""What every dataset class shares: constructor validation and the loader conveniences.

A dataset object is a picklable bag of settings. Its constructor never touches the disk or the
network; ``prepare()`` (once, in the launching process) does all of that, and ``load()`` (in each
worker) only reads what ``prepare()`` left.
"""

from __future__ import annotations

import os
import re
from abc import ABC, abstractmethod
from pathlib import Path
from typing import ClassVar

from pipesgd.data.loader import EvalLoader, ShardedLoader
from pipesgd.data.split import Split
from pipesgd.objective import Classification

_MD5 = re.compile(r"[0-9a-fA-F]{32}")


def check_md5(owner: str, field: str, value: object) -> str:
    """``value`` as a lower-case md5 hex digest, or ValueError naming ``owner.field``."""
    if not isinstance(value, str) or not _MD5.fullmatch(value):
        raise ValueError(f"{owner}: {field} must be a 32-character hex md5 string, got {value!r}")
    return value.lower()


def _positive_int(owner: str, field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}: {field} must be an integer >= 1, got {value!r}")
    return value


def _flag(owner: str, field: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{owner}: {field} must be true or false, got {value!r}")
    return value


def _path(owner: str, field: str, value: object) -> str:
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise ValueError(f"{owner}: {field} must be a non-empty path, got {value!r}")
    return os.fspath(value)


class ImageDataset(ABC):
    """Settings shared by the dataset classes plus ``train_loader`` / ``eval_loader``.

    Subclasses set the class attributes and implement ``prepare`` and ``load``.
    """

    num_classes: ClassVar[int] = 10
    train_size: ClassVar[int]  # samples in the training split, known before anything is read
    in_channels: ClassVar[int]
    image_size: ClassVar[int]
    mean: ClassVar[tuple[float, ...]]
    std: ClassVar[tuple[float, ...]]
    objective: ClassVar[Classification] = Classification()

    def __init__(
        self,
        root: str,
        url: str | None,
        download: bool,
        cache_dir: str | None,
        batch_size: int,
        eval_batch_size: int,
        augment: bool,
    ) -> None:
        owner = type(self).__name__
        self.root: str = _path(owner, "root", root)
        if url is not None and (not isinstance(url, str) or not url):
            raise ValueError(f"{owner}: url must be a non-empty URL or path, or null; got {url!r}")
        self.url: str | None = url
        self.download = _flag(owner, "download", download)
        self.cache_dir = None if cache_dir is None else _path(owner, "cache_dir", cache_dir)
        self.batch_size = _positive_int(owner, "batch_size", batch_size)
        self.eval_batch_size = _positive_int(owner, "eval_batch_size", eval_batch_size)
        self.augment = _flag(owner, "augment", augment)

    @property
    def model_inputs(self) -> dict:
        """What the model is built for: classes, channels and image side."""
        return {"num_classes": self.num_classes, "in_channels": self.in_channels, "image_size": self.image_size}

    def report(self) -> dict:
        """The dataset as summary.json records it."""
        return {"name": type(self).__name__, "train_size": self.train_size}

    @property
    def root_path(self) -> Path:
        return Path(self.root).expanduser()

    @abstractmethod
    def prepare(self) -> None:
        """Find / download / verify / extract, once, in the launching process.

        Idempotent and atomic (temporary name + rename, partial files deleted on failure), safe
        if two processes call it at once. Raises DatasetError.
        """

    @abstractmethod
    def load(self) -> tuple[Split, Split]:
        """Read (train, test) into memory after ``prepare()``; no downloads. Raises DatasetError."""

    def train_loader(
        self, train_split: Split, rank: int, world_size: int, seed: int, ranks_per_replica: int = 1
    ) -> ShardedLoader:
        """This rank's shuffled, drop-last shard with the dataset's batch size, augmentation and
        normalisation; by replica, then rank inside it (:class:`~pipesgd.data.loader.EpochShards`)."""
        return ShardedLoader(
            train_split,
            self.batch_size,
            rank,
            world_size,
            seed,
            augment=self.augment,
            mean=self.mean,
            std=self.std,
            ranks_per_replica=ranks_per_replica,
        )

    def eval_loader(self, test_split: Split, rank: int, world_size: int) -> EvalLoader:
        """This rank's contiguous share of the test set, normalised, no drop."""
        return EvalLoader(
            test_split, self.eval_batch_size, rank, world_size, mean=self.mean, std=self.std
        )

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"
