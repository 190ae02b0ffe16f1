"""ResNets for 32x32 inputs.

``resnet20/32/56``: He et al. (2016), section 4.2: three stages of 16/32/64 channels, 3 basic
blocks x n, parameter-free shortcuts (option A: strided subsample + zero channel padding), so
ResNet-20 has 269,722 parameters with 10 classes. ``resnet18``: the ImageNet ResNet-18 with a 3x3
stem and no max-pool, the usual CIFAR variant (11.2M parameters).
The factories accept ``image_size`` (unused: the nets pool adaptively) so every model builds from
the same dataset facts.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class _ShortcutA(nn.Module):
    def __init__(self, planes: int):
        super().__init__()
        self.pad = planes // 4

    def forward(self, x: Tensor) -> Tensor:
        return F.pad(x[:, :, ::2, ::2], (0, 0, 0, 0, self.pad, self.pad))


class BasicBlock(nn.Module):
    def __init__(self, in_planes: int, planes: int, stride: int, shortcut: str):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_planes != planes:
            if shortcut == "A":
                self.shortcut = _ShortcutA(planes)
            else:
                self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride, bias=False),
                                              nn.BatchNorm2d(planes))

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    def __init__(self, blocks: list[int], widths: list[int], num_classes: int = 10,
                 in_channels: int = 3, shortcut: str = "A"):
        super().__init__()
        if num_classes < 1:
            raise ValueError(f"model.num_classes must be >= 1, got {num_classes}")
        self.conv1 = nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        layers, in_planes = [], widths[0]
        for i, (n, planes) in enumerate(zip(blocks, widths)):
            for j in range(n):
                stride = 2 if i > 0 and j == 0 else 1
                layers.append(BasicBlock(in_planes, planes, stride, shortcut))
                in_planes = planes
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(in_planes, num_classes)
        # He init for convolutions; the classifier keeps PyTorch's small default init so the
        # first logits are near zero (kaiming there starts at loss ~4 with huge early gradients,
        # which stale updates amplify).
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight)

    def forward(self, x: Tensor) -> Tensor:
        out = self.layers(F.relu(self.bn1(self.conv1(x))))
        return self.fc(F.adaptive_avg_pool2d(out, 1).flatten(1))


def _thin(n: int, num_classes: int, in_channels: int) -> CifarResNet:
    return CifarResNet([n, n, n], [16, 32, 64], num_classes, in_channels, shortcut="A")


def resnet20(num_classes: int = 10, in_channels: int = 3, image_size: int = 32) -> CifarResNet:
    return _thin(3, num_classes, in_channels)


def resnet32(num_classes: int = 10, in_channels: int = 3, image_size: int = 32) -> CifarResNet:
    return _thin(5, num_classes, in_channels)


def resnet56(num_classes: int = 10, in_channels: int = 3, image_size: int = 32) -> CifarResNet:
    return _thin(9, num_classes, in_channels)


def resnet18(num_classes: int = 10, in_channels: int = 3, image_size: int = 32) -> CifarResNet:
    return CifarResNet([2, 2, 2, 2], [64, 128, 256, 512], num_classes, in_channels, shortcut="B")
