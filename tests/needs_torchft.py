"""The live tests' guard: a module that needs torchft calls :func:`require_torchft` before it imports
anything that imports torchft."""

from __future__ import annotations

import importlib.util
import os

import pytest


def require_torchft() -> None:
    """Skip the calling test module without torchft (pip install '.[live]'), except under CI=true,
    where the live tests must run and a missing torchft fails it."""
    if importlib.util.find_spec("torchft") is not None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail("torchft is not installed; under CI=true the live tests must run (pip install '.[live]')",
                    pytrace=False)
    pytest.skip("torchft is not installed (pip install '.[live]')", allow_module_level=True)
