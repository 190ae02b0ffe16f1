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


@pytest.fixture(scope="module")
def netns() -> None:
    """Skip unless this process can really build a (one-worker) emulated cluster."""
    from pipesgd.emulate import Cluster, EmulateError

    if os.geteuid() != 0:
        pytest.skip("emulated cluster needs root (network namespaces, veth, tc)")
    try:
        with Cluster(1, "100mbit", handle_signals=False):
            pass
    except EmulateError as e:
        pytest.skip(f"cannot build an emulated cluster here: {e}")
