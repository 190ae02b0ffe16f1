"""conf/hydra/launcher/slurm.yaml composes with the real hydra-submitit-launcher plugin, and the
plugin turns it into the sbatch script we document (rendered, never submitted: a stand-in
``srun`` on PATH satisfies submitit's cluster check, and ``map_array`` is intercepted)."""

import os
import subprocess
import sys

import pytest
from runs import ROOT

pytest.importorskip("hydra_plugins.hydra_submitit_launcher",
                    reason="hydra-submitit-launcher is not installed (pip install 'pipesgd[slurm]')")


@pytest.mark.timeout(120)
def test_cli_composes_the_slurm_launcher():
    r = subprocess.run([sys.executable, "-m", "pipesgd.train", "hydra/launcher=slurm", "+experiment=mnist_mlp",
                        "hydra.launcher.partition=cpu", "--cfg", "hydra"],
                       cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "_target_: hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher" in r.stdout
    assert "hydra/launcher: slurm" in r.stdout and "partition: cpu" in r.stdout


@pytest.mark.timeout(120)
def test_slurm_launcher_renders_one_node_jobs(tmp_path, monkeypatch):
    import submitit
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    import pipesgd.schema  # noqa: F401  (registers pipesgd_schema, which conf/config.yaml's defaults name)

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    scripts: list[str] = []

    class Job:
        def results(self):
            return [None]

    def render(self, fn, *args):
        scripts.append(self._executor._make_submission_file_text("python -m pipesgd.train", "uid"))
        return [Job() for _ in args[0]]

    monkeypatch.setattr(submitit.AutoExecutor, "map_array", render)
    sweep = tmp_path / "sweep"
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3", job_name="train"):
        cfg = compose("config", overrides=["hydra/launcher=slurm", "+experiment=mnist_mlp",
                                           "hydra.launcher.partition=cpu", f"hydra.sweep.dir={sweep}"],
                      return_hydra_config=True)
        launcher = instantiate(cfg.hydra.launcher)
        launcher.setup(hydra_context=None, task_function=None, config=cfg)
        launcher.launch([["trainer.mode=sync"], ["trainer.mode=pipe"]], initial_job_idx=0)

    assert type(launcher).__name__ == "SlurmLauncher"
    (script,) = scripts
    for line in ("#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=1", "#SBATCH --cpus-per-task=8",
                 "#SBATCH --mem=32GB", "#SBATCH --time=240", "#SBATCH --partition=cpu", "#SBATCH --job-name=train"):
        assert line in script, script
    assert f"{sweep}/.submitit/" in script and "--gpus" not in script
