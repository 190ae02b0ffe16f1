"""Datasets and per-rank loaders.

A dataset object (``CIFAR10``, ``MNIST``, ``FashionMNIST``) is built from ``conf/data/*.yaml``
without touching the disk; ``prepare()`` runs once in the launching process (find, download,
verify, extract), ``load()`` in every worker returns in-memory ``(train, test)`` :class:`Split`
objects, and ``train_loader`` / ``eval_loader`` wrap them in a :class:`ShardedLoader` /
:class:`EvalLoader` for one rank. Data problems raise :class:`DatasetError`.
"""

from pipesgd.data.cifar import CIFAR10
from pipesgd.data.errors import DatasetError
from pipesgd.data.loader import EvalLoader, ShardedLoader
from pipesgd.data.mnist import MNIST, FashionMNIST
from pipesgd.data.split import Split

__all__ = [
    "CIFAR10",
    "MNIST",
    "DatasetError",
    "EvalLoader",
    "FashionMNIST",
    "ShardedLoader",
    "Split",
]
