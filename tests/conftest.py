import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"
sys.path.insert(0, str(Path(__file__).resolve().parent))

# Worker processes in tests talk over loopback only.
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


# Tests that build network namespaces (the emulated cluster, SLURM on emulated hosts) or count
# them, by module: under pytest-xdist (`make test` runs two workers) they form one unit of work, so
# they run one at a time in one worker; two clusters built at once would clash (names, addresses)
# and a namespace count would see the other's. Every user of the `netns` and `slurm` fixtures is in
# one of these modules (tests/unit/test_conftest.py checks).
NAMESPACE_MODULES = {"test_emulate.py", "test_elastic.py", "test_live_torchrun.py", "test_slurm_multi_node.py",
                     "test_sweep.py", "test_teardown.py"}


def namespace_scope(nodeid: str) -> str | None:
    """"namespaces" for a test of :data:`NAMESPACE_MODULES`, else None."""
    return "namespaces" if nodeid.split("::", 1)[0].rsplit("/", 1)[-1] in NAMESPACE_MODULES else None


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's load scheduling, with the namespace tests as one unit. (Its own `xdist_group` mark
    cannot do it here: pytest 9 no longer lets xdist 3.8 rename a test to carry the group.)"""
    from xdist.scheduler import LoadScopeScheduling

    class NamespacesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return namespace_scope(nodeid) or nodeid

    return NamespacesTogether(config, log)


def pytest_collection_modifyitems(items):
    """``slow`` means a training run on the real datasets: a test that takes the ``shared_data``
    fixture (or carries runs.py's ``needs_mnist``, which marks it itself). ``pytest -m "not slow"``
    leaves them out: what is left runs in minutes and needs no dataset."""
    for item in items:
        if "shared_data" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def shared_data() -> Path:
    if not (SHARED_DATA / "mnist").is_dir():
        pytest.skip(f"offline datasets not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(scope="module")
def netns() -> None:
    """Skip unless this process can really build a (one-worker) emulated cluster."""
    from pipesgd_lab.emulate import Cluster, EmulateError

    if os.geteuid() != 0:
        pytest.skip("emulated cluster needs root (network namespaces, veth, tc)")
    try:
        with Cluster(1, "100mbit", handle_signals=False):
            pass
    except EmulateError as e:
        pytest.skip(f"cannot build an emulated cluster here: {e}")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """SLURM 22.05 on three emulated hosts (pipesgd_lab.emulate.slurm): `login` runs slurmctld and the
    clients, node1 and node2 a slurmd each; one per test module (about a second to start), so that
    no namespace of it outlives the module (tests/lab/test_emulate.py counts this process's).
    The tier installs nothing (`make setup` installs slurm-wlm and munge as root). Without root or
    the programs it skips with the reason, except under CI=true, where it must run: it fails."""
    from pipesgd_lab.emulate.slurm import SlurmCluster, missing_binaries

    reason = None
    if os.geteuid() != 0:
        reason = "the SLURM tier needs root (network namespaces, slurmd, munged)"
    elif missing := missing_binaries():
        reason = f"SLURM/munge programs missing: {', '.join(missing)} (`make setup` as root installs slurm-wlm munge)"
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason}; under CI=true the SLURM tier must run")
        pytest.skip(reason)
    with SlurmCluster(nodes=2, rate="1gbit", kill_wait_s=5, log_dir=tmp_path_factory.mktemp("slurm-logs"),
                      handle_signals=False) as cluster:
        yield cluster
