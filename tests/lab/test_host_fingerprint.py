"""Every record says which kind of host produced it: the curve record's host (summary.json's, a
stamp only when asked, else unknown), the report's refusal to compose an arm whose seeds ran on
different kinds of host, and the reproduce command's answer (the fingerprint itself:
tests/unit/test_hostinfo.py)."""

import json
from types import SimpleNamespace

import pytest

from pipesgd.observability import hostinfo
from pipesgd_lab.bench import tta, tta_report, tta_reproduce
from pipesgd_lab.bench import tta_records as r
from pipesgd_lab.bench.tta_shape import Shape
from tests.lab.test_tta_records import _record, _summary
from tests.unit.test_hostinfo import HOST_A, HOST_B


def test_a_record_carries_its_runs_host_and_never_invents_one():
    rec = _record("sync", _summary() | {"host": HOST_A})
    assert rec["host"] == HOST_A and rec["host_source"] == "summary.json"
    assert rec["host_kind"] == hostinfo.host_kind(HOST_A)
    old = _record("sync", _summary())
    assert old["host"] is None and old["host_kind"] == hostinfo.UNKNOWN
    stamped = r.curve_record("sync", 0, tta.ARMS["sync"], "resnet_cifar_tta", _summary(), [], stamp_host=HOST_B)
    assert stamped["host"] == HOST_B and stamped["host_source"].startswith(r.STAMPED)
    # a summary that says its host wins over a stamp
    assert r.curve_record("sync", 0, tta.ARMS["sync"], "x", _summary() | {"host": HOST_A}, [], HOST_B)["host"] == HOST_A


def test_a_stamp_survives_a_later_refresh_without_the_option(tmp_path):
    run_dir = tmp_path / "d" / "runs" / "sync-s0"
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text(json.dumps(_summary()))
    a = SimpleNamespace(records=tmp_path / "records", recipe="resnet_cifar_tta", stamp_host={"sync-s0"}, shape=Shape(2))
    first = tta_report.write_curve_record(a, "sync", 0, run_dir)
    assert first["host"] == hostinfo.fingerprint() and first["host_source"].startswith(r.STAMPED)
    again = tta_report.write_curve_record(SimpleNamespace(**(vars(a) | {"stamp_host": set()})), "sync", 0, run_dir)
    assert again["host"] == first["host"] and again["host_source"] == first["host_source"]


def _seed(seed, host):
    return _record("sync", _summary() | ({"host": host} if host else {}), seed=seed)


def test_an_arm_whose_seeds_ran_on_two_kinds_of_host_is_refused_unless_asked():
    same = r.seed_hosts([_seed(0, HOST_A), _seed(1, HOST_A | {"cores": 8})])
    assert same["sync"]["kinds"] == {hostinfo.host_kind(HOST_A): [0, 1]} and not same["sync"]["mixed"]
    with pytest.raises(r.Refused, match=r"sync's seeds ran on 2 kinds of host .*--mixed-hosts"):
        r.seed_hosts([_seed(0, HOST_A), _seed(1, HOST_B)])
    with pytest.raises(r.Refused, match="unknown"):  # an unknown host cannot be shown to be the same
        r.seed_hosts([_seed(0, HOST_A), _seed(1, None)])
    mixed = r.seed_hosts([_seed(0, HOST_A), _seed(1, HOST_B)], allow_mixed=True)
    assert mixed["sync"]["composed_across_host_kinds"] and len(mixed["sync"]["kinds"]) == 2


def test_the_report_lists_the_host_kinds_and_says_when_it_mixed_them(tmp_path):
    a = SimpleNamespace(arms=["sync"], seeds=[0, 1], dir=tmp_path / "d", records=tmp_path / "records",
                        recipe="resnet_cifar_tta", overrides=[], timing=None, workers=2, mixed_hosts=False,
                        validations=None, shape=Shape(2))
    used = [_seed(0, HOST_A), _seed(1, HOST_B)]
    with pytest.raises(r.Refused):
        tta_report.build_result(a, used, [], {})
    result = tta_report.build_result(SimpleNamespace(**(vars(a) | {"mixed_hosts": True})), used, [], {})
    assert result["mixed_hosts_allowed"] and result["hosts"]["sync"]["composed_across_host_kinds"]
    assert [row["host_kind"] for row in result["arms"]] == [hostinfo.host_kind(HOST_A), hostinfo.host_kind(HOST_B)]
    timing = tta_report.timing_by_link([{"link": "100mbit", "arm": "sync", "repeat": 0, "iter_ms": [1.0],
                                         "median_iter_ms": 1.0, "eval_s": 1.0, "date": "d", "host": HOST_A,
                                         "command": "python -m pipesgd.train trainer.max_steps=2"}])
    assert timing["100mbit"]["hosts"] == [hostinfo.host_kind(HOST_A)]


def test_a_record_of_another_kind_of_host_is_not_rerun():
    record = _seed(0, HOST_B)

    def run(cmd, log_path):
        raise AssertionError("a record of another host kind must not be rerun")

    answer = tta_reproduce.reproduce(record, None, here=HOST_A, run=run)
    assert answer["verdict"] == tta_reproduce.OTHER_HOST == "recorded on another kind of host: not comparable here"
    assert "cpu_model: EPYC B -> Xeon A" in answer["host_differences"]


def test_the_rerun_replays_the_records_command_stopped_at_its_first_evaluation(tmp_path):
    record = _seed(0, HOST_A) | {"segments": [{"command": "python -m pipesgd.train +experiment=resnet_cifar_tta "
                                                          "trainer.mode=sync seed=3 data.root=/x trainer.resume=auto "
                                                          "hydra.run.dir=/old"}]}
    cmd = tta_reproduce.rerun_command(record, tmp_path / "rerun", ["data.root=/here"], python="python")
    assert cmd == ["python", "-m", "pipesgd.train", "+experiment=resnet_cifar_tta", "trainer.mode=sync", "seed=3",
                   "data.root=/x", "data.root=/here", "trainer.stop_after_step=150", "trainer.checkpoint_every=null",
                   "trainer.resume=never", f"hydra.run.dir={tmp_path / 'rerun'}"]
    bare = tta_reproduce.rerun_command(_seed(2, None), tmp_path, python="python")
    assert bare[3:5] == ["+experiment=resnet_cifar_tta", "trainer.mode=sync"] and "seed=2" in bare


def test_the_answer_compares_the_first_evaluation_to_the_bit():
    record = _seed(0, HOST_A)
    summary = _summary()
    assert tta_reproduce.compare(record, summary)["verdict"] == tta_reproduce.REPRODUCED
    summary["evals"][0]["test_accuracy"] = 0.8 + 1e-12
    assert tta_reproduce.compare(record, summary)["verdict"] == tta_reproduce.DIFFERS
    other = _summary()
    other["config"]["optimizer"]["lr"] = 0.3
    with pytest.raises(tta_reproduce.NotRerunnable, match="optimizer.lr"):
        tta_reproduce.compare(record, other)


def test_bench_and_crossover_cells_record_the_host(tmp_path):
    from pipesgd_lab.bench.grid import Cell
    from pipesgd_lab.bench.runner import Settings, base_record

    record = base_record(Cell("train", "sync", 2, "100mbit"), Settings(bench_dir=tmp_path, commit="abc"))
    assert record["host"] == hostinfo.fingerprint()


def test_only_the_runs_named_are_stamped(tmp_path, capsys):
    a = tta.parse(["--phase", "report", "--arms", "sync,ddp-powersgd", "--seeds", "0,1",
                   "--stamp-host", "ddp-powersgd-s1"])
    assert a.stamp_host == {"ddp-powersgd-s1"}
    for name in ("sync-s0", "ddp-powersgd-s1"):
        run_dir = tmp_path / "d" / "runs" / name
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_text(json.dumps(_summary()))
    a.records, a.recipe = tmp_path / "records", "resnet_cifar_tta"
    assert tta_report.write_curve_record(a, "sync", 0, tmp_path / "d" / "runs" / "sync-s0")["host"] is None
    assert tta_report.write_curve_record(a, "ddp-powersgd", 1, tmp_path / "d" / "runs" / "ddp-powersgd-s1")["host"]
    with pytest.raises(SystemExit):
        tta.parse(["--arms", "sync", "--seeds", "0", "--stamp-host", "sync-s3"])
    assert "--stamp-host: sync-s3 is not a run of --arms and --seeds" in capsys.readouterr().err
