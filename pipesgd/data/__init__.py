"""Datasets and per-rank loaders.

A dataset object (``CIFAR10``, ``MNIST``, ``FashionMNIST``, ``Shakespeare``) is built from ``conf/data/*.yaml``
without touching the disk; ``prepare()`` runs once in the launching process (find, download,
verify, extract), ``load()`` in every worker returns in-memory ``(train, test)`` :class:`Split`
objects (:class:`TextSplit` for text), and ``train_loader`` / ``eval_loader`` wrap them in a :class:`ShardedLoader` /
:class:`EvalLoader` for one rank. Data problems raise :class:`DatasetError`.
"""

from pipesgd.data.cifar import CIFAR10
from pipesgd.data.errors import DatasetError
from pipesgd.data.loader import EvalLoader, ShardedLoader
from pipesgd.data.mnist import MNIST, FashionMNIST
from pipesgd.data.shakespeare import Shakespeare
from pipesgd.data.split import Split
from pipesgd.data.text import TextSplit, WindowEvalLoader, WindowLoader

__all__ = [
    "CIFAR10",
    "MNIST",
    "DatasetError",
    "EvalLoader",
    "FashionMNIST",
    "ShardedLoader",
    "Shakespeare",
    "Split",
    "TextSplit",
    "WindowEvalLoader",
    "WindowLoader",
]
