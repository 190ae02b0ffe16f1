"""Models; conf/model/*.yaml names them by ``_target_``. Input shape (classes, channels, size; or
vocabulary and window length) is passed by the entry point from the dataset's ``model_inputs``,
not written into model configs."""

from torch import nn

from .gpt import GPT
from .resnet_cifar import CifarResNet, resnet18, resnet20, resnet32, resnet56
from .small import MLP, SmallCNN


def unwrap(model: nn.Module) -> nn.Module:
    """The module a data-parallel wrapper holds (DDP's ``.module``: its state-dict keys gain
    ``module.``), or ``model`` itself. The one place that looks inside a wrapper."""
    return getattr(model, "module", model)


__all__ = ["GPT", "MLP", "CifarResNet", "SmallCNN", "resnet18", "resnet20", "resnet32", "resnet56", "unwrap"]
