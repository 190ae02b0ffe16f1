"""The trainers tier's guard (tests/trainers): Accelerate and the Hugging Face Trainer, the optional
extra ``pipesgd[trainers]``."""

from __future__ import annotations

import importlib.util
import os

import pytest

MODULES = ("accelerate", "transformers")


def require_trainers() -> None:
    """Skip the calling test module without accelerate and transformers (pip install '.[trainers]'),
    except under CI=true, where the tier must run and a missing package fails it."""
    missing = [m for m in MODULES if importlib.util.find_spec(m) is None]
    if not missing:
        return
    reason = f"{' and '.join(missing)} not installed (pip install '.[trainers]'; `make setup` installs it)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; under CI=true the trainers tier must run", pytrace=False)
    pytest.skip(reason, allow_module_level=True)
