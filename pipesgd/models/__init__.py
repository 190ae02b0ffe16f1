"""Models; conf/model/*.yaml names them by ``_target_``. Input shape (classes, channels, size) is
passed by the entry point from the dataset, not written into model configs."""

from .resnet_cifar import CifarResNet, resnet18, resnet20, resnet32, resnet56
from .small import MLP, SmallCNN

__all__ = ["MLP", "CifarResNet", "SmallCNN", "resnet18", "resnet20", "resnet32", "resnet56"]
