import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"
sys.path.insert(0, str(Path(__file__).resolve().parent))

# Worker processes in tests talk over loopback only.
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


@pytest.fixture
def shared_data() -> Path:
    if not (SHARED_DATA / "mnist").is_dir():
        pytest.skip(f"offline datasets not found at {SHARED_DATA}")
    return SHARED_DATA
