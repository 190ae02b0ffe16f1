"""The package as a user installs it: the wheel built from this tree (``pip wheel --no-deps``),
installed, not editable, into a fresh virtual environment that reuses this interpreter's torch,
and used from a directory that is not the clone. One module-scoped install, three commands."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

from runs import CACHE, ROOT, needs_mnist
from conftest import SHARED_DATA

# What a wheel is built from: the package (conf/ rides in it as pipesgd/conf, a link) and its metadata,
# beside the lab, which the build must leave out (the wheel holds the library only).
SOURCES = ("pyproject.toml", "README.md", "pipesgd", "conf", "pipesgd_lab")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """``{"python": the venv's interpreter, "cwd": an empty directory outside the clone, "env": ...}``."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:  # a copy: building in place would leave build/ and *.egg-info in the clone
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), str(src)],
                   check=True, timeout=120)
    wheel, = (tmp / "dist").glob("pipesgd-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    # Reuse this interpreter's torch, hydra and numpy: its site-packages go after the venv's own
    # (a .pth path line; the .pth files inside it, an editable pipesgd among them, are not read).
    venv_site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                    check=True, capture_output=True, text=True).stdout.strip())
    (venv_site / "outer.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([*pip, "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)],
                   check=True, timeout=120)
    cwd = tmp / "elsewhere"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT")}
    env["GLOO_SOCKET_IFNAME"] = "lo"
    return {"python": str(python), "cwd": cwd, "env": env, "site": venv_site, "wheel": wheel}


def _run(installed: dict, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([installed["python"], *args], cwd=installed["cwd"], env=installed["env"],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(200)
def test_import_comes_from_the_installed_wheel(installed):
    r = _run(installed, "-c", "import pipesgd, pathlib; print(pathlib.Path(pipesgd.__file__).resolve())")
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).is_relative_to(installed["site"].resolve()), r.stdout
    configs = sorted(p.relative_to(installed["site"] / "pipesgd" / "conf").as_posix()
                     for p in (installed["site"] / "pipesgd" / "conf").rglob("*.yaml"))
    assert configs == sorted(p.relative_to(ROOT / "conf").as_posix() for p in (ROOT / "conf").rglob("*.yaml"))


@pytest.mark.timeout(200)
def test_the_wheel_holds_the_library_and_no_lab_module(installed):
    """pipesgd_lab (bench, emulate, report, the GPU check) runs from a clone; a user's wheel is the
    library alone. (A ``pipesgd*`` glob in pyproject's packages.find would ship the lab.)"""
    import zipfile

    names = zipfile.ZipFile(installed["wheel"]).namelist()
    tops = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    assert tops == {"pipesgd"}, f"the wheel holds {sorted(tops)}"
    lab = [n for n in names if n.startswith(("pipesgd_lab", "pipesgd/tools"))]
    assert not lab, f"lab modules in the wheel: {lab[:5]}"
    assert "pipesgd/train.py" in names and "pipesgd/conf/config.yaml" in names
    r = _run(installed, "-c", "import pipesgd_lab")
    assert r.returncode != 0 and "No module named 'pipesgd_lab'" in r.stderr, r.stderr


@pytest.mark.timeout(200)
def test_timing_map_help(installed):
    r = _run(installed, "-m", "pipesgd.timing", "map", "--help")
    assert r.returncode == 0, r.stderr
    assert "usage:" in r.stdout


@needs_mnist
@pytest.mark.timeout(240)
def test_mnist_experiment_runs_from_another_directory(installed, tmp_path):
    """The packaged experiment, a group swept by a multirun, and a user's config dir beside the
    packaged ones (``--config-dir``: its experiment is a delta on mnist_mlp)."""
    user = tmp_path / "myconf" / "experiment"
    user.mkdir(parents=True)
    (user / "mine.yaml").write_text("# @package _global_\ndefaults:\n  - mnist_mlp\ntrainer:\n  max_steps: 2\n")
    r = _run(installed, "-m", "pipesgd.train", "--multirun", "--config-dir", str(tmp_path / "myconf"),
             "+experiment=mine", "compressor=none,int8", "trainer.eval_max_batches=1", "dist.nproc=1",
             f"data.root={SHARED_DATA}", f"data.cache_dir={CACHE}", "hydra.sweep.dir=sweep",
             timeout=200)
    assert r.returncode == 0, r.stderr[-3000:]
    done = [json.loads((installed["cwd"] / "sweep" / str(i) / "summary.json").read_text()) for i in (0, 1)]
    assert [(d["steps"], d["mode"], d["compressor"]) for d in done] == [(2, "pipe", "none"), (2, "pipe", "int8")]
    assert not list(installed["site"].rglob("summary.json"))  # nothing written into site-packages
