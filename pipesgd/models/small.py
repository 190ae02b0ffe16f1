"""Small models for MNIST-sized inputs: fast enough for CI and many-seed studies."""

from __future__ import annotations

from torch import Tensor, nn


class MLP(nn.Module):
    def __init__(self, num_classes: int = 10, in_channels: int = 1, image_size: int = 28,
                 hidden: tuple[int, ...] | list[int] = (256, 128)):
        super().__init__()
        dims = [in_channels * image_size * image_size, *hidden]
        layers: list[nn.Module] = [nn.Flatten()]
        for a, b in zip(dims, dims[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        layers.append(nn.Linear(dims[-1], num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class SmallCNN(nn.Module):
    """Two conv layers + two linear layers (the classic PyTorch MNIST example shape)."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1, image_size: int = 28):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(64 * (image_size // 4) ** 2, 128), nn.ReLU(), nn.Linear(128, num_classes)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))
