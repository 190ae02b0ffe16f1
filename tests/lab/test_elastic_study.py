"""The elastic study's arithmetic on summaries written by hand (pipesgd_lab/bench/elastic_study.py;
tests/lab/test_elastic.py runs the drill end to end)."""

import json

import pytest


def test_the_accuracy_study_pairs_runs_by_seed(tmp_path):
    """bench/elastic_study.py: the difference is taken per seed, and a missing run leaves a gap, not a 0."""
    from pipesgd_lab.bench import elastic_study as study

    def write(name: str, acc: float, resharded=None):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps({"test_accuracy": acc, "resharded": resharded}))

    for seed, ref, ela in ((0, 0.97, 0.96), (1, 0.95, 0.955)):
        write(f"mnist-s{seed}-reference", ref)
        write(f"mnist-s{seed}-elastic", ela, {"old_world": 3, "new_world": 2})
    write("mnist-s2-reference", 0.90)  # its elastic run never finished
    a = study.parse(["--workloads", "mnist", "--seeds", "0,1,2", "--dir", str(tmp_path)])
    row = study.result(a)["workloads"][0]
    assert [r["seed"] for r in row["runs"]["elastic"]] == [0, 1] and len(row["runs"]["reference"]) == 3
    assert row["paired_difference_pp"]["mean"] == pytest.approx((-1.0 + 0.5) / 2)
    assert row["reference"]["min"] == pytest.approx(90.0) and len(row["resharded"]) == 2
    assert "| mnist | 2 |" in study.table(study.result(a))
    with pytest.raises(SystemExit):
        study.parse(["--workloads", "imagenet"])
