"""Live recovery on torchft (``trainer.mode=live``, docs/reliability.md "Live recovery"): replica
groups that lose a member keep training, and a returning one heals from a live peer.

Only this package and :mod:`pipesgd.live.engine` import torchft, and only when called;
:func:`require_torchft` is the one place that says which extra provides it.
"""

from __future__ import annotations

from importlib import import_module
from types import ModuleType

EXTRA = "pipesgd[live]"
TORCHFT_VERSION = "0.2.0"


def require_torchft(what: str = "trainer.mode=live") -> ModuleType:
    """``torchft``, or ImportError naming the extra that installs the version this code is written for."""
    try:
        module = import_module("torchft")
    except ImportError as e:
        raise ImportError(f"{what} needs torchft, which is not installed: pip install '{EXTRA}' "
                          f"(torchft=={TORCHFT_VERSION}, Linux x86_64 wheels only)") from e
    return module
