"""pipesgd_lab.bench.period_h, the period-H study's tables: utilization against the same link's
compute step, a round arm's step as its rounds' mean, the model's prediction beside it, the final
loss at equal steps, and the time to sync's final loss + 1 % composed from curves and steps."""

import json

import pytest
import torch

from pipesgd_lab.bench import period_h


def _row(arm, link, iter_ms, sent=None):
    cmd = ("python -m pipesgd_lab.emulate --workers 2 --rate 1mbit --mtu 9000 -- +experiment=gpt_shakespeare "
           f"hydra.run.dir=outputs/{link}-{arm}")
    return {"link": link, "arm": arm, "repeat": 0, "iter_ms": iter_ms, "median_iter_ms": sorted(iter_ms)[len(iter_ms) // 2],
            "median_compute_ms": 1000.0, "sent_bytes": sent,  # per exchange
            "eval_s": 10.0, "command": cmd, "date": "2026-12-02T00:00:00", "window": {"first": 0, "steps": len(iter_ms)}}


def _curve(arm, finals):
    return [{"name": arm, "seed": s, "steps": 600, "final": f, "curve": [[300, f + 0.3], [600, f]]}
            for s, f in enumerate(finals)]


def test_the_study_prices_rounds_by_their_mean_and_composes_the_time_to_syncs_loss():
    rows = [_row("compute", "1mbit", [1000.0] * 50),
            _row("diloco-eager-int8-h25", "1mbit", [1000.0] * 49 + [1500.0], sent=1_250_000.0),
            _row("ddp-fp16", "1mbit", [20_000.0] * 5, sent=2.48e6)]
    runs = _curve("sync", [2.00, 2.02]) + _curve("diloco-eager-int8-h25", [2.015])
    result = period_h.study(rows, runs, {"ddp-fp16": "sync"}, 1e-4)
    assert result["target_loss"] == pytest.approx(2.01 * 1.01)
    arms = {r["arm"]: r for r in result["links"]["1mbit"]["arms"]}
    eager = arms["diloco-eager-int8-h25"]
    assert eager["step_ms"] == pytest.approx(1010.0) and eager["utilization"] == pytest.approx(1000 / 1010)
    assert eager["bytes_per_step"] == 50_000.0  # one exchange of the model every 25 steps
    # int8 over 1 Mbit/s: ~10 s a round, hidden under 25 s of compute; the model says the compute step
    assert eager["predicted_ms"] == pytest.approx(1000.0) and eager["error"] == pytest.approx(-10 / 1010)
    assert arms["ddp-fp16"]["predicted_ms"] > 10_000  # fp16 buckets over 1 Mbit/s: seconds a step
    times = result["links"]["1mbit"]["time_to_target_s"]
    # both reach 2.0301 at step 600 (sync's mean over its seeds; ddp-fp16 priced on sync's curve)
    assert times["diloco-eager-int8-h25"] == pytest.approx(600 * 1.010 + 2 * 10.0)
    assert times["ddp-fp16"] == pytest.approx(600 * 20.0 + 2 * 10.0)
    assert result["final_loss"]["diloco-eager-int8-h25"]["vs_sync"] == pytest.approx(2.015 / 2.01 - 1)
    assert "diloco-eager-int8-h25" in period_h.tables(result)


def test_final_losses_carry_their_spread_and_each_seeds_gap_to_syncs_run_of_that_seed():
    runs = _curve("sync", [2.00, 2.10, 1.90]) + _curve("diloco-eager-sgd-int8-h5", [2.02, 2.10])
    f = period_h.final_losses(runs)
    assert f["sync"]["stdev"] == pytest.approx(0.1) and f["sync"]["seed_ids"] == [0, 1, 2]
    eager = f["diloco-eager-sgd-int8-h5"]
    assert eager["paired_vs_sync"] == pytest.approx({0: 0.01, 1: 0.0})  # seed 2 not run: not paired
    assert eager["vs_sync"] == pytest.approx(2.06 / 2.00 - 1)  # the means: sync's over its three seeds
    assert period_h.final_losses(_curve("sync", [2.0]))["sync"]["stdev"] is None
    rows = [_row("compute", "5mbit", [1000.0] * 10), _row("diloco-eager-sgd-int8-h5", "5mbit", [1000.0] * 10)]
    assert "| diloco-eager-sgd-int8-h5 | 2.0600 | 0.0566 | +3.00% | +1.00%, +0.00% | 2 |" in period_h.tables(
        period_h.study(rows, runs, {}, 1e-4))


def test_an_arm_that_never_reaches_the_target_says_so():
    rows = [_row("compute", "5mbit", [1000.0] * 10), _row("torchft-diloco-h5", "5mbit", [1200.0] * 10)]
    result = period_h.study(rows, _curve("sync", [2.0]) + _curve("torchft-diloco-h5", [2.5]), {}, 1e-4)
    assert result["links"]["5mbit"]["time_to_target_s"]["torchft-diloco-h5"] is None
    assert "not reached" in period_h.tables(result)
    # looser targets rank the arms that end above sync's + 1 %: 2.5 is under sync + 30 % only
    rows.append(_row("diloco-eager-int8-h5", "5mbit", [1000.0] * 10))
    runs = _curve("sync", [2.0]) + _curve("torchft-diloco-h5", [2.5]) + _curve("diloco-eager-int8-h5", [2.3])
    times = period_h.study(rows, runs, {}, 1e-4)["links"]["5mbit"]["time_s"]
    assert times["+20%"]["torchft-diloco-h5"] is None and times["+20%"]["diloco-eager-int8-h5"] == pytest.approx(620.0)
    assert "sync" not in times["+20%"]  # not timed on this link: not priced


def test_a_streaming_arm_sends_f_fragments_every_h_steps_and_a_silent_row_is_not_guessed():
    # the timing rows carry their bytes: a run directory need not outlive the machine
    rows = [_row("compute", "5mbit", [1000.0] * 10), _row("torchft-streaming-h20", "5mbit", [1000.0] * 20, sent=2_000_000.0)]
    arms = {r["arm"]: r for r in period_h.study(rows, _curve("sync", [2.0]), {}, 1e-4)["links"]["5mbit"]["arms"]}
    assert arms["torchft-streaming-h20"]["bytes_per_step"] == pytest.approx(2_000_000.0 * 5 / 20)  # F = 5 every 20
    assert arms["compute"]["bytes_per_step"] is None  # the row does not say


def test_an_arm_run_end_to_end_is_judged_against_its_brackets_composition(tmp_path):
    bracket = {"before": [_row("diloco-eager-int8-h5", "5mbit", [900.0] * 9 + [1900.0])],
               "after": [{**_row("diloco-eager-int8-h5", "5mbit", [1000.0] * 10), "repeat": 1}]}
    records = tmp_path / "records"
    records.mkdir()
    record = {"kind": "validate", "arm": "diloco-eager-int8-h5", "link": "5mbit", "seed": 0, "steps_limit": 100,
              "curve": [[100, 2.9]], "eval_elapsed_s": [120.0], "bracket": bracket}
    (records / "validate-diloco-eager-int8-h5-s0-5mbit-100steps.json").write_text(json.dumps(record))
    (v,) = period_h.validations(records)
    # rounds priced by their mean over both runs: (9 * 900 + 1900 + 10 * 1000) / 20 = 1000 ms
    assert v["step_ms"] == pytest.approx(1000.0) and v["composed_s"] == pytest.approx(100 * 1.0 + 10.0)
    assert v["rel_error"] == pytest.approx(110 / 120 - 1) and v["within"] is False  # 8.3 % off: over the 5 % bar
    record["eval_elapsed_s"] = [112.0]
    (records / "validate-diloco-eager-int8-h5-s0-5mbit-100steps.json").write_text(json.dumps(record))
    assert period_h.validations(records)[0]["within"] is True
    rows = [_row("compute", "5mbit", [1000.0] * 10)]
    assert "end to end" in period_h.tables(period_h.study(rows, _curve("sync", [2.0]), {}, 1e-4,
                                                          checks=period_h.validations(records)))


PERIOD_H_ARMS = sorted(a for a in period_h.ARMS if a.endswith("-h25"))  # every family once (the H is one override)


@pytest.mark.parametrize("arm", PERIOD_H_ARMS)
def test_every_period_h_arm_composes_on_the_gpt_recipe_and_passes_the_checks(arm):
    """An arm misspelled (a key the config lacks, a rule a round refuses) fails here, not an hour
    into a study."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from pipesgd.config import validate

    with initialize_config_dir(str(Path(__file__).resolve().parents[2] / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["+experiment=gpt_shakespeare", *period_h.ARMS[arm]])
    validate(cfg)
    assert cfg.trainer.sync_every == period_h.sync_every(arm)
    if "-sgd-" in arm:  # a plain outer step: lr 1, no momentum (conf/outer_optimizer/sgd.yaml's)
        outer = instantiate(cfg.outer_optimizer)([torch.zeros(1, requires_grad=True)])
        assert outer.defaults["lr"] == 1.0 and outer.defaults["momentum"] == 0.0 and not outer.defaults["nesterov"]


def _probe(link, algo, seconds, nbytes=4_956_160, tensors=1):
    return {"algo": algo, "bytes": nbytes, "tensors": tensors, "world_size": 2, "link": link, "seconds": seconds}


def test_a_probe_prices_each_arm_at_the_rate_its_own_allreduce_measured_on_the_link(tmp_path):
    rows = [_row("compute", "5mbit", [1000.0] * 10), _row("torchft-diloco-h5", "5mbit", [2800.0] * 10),
            _row("diloco-blocking-int8-h5", "5mbit", [1400.0] * 10), _row("ddp-fp16", "5mbit", [4800.0] * 8)]
    runs = _curve("sync", [2.0])
    nominal = {r["arm"]: r for r in period_h.study(rows, runs, {}, 1e-4)["links"]["5mbit"]["arms"]}
    # the 4.96 MB fp32 model on the link: pipesgd's ring 8.0 s, Gloo's allreduce 8.5 s in one buffer and
    # 9.5 s sent tensor by tensor (the GPT's 76), as torchft sends it
    probe = [_probe("5mbit", "native", [8.4, 8.5, 8.6]), _probe("5mbit", "ring", [8.0, 8.0]),
             _probe("5mbit", "native", [9.5], tensors=76), _probe(None, "ring", [0.01])]  # no link: not a probe
    result = period_h.study(rows, runs, {}, 1e-4, probe=probe)
    arms = {r["arm"]: r for r in result["links"]["5mbit"]["arms"]}
    assert [arms[a]["algorithm"] for a in ("torchft-diloco-h5", "ddp-fp16", "diloco-blocking-int8-h5")] == [
        "native-tensors", "native", "ring"]
    # torchft's fp32 round: five steps of compute and the 9.5 s its tensors took, per step
    assert arms["torchft-diloco-h5"]["predicted_ms"] == pytest.approx((5 * 1000 + 9500) / 5, rel=1e-3)
    assert arms["torchft-diloco-h5"]["predicted_ms"] > nominal["torchft-diloco-h5"]["predicted_ms"]
    int8 = 8000 / period_h.compression_ratio("int8", period_h.MODEL.params, 2)  # the ring's rate, a quarter of the bytes
    assert arms["diloco-blocking-int8-h5"]["predicted_ms"] == pytest.approx((5 * 1000 + int8) / 5, rel=1e-3)
    # DDP's fp16 bucket at Gloo's one-buffer rate: slower than at the nominal one, by 8.5 / 8.0 at most
    ratio = arms["ddp-fp16"]["predicted_ms"] / nominal["ddp-fp16"]["predicted_ms"]
    assert 1.0 < ratio < 8.5 / 7.99
    rates = result["links"]["5mbit"]["rate_bit_s"]
    assert rates["native"] == pytest.approx(4_956_160 * 8 / 8.5, rel=1e-3) and set(rates) == {
        "ring", "native", "native-tensors"}
    assert "native 4.66 Mbit/s" in period_h.tables(result)
    with pytest.raises(ValueError, match="two probe records of ring on 5mbit"):
        period_h.probe_links([_probe("5mbit", "ring", [8.0])] * 2, 1e-4)
    with pytest.raises(ValueError, match="under its latency"):
        period_h.probe_links([_probe("5mbit", "ring", [1e-6])], 1e-4)
    # the command: a missing folder is named before anything is written
    timing = tmp_path / "timing.json"
    timing.write_text(json.dumps(rows))
    with pytest.raises(SystemExit):
        period_h.main(["--timing", str(timing), "--probe", str(tmp_path / "nowhere"), "--json", str(tmp_path / "s.json")])
    assert not (tmp_path / "s.json").exists()


@pytest.mark.timeout(120)
def test_the_allreduce_probe_sends_a_models_tensors_one_by_one(tmp_path):
    from pipesgd_lab.bench import allreduce

    assert allreduce.main(["algo=native", "repeats=1", "warmup=0", "tensors=gpt-shakespeare",
                           f"hydra.run.dir={tmp_path}"]) == 0
    record = json.loads((tmp_path / "allreduce.json").read_text())
    assert (record["tensors"], record["bytes"], record["model"]) == (76, 4_956_160, "gpt-shakespeare")
    assert len(record["seconds"]) == 1 and record["seconds"][0] > 0
    assert allreduce.main(["algo=native", "tensors=gpt-7b", f"hydra.run.dir={tmp_path / 'bad'}"]) == 2
    assert not (tmp_path / "bad").exists()


def test_loopback_rows_price_only_from_a_probe_and_stay_out_of_the_time_tables():
    rows = [_row("compute", "loopback", [600.0] * 8), _row("torchft-diloco-h2", "loopback", [600.0, 700.0] * 4),
            _row("compute", "5mbit", [1000.0] * 10)]
    runs = _curve("sync", [2.0]) + _curve("torchft-diloco-h2", [2.5])
    plain = {r["arm"]: r for r in period_h.study(rows, runs, {}, 1e-4)["links"]["loopback"]["arms"]}
    assert plain["torchft-diloco-h2"]["predicted_ms"] is None  # no nominal rate to price it at
    result = period_h.study(rows, runs, {}, 1e-4, probe=[_probe("loopback", "native", [0.1], tensors=76)])
    arms = {r["arm"]: r for r in result["links"]["loopback"]["arms"]}
    assert arms["torchft-diloco-h2"]["predicted_ms"] == pytest.approx((2 * 1000 + 100) / 2, rel=1e-2)
    text = period_h.tables(result)
    assert "loopback (evaluation" in text and "loopback: minutes" not in text and "5mbit: minutes" in text


def test_the_tables_read_one_shape_of_replicas_and_refuse_a_timing_file_of_another(tmp_path, capsys):
    records = tmp_path / "records"
    records.mkdir()
    curve = {"kind": "curve", "arm": "sync", "seed": 0, "complete": True, "curve": [[600, 2.0]], "metric": "test_loss",
             "final_test_loss": 2.0, "steps": 600}
    (records / "sync-s0.json").write_text(json.dumps(curve))  # from before the field: one rank per replica
    (records / "sync-2x2-s0.json").write_text(json.dumps(curve | {"final_test_loss": 2.1, "replicas": 2,
                                                                   "ranks_per_replica": 2}))
    assert [r["final"] for r in period_h.load_curves(records)] == [2.0]
    assert [r["final"] for r in period_h.load_curves(records, 2)] == [2.1]
    bracket = {"before": [_row("sync", "5mbit", [900.0] * 10)], "after": [_row("sync", "5mbit", [900.0] * 10)]}
    record = {"kind": "validate", "arm": "sync", "link": "5mbit", "seed": 0, "steps_limit": 10, "curve": [[10, 2.9]],
              "eval_elapsed_s": [20.0], "bracket": bracket, "replicas": 2, "ranks_per_replica": 2}
    (records / "validate-sync-2x2-5mbit-10steps.json").write_text(json.dumps(record))
    assert period_h.validations(records) == [] and len(period_h.validations(records, 2)) == 1
    timing = tmp_path / "timing.json"
    timing.write_text(json.dumps([_row("compute", "5mbit", [1000.0] * 10) | {"ranks_per_replica": 2}]))
    with pytest.raises(SystemExit):
        period_h.main(["--timing", str(timing), "--records", str(records), "--json", str(tmp_path / "s.json"),
                       "--plot", ""])
    assert "has rows at [2] rank(s) per replica, not --ranks-per-replica 1" in capsys.readouterr().err


def test_a_curve_timed_as_another_arm_is_priced_at_that_arms_steps_and_a_bad_pair_is_refused(tmp_path, capsys):
    rows = [_row("compute", "5mbit", [1000.0] * 10),
            _row("diloco-streaming-none-int8-h10", "5mbit", [1250.0] * 10, sent=250_000.0)]
    runs = _curve("sync", [2.0]) + _curve("diloco-streaming-mix-int8-h10", [2.01])
    mix = "diloco-streaming-mix-int8-h10"
    alone = period_h.study(rows, runs, {}, 1e-4)["links"]["5mbit"]["time_to_target_s"]
    assert mix not in alone  # not timed under its name: not priced
    result = period_h.study(rows, runs, {}, 1e-4, timed_as={mix: "diloco-streaming-none-int8-h10"})
    arms = {r["arm"]: r for r in result["links"]["5mbit"]["arms"]}
    assert arms[mix]["step_ms"] == 1250.0 and arms[mix]["vs_compute"] == pytest.approx(0.8)
    assert result["links"]["5mbit"]["time_to_target_s"][mix] == pytest.approx(600 * 1.25 + 2 * 10.0)
    assert f"{mix}: priced at diloco-streaming-none-int8-h10's step times" in period_h.tables(result)
    timing = tmp_path / "timing.json"
    timing.write_text(json.dumps(rows))
    args = ["--timing", str(timing), "--records", str(tmp_path), "--json", str(tmp_path / "s.json"), "--plot", ""]
    for pair, said in ((f"{mix}=nonesuch", "both of the study's arms"),
                       (f"{mix}=diloco-blocking-int8-h10", "has no step times in")):
        with pytest.raises(SystemExit):
            period_h.main([*args, "--timed-as", pair])
        assert said in capsys.readouterr().err
    assert not (tmp_path / "s.json").exists()
