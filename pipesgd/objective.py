"""What a model is trained to do and how it is scored: the training loss and the evaluation metrics.

A dataset names its objective (``dataset.objective``); the trainer calls ``loss`` on every step
and, at evaluation, sums ``sums`` over this rank's batches, adds the sums of every rank
(``all_reduce``) and turns the totals into named results with ``results``. Sums, not means, so
that ranks holding different numbers of samples still give the exact figure over the whole set.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor


class Objective(ABC):
    """``loss(output, target)``: the mean training loss of one batch (autograd flows through it).
    ``sums(output, target)``: float64 additive totals of one evaluation batch (same length every
    call). ``results(totals)``: ``{"test_<metric>": value}`` from totals summed over all ranks;
    ``test_loss`` and ``test_accuracy`` are always among them."""

    width: ClassVar[int] = 3  # len(sums(...))

    @abstractmethod
    def loss(self, output: Tensor, target: Tensor) -> Tensor: ...

    @abstractmethod
    def sums(self, output: Tensor, target: Tensor) -> Tensor: ...

    @abstractmethod
    def results(self, totals: Tensor) -> dict[str, float]: ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _counts(logits: Tensor, target: Tensor) -> Tensor:
    """[correct top-1, scored targets, summed cross-entropy] of ``logits`` (N x C) against ``target``
    (N), on the logits' device (no host sync)."""
    return torch.stack([(logits.argmax(1) == target).sum().double(),
                        torch.tensor(target.numel(), dtype=torch.float64, device=logits.device),
                        F.cross_entropy(logits, target, reduction="sum").double()])


class Classification(Objective):
    """One label per sample: cross-entropy; scored by top-1 accuracy and mean cross-entropy (nats)."""

    def loss(self, output: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(output, target)

    def sums(self, output: Tensor, target: Tensor) -> Tensor:
        return _counts(output, target)

    def results(self, totals: Tensor) -> dict[str, float]:
        correct, n, loss = totals.tolist()
        return {"test_accuracy": correct / max(1.0, n), "test_loss": loss / max(1.0, n)}


class NextToken(Objective):
    """A target per position (language modelling; output B x T x V, target B x T): mean token
    cross-entropy; scored by its mean over every validation token (nats), the same in bits
    (``test_bpc``: bits per character where a token is one character, as with this project's
    byte-level ASCII text) and next-token top-1 accuracy."""

    def loss(self, output: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(output.flatten(0, -2), target.flatten())

    def sums(self, output: Tensor, target: Tensor) -> Tensor:
        return _counts(output.flatten(0, -2), target.flatten())

    def results(self, totals: Tensor) -> dict[str, float]:
        correct, n, loss = totals.tolist()
        mean = loss / max(1.0, n)
        return {"test_accuracy": correct / max(1.0, n), "test_loss": mean, "test_bpc": mean / math.log(2)}
