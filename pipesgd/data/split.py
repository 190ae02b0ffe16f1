"""One split of an image-classification dataset, held in memory as two tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Split:
    """``images``: uint8, N x C x H x W (raw 0-255 pixels); ``labels``: int64, N.

    Validated on construction, so a loader can rely on the layout.
    """

    images: torch.Tensor
    labels: torch.Tensor

    def __post_init__(self) -> None:
        if self.images.dtype != torch.uint8 or self.images.dim() != 4:
            raise ValueError(
                f"Split.images must be a uint8 N x C x H x W tensor, "
                f"got {self.images.dtype} of shape {tuple(self.images.shape)}"
            )
        if self.labels.dtype != torch.int64 or self.labels.dim() != 1:
            raise ValueError(
                f"Split.labels must be an int64 tensor of shape (N,), "
                f"got {self.labels.dtype} of shape {tuple(self.labels.shape)}"
            )
        if len(self.images) != len(self.labels):
            raise ValueError(
                f"Split has {len(self.images)} images but {len(self.labels)} labels; "
                f"they must match"
            )

    def __len__(self) -> int:
        return len(self.labels)
