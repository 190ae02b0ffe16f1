"""Byte-level text held in memory, cut into fixed-length windows for next-token prediction.

A sample is one window: ``x = tokens[s : s + T]``, ``y = tokens[s + 1 : s + T + 1]`` with window
starts ``s = 0, T, 2T, ...`` (every token is a target once per epoch). Training windows are
sharded and shuffled exactly like images (:class:`~pipesgd.data.loader.EpochShards`); evaluation
visits every validation window once over all ranks, in a fixed shuffled order, so the first
``eval_max_batches`` of each rank are a uniform sample of the validation text, not its first pages.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from pipesgd.data.loader import Batch, EpochShards, _check_int, mix_seed

VOCAB_SIZE = 256  # bytes: no tokenizer, and a byte of this ASCII text is one character


@dataclass
class TextSplit:
    """``tokens``: uint8, 1-D (the bytes of the split's texts, concatenated in order)."""

    tokens: Tensor

    def __post_init__(self) -> None:
        if self.tokens.dtype != torch.uint8 or self.tokens.dim() != 1:
            raise ValueError(
                f"TextSplit.tokens must be a 1-D uint8 tensor, "
                f"got {self.tokens.dtype} of shape {tuple(self.tokens.shape)}"
            )

    def __len__(self) -> int:
        return len(self.tokens)

    def windows(self, block_size: int) -> int:
        """How many whole ``block_size`` windows (each with its shifted target) the split holds."""
        return max(0, (len(self.tokens) - 1) // block_size)

    def batch(self, starts: Tensor, block_size: int) -> Batch:
        """``(x, y)``, both int64 ``len(starts) x block_size``: the windows at ``starts`` and the
        same windows one token later. One gather for the whole batch."""
        idx = starts[:, None] + torch.arange(block_size + 1)
        rows = self.tokens[idx].long()
        return rows[:, :-1], rows[:, 1:]


class WindowLoader(EpochShards):
    """This rank's share of one training epoch of ``split``'s windows, as ``(x, y)`` int64
    ``batch_size x block_size`` token tensors (see :class:`EpochShards` for the sharding)."""

    def __init__(self, split: TextSplit, block_size: int, batch_size: int, rank: int, world_size: int,
                 seed: int, shuffle: bool = True, ranks_per_replica: int = 1) -> None:
        self.block_size = _check_int(type(self).__name__, "block_size", block_size, 1)
        super().__init__(split.windows(block_size), batch_size, rank, world_size, seed, shuffle, ranks_per_replica)
        self.split = split

    def _batches(self, epoch: int, start_batch: int, consumed: int) -> Iterator[Batch]:
        idx, b, t = self.indices(epoch, consumed), self.batch_size, self.block_size
        for k in range(start_batch, len(idx) // b):
            yield self.split.batch(idx[k * b : (k + 1) * b] * t, t)


class WindowEvalLoader:
    """Every window of ``split`` exactly once over all ranks: the windows in one fixed order
    (a permutation drawn from seed 0, the same for every run), rank ``r`` taking the contiguous
    slice ``[N*r/W, N*(r+1)/W)`` of it, no drop. Summed per-rank token counts give the exact
    validation loss."""

    def __init__(self, split: TextSplit, block_size: int, batch_size: int, rank: int,
                 world_size: int) -> None:
        owner = type(self).__name__
        self.split = split
        self.block_size = _check_int(owner, "block_size", block_size, 1)
        self.batch_size = _check_int(owner, "batch_size", batch_size, 1)
        self.world_size = _check_int(owner, "world_size", world_size, 1)
        self.rank = _check_int(owner, "rank", rank, 0, world_size - 1)
        n = split.windows(block_size)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(mix_seed(0)))
        self.starts = order[n * rank // world_size : n * (rank + 1) // world_size] * block_size

    @property
    def num_samples(self) -> int:
        return len(self.starts)

    def __len__(self) -> int:
        return math.ceil(self.num_samples / self.batch_size)

    def share(self, index: int, count: int) -> WindowEvalLoader:
        """Share ``index`` of ``count`` of this loader's windows (as :meth:`EvalLoader.share`)."""
        _check_int(type(self).__name__, "index", index, 0, count - 1)
        part = copy.copy(self)
        n = self.num_samples
        part.starts = self.starts[n * index // count : n * (index + 1) // count]
        return part

    def __iter__(self) -> Iterator[Batch]:
        for lo in range(0, self.num_samples, self.batch_size):
            yield self.split.batch(self.starts[lo : lo + self.batch_size], self.block_size)
