"""Optimizers that torch.optim does not ship (config group ``optimizer``)."""

from .adamw import adamw
from .lars import LARS

__all__ = ["LARS", "adamw"]
