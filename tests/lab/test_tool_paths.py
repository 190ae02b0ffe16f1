"""The study tools read and write where they are run (a clone's root keeps its records in place),
never next to their own source: an installed copy would write into site-packages."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipesgd_lab.bench import __main__ as bench
from pipesgd_lab.bench import elastic_study, ring_fit, runner, tta


@pytest.mark.parametrize("tool, argv, options", [
    (tta, [], ("records", "dir", "json", "plot")),
    (ring_fit, [], ("inp", "out", "md")),
    (elastic_study, [], ("dir", "json")),
])
def test_default_paths_are_the_current_directorys(tool, argv, options, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # tta resolves its --json/--plot defaults per recipe after parsing: its own parse() gives them
    args = tool.parse(argv) if tool is tta else tool.build_parser().parse_args(argv)
    for option in options:
        path = getattr(args, option).resolve()
        assert path.is_relative_to(tmp_path), f"{tool.__name__} --{option} defaults to {path}"
        assert path.relative_to(tmp_path).parts[0] in ("results", "docs", "outputs")


def test_the_bench_renders_into_the_current_directorys_docs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs").mkdir()
    assert bench.main(["--render-only"]) == 0
    assert (tmp_path / "docs" / "benchmarks.md").is_file()


def test_commands_are_recorded_relative_to_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert runner.Settings(bench_dir=tmp_path / "b").root == tmp_path
    cmd = ["x", f"hydra.run.dir={tmp_path}/outputs/r", "data.root=/elsewhere"]
    assert runner.recorded(cmd) == "x hydra.run.dir=outputs/r data.root=/elsewhere"
    assert Path(runner.__file__).resolve().parent != tmp_path
