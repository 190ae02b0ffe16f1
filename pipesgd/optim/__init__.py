"""Optimizers that torch.optim does not ship (config group ``optimizer``)."""

from .lars import LARS

__all__ = ["LARS"]
