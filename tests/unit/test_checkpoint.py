"""Checkpoint files (atomic, checksummed, keep-k, safe loading), RNG capture, parameter and config
digests, the replica-mismatch message, the live mode's summed replica check and the
fault-injection spec. All in-process and fast."""

from __future__ import annotations

import hashlib
import logging
import os
import random
import subprocess

import numpy as np
import pytest
import torch
from torch import nn

import pipesgd.reliability.checkpoint as ckpt
from pipesgd.reliability.checkpoint import (FORMAT, CheckpointDir, CheckpointError, config_diff, config_digest, param_checksum,
                                rng_state, set_rng_state)
from pipesgd.reliability.faults import parse
from pipesgd.reliability.hooks import describe_mismatch
from pipesgd.reliability.replicas import EXACT_GROUPS, MOMENTS, describe_summed_mismatch, moments


def state(step: int) -> dict:
    torch.manual_seed(step)
    return {"format": FORMAT, "step": step, "w": torch.randn(5), "opt": {"lr": 0.1, "betas": (0.9, 0.99)}}


def test_save_is_checksummed_and_keeps_the_newest_k(tmp_path):
    d = CheckpointDir(tmp_path / "checkpoints", keep=2)
    for step in (8, 16, 24):
        d.save(state(step), step)
    assert [p.name for p in d.list()] == ["step-00000024.pt", "step-00000016.pt"]
    assert sorted(p.name for p in d.dir.iterdir()) == [
        "step-00000016.pt", "step-00000016.pt.sha256", "step-00000024.pt", "step-00000024.pt.sha256"]
    sidecar = (d.dir / "step-00000024.pt.sha256").read_text()
    assert sidecar == f"{hashlib.sha256((d.dir / 'step-00000024.pt').read_bytes()).hexdigest()}  step-00000024.pt\n"
    # sha256sum -c understands the checksum file (the by-hand check the docs promise).
    assert subprocess.run(["sha256sum", "-c", "step-00000024.pt.sha256"], cwd=d.dir).returncode == 0
    loaded = d.load(d.path(24))
    assert torch.equal(loaded["w"], state(24)["w"]) and loaded["opt"]["betas"] == (0.9, 0.99)


def test_failed_write_leaves_the_previous_checkpoint_and_no_temporary(tmp_path, monkeypatch):
    d = CheckpointDir(tmp_path, keep=2)
    d.save(state(8), 8)
    real_save = torch.save

    def dies_halfway(obj, f):
        real_save(obj, f)
        raise KeyboardInterrupt  # e.g. Ctrl-C after the bytes are written, before the rename

    monkeypatch.setattr(ckpt.torch, "save", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        d.save(state(16), 16)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000008.pt", "step-00000008.pt.sha256"]


def test_corrupt_newest_is_reported_and_the_previous_used(tmp_path, caplog):
    d = CheckpointDir(tmp_path, keep=3)
    for step in (8, 16, 24):
        d.save(state(step), step)
    with open(d.path(24), "r+b") as f:  # flip one byte in the middle
        f.seek(os.path.getsize(d.path(24)) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    d.path(16).with_name("step-00000016.pt.sha256").unlink()  # the writer died between the renames
    with caplog.at_level(logging.WARNING):
        path, loaded = d.newest_valid()
    assert path == d.path(8) and loaded["step"] == 8
    assert "step-00000024.pt is corrupt: sha256" in caplog.text
    assert "step-00000016.pt is incomplete: its checksum file step-00000016.pt.sha256 is missing" in caplog.text


def test_all_corrupt_is_an_error_and_none_is_a_fresh_start(tmp_path):
    d = CheckpointDir(tmp_path / "none", keep=2)
    assert d.newest_valid() is None
    d = CheckpointDir(tmp_path / "bad", keep=2)
    d.save(state(8), 8)
    d.path(8).write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"no valid checkpoint in .*: .*corrupt.*trainer.resume=never"):
        d.newest_valid()


def test_leftover_temporaries_are_removed(tmp_path):
    d = CheckpointDir(tmp_path, keep=2)
    d.save(state(8), 8)
    (tmp_path / ".step-00000016.pt.abc123.tmp").write_bytes(b"partial")
    d.remove_temporaries()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


class _RunsCode:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_crafted_checkpoint_cannot_run_code(tmp_path):
    """A pickle that would run a shell command, with a valid checksum: weights_only refuses it."""
    marker = tmp_path / "pwned"
    d = CheckpointDir(tmp_path / "checkpoints", keep=2)
    d.save({"format": FORMAT, "evil": _RunsCode(marker)}, 8)
    with pytest.raises(CheckpointError, match=r"refusing to load checkpoint .*step-00000008.pt.*weights_only=True"):
        d.load(d.path(8))
    assert not marker.exists()


def test_rng_state_round_trip():
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    np.random.randn()  # leave a cached gaussian / non-zero position behind
    saved = rng_state()
    expected = (torch.rand(3), np.random.rand(3), random.random(), np.random.randn())
    torch.manual_seed(2), np.random.seed(2), random.seed(2)
    set_rng_state(saved)
    again = (torch.rand(3), np.random.rand(3), random.random(), np.random.randn())
    assert torch.equal(expected[0], again[0]) and np.array_equal(expected[1], again[1])
    assert expected[2:] == again[2:]


def test_rng_state_survives_weights_only_load(tmp_path):
    d = CheckpointDir(tmp_path, keep=1)
    d.save({"format": FORMAT, "rng": rng_state()}, 1)
    expected = (torch.rand(3), np.random.rand(3), random.random())
    set_rng_state(d.load(d.path(1))["rng"])  # weights_only=True: the state must be made of plain types
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(expected[0], again[0]) and np.array_equal(expected[1], again[1])
    assert expected[2] == again[2]


def test_param_checksum_is_sha256_of_parameter_bytes_in_state_dict_order():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        if "running" not in name and "num_batches" not in name:
            h.update(t.numpy().tobytes())
    assert param_checksum(model) == h.hexdigest()
    model[1].running_mean += 1  # buffers are not parameters
    assert param_checksum(model) == h.hexdigest()
    with torch.no_grad():
        model[2].bias[0] += 1e-7
    assert param_checksum(model) != h.hexdigest()


def test_config_digest_ignores_where_and_how_often_but_not_what():
    base = {"seed": 0, "trainer": {"width": 2, "resume": "auto", "checkpoint_every": 8},
            "data": {"root": "a", "batch_size": 64}, "dist": {"nproc": 2, "timeout_s": 300}}
    moved = {**base, "trainer": {**base["trainer"], "resume": "never", "checkpoint_every": 100},
             "data": {**base["data"], "root": "b"}, "dist": {"nproc": 4, "timeout_s": 10}}
    assert config_digest(base) == config_digest(moved)
    other = {**base, "data": {**base["data"], "batch_size": 32}}
    assert config_digest(base) != config_digest(other)
    assert config_diff(ckpt.hashed_config(base), ckpt.hashed_config(other)) == ["data.batch_size: 64 -> 32"]


def test_a_mode_section_counts_only_for_its_own_mode():
    """``trainer.live`` reaches only a live run: adding a mode's section changes no other config's
    digest, and a checkpoint of a config from before the section existed still matches."""
    live = {"eval_every": 1, "max_failures": 1}
    base = {"seed": 0, "trainer": {"mode": "ddp", "width": 1}}
    with_section = {**base, "trainer": {**base["trainer"], "live": live}}
    assert config_digest(base) == config_digest(with_section)
    assert "live" not in ckpt.hashed_config(with_section)["trainer"]
    as_live = {**base, "trainer": {"mode": "live", "width": 1, "live": live}}
    assert ckpt.hashed_config(as_live)["trainer"]["live"] == live, "its own mode's section is the recipe"
    other = {**as_live, "trainer": {**as_live["trainer"], "live": {**live, "max_failures": 2}}}
    assert config_diff(ckpt.hashed_config(as_live), ckpt.hashed_config(other)) == ["trainer.live.max_failures: 1 -> 2"]


def test_a_setting_at_none_is_no_setting():
    """An option added with None as its default (trainer.max_grad_norm, scheduler.warmup_steps)
    changes no digest, so a config from before it existed still matches; set, it is a difference."""
    before = {"seed": 0, "trainer": {"mode": "sync"}, "scheduler": {"name": "cosine"}}
    after = {"seed": 0, "trainer": {"mode": "sync", "max_grad_norm": None},
             "scheduler": {"name": "cosine", "warmup_steps": None}, "extra": {"off": None}}
    assert config_digest(before) == config_digest(after)
    assert ckpt.hashed_config(after) == before
    clipped = {**after, "trainer": {"mode": "sync", "max_grad_norm": 1.0}}
    assert config_diff(ckpt.hashed_config(before), ckpt.hashed_config(clipped)) == \
        ["trainer.max_grad_norm: '<unset>' -> 1.0"]
    assert ckpt.hashed_config({"a": [None, 1], "b": 0, "c": False}) == {"a": [None, 1], "b": 0, "c": False}


def _reliability(tmp_path, config: dict):
    from pipesgd.reliability.hooks import Reliability

    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return Reliability(model=model, optimizer=opt, scheduler=None, engine=None, rank=0, world_size=1,
                       device=torch.device("cpu"), run_dir=tmp_path, config=config, resume="auto", mode="ddp")


@pytest.mark.parametrize("stored", ["with_section", "before_section"])
def test_auto_resume_takes_a_checkpoint_hashed_under_older_rules(tmp_path, stored):
    """A checkpoint whose stored config (and digest) still carries another mode's section, or has
    none from before it existed, resumes; one whose recipe differs is refused naming the key."""
    base = {"seed": 0, "optimizer": {"lr": 0.1}, "trainer": {"mode": "ddp", "width": 1}}
    now = {**base, "trainer": {**base["trainer"], "live": {"eval_every": 1}}}
    old = ckpt.json.loads(ckpt.json.dumps(now if stored == "with_section" else base))
    digest = hashlib.sha256(ckpt.json.dumps(ckpt.drop_keys(dict(old), ckpt.NOT_HASHED), sort_keys=True).encode()).hexdigest()
    CheckpointDir(tmp_path / "checkpoints").save({"format": FORMAT, "step": 8, "epoch": 0, "world_size": 1,
                                                  "config": old, "config_digest": digest}, 8)
    assert _reliability(tmp_path, now)._find()["step"] == 8
    other = {**now, "optimizer": {"lr": 0.2}}
    with pytest.raises(CheckpointError, match=r"another config \(optimizer.lr: 0.1 -> 0.2\)"):
        _reliability(tmp_path, other)._find()


def test_mismatch_message_names_the_odd_ranks():
    assert describe_mismatch(["a" * 64] * 3, 8) is None
    msg = describe_mismatch(["a" * 64, "b" * 64, "a" * 64], 8)
    assert msg.startswith("replicas diverged at step 8: rank 1 differs from the majority (ranks 0, 2")
    msg = describe_mismatch(["a" * 64, "b" * 64], 4)
    assert msg == "replicas diverged at step 4: rank 0: sha256 aaaaaaaaaaaa; rank 1: sha256 bbbbbbbbbbbb"


def _summed(digests: list[str], order: list[int], shares: list[float] | None = None) -> tuple[int, list[float]]:
    """What a live reduction sums in float32, in ``order``: each group's count c (1, or 0 for a
    zeroed share) and c times its digest's moments."""
    total = torch.zeros(1 + MOMENTS, dtype=torch.float32)
    for i in order:
        c = 1.0 if shares is None else shares[i]
        total += torch.tensor([c, *moments(digests[i])], dtype=torch.float32) * c
    return int(total[0]), total[1:].tolist()


def test_summed_digests_tell_equal_from_different_and_each_group_what_it_can():
    a, b = hashlib.sha256(b"weights").hexdigest(), hashlib.sha256(b"drifted").hexdigest()
    rng = random.Random(0)
    for _ in range(5):  # any order of summation: the sums are exact integers
        order = rng.sample(range(4), 4)
        assert describe_summed_mismatch(*_summed([a] * 4, order), a, "update 7") is None
    # a zeroed share (a healer's, count 0) of other weights takes no part
    assert describe_summed_mismatch(*_summed([a, b, a], [0, 1, 2], [1, 0, 1]), a, "update 7") is None
    for mine in (a, b):  # two groups: each knows only that they differ
        msg = describe_summed_mismatch(*_summed([a, b], [1, 0]), mine, "update 7")
        assert msg.startswith("replica groups diverged at update 7: the weights of the 2 groups that took part")
        assert f"with two groups the sums cannot tell which one is odd (this group's sha256 {mine[:12]})" in msg
    three = _summed([a, b, a], [2, 0, 1])
    assert f"the other 2 agree with each other, so this group (sha256 {b[:12]}) is the odd one" in \
        describe_summed_mismatch(*three, b, "update 7")
    assert "the other 2 differ among themselves too" in describe_summed_mismatch(*three, a, "update 7")
    assert describe_summed_mismatch(*three, None, "update 7").endswith("this group took no part (it was healing)")


def test_summed_digests_are_exact_for_as_many_groups_as_promised():
    """The hardest case: the largest bytes, EXACT_GROUPS groups, one byte of one group off by one."""
    high, off = "ff" * 32, "fe" + "ff" * 31
    assert describe_summed_mismatch(*_summed([high] * EXACT_GROUPS, list(range(EXACT_GROUPS))), high, "u") is None
    odd = [high] * (EXACT_GROUPS - 1) + [off]
    msg = describe_summed_mismatch(*_summed(odd, list(range(EXACT_GROUPS))), off, "u")
    assert "(1 of the 32 bytes of their sha256 differ" in msg
    assert "this group (sha256 feffffffffff) is the odd one" in msg


def test_fault_spec_is_validated():
    assert [(f.kind, f.rank, f.step) for f in parse("kill:1:35, nan:0:3")] == [("kill", 1, 35), ("nan", 0, 3)]
    for bad in ("kill:1", "explode:0:3", "kill:x:3", "kill:0:0", "kill:0:3:9"):
        with pytest.raises(ValueError, match="expected kind:rank:step"):
            parse(bad)


class FakeGpuGenerators:
    """torch.cuda's generators on ``visible`` GPUs, each state a byte: a set or get on a GPU that is
    not visible fails as CUDA does ("invalid device ordinal"); torch's own get/set_rng_state_all
    run on them."""

    def __init__(self, monkeypatch, visible: int):
        import torch.cuda.random as cuda_random
        self.visible, self.states = visible, {}
        for module in (torch.cuda, cuda_random):
            monkeypatch.setattr(module, "device_count", lambda: self.visible)
            monkeypatch.setattr(module, "get_rng_state", self.get)
            monkeypatch.setattr(module, "set_rng_state", self.set)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def _index(self, device) -> int:
        index = device if isinstance(device, int) else torch.device(device).index or 0
        if index >= self.visible:
            raise RuntimeError(f"CUDA error: invalid device ordinal (device {index}, {self.visible} visible)")
        return index

    def get(self, device="cuda"):
        i = self._index(device)
        return self.states.get(i, torch.tensor([i], dtype=torch.uint8))

    def set(self, state, device="cuda"):
        self.states[self._index(device)] = state.clone()


def _hooks(tmp_path, device: torch.device):
    from types import SimpleNamespace

    from pipesgd.reliability.hooks import Reliability

    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = SimpleNamespace(state_dict=lambda: {"width": 1, "steps": 3, "pending": []},
                             load_state_dict=lambda state: None, shared_state=("pending",),
                             state_for_new_rank=lambda state: state)
    return Reliability(model=model, optimizer=opt, scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                       engine=engine, rank=0, world_size=1, device=device,
                       run_dir=tmp_path, config={})


@pytest.mark.parametrize("new_rank", [False, True], ids=["same-world", "elastic-new-rank"])
def test_a_checkpoint_keeps_the_ranks_own_gpu_rng_and_resumes_where_fewer_gpus_are_visible(monkeypatch, tmp_path,
                                                                                         new_rank):
    """Saving every visible GPU's generator and restoring them by index crashed a resume on a
    machine (or a CUDA_VISIBLE_DEVICES) with fewer GPUs; each rank keeps only its own GPU's and
    restores it to the GPU it runs on now, an elastic resume's new rank too (then reseeded)."""
    from types import SimpleNamespace

    gpus = FakeGpuGenerators(monkeypatch, visible=4)
    gpus.set(torch.tensor([33], dtype=torch.uint8), 3)  # rank 0 trains on cuda:3; its generator moved
    trainer = SimpleNamespace(step=3, last_losses=[1.0], train_loader=SimpleNamespace(batch_size=2),
                              history=SimpleNamespace(evals=[]))
    _hooks(tmp_path, torch.device("cuda", 3)).save(trainer, epoch=0, consumed=6)
    saved = CheckpointDir.load(tmp_path / "checkpoints" / "step-00000003.pt")
    assert torch.equal(saved["ranks"][0]["rng"]["cuda"], torch.tensor([33], dtype=torch.uint8))
    gpus.visible, gpus.states = 2, {}  # resumed where two GPUs are visible, the rank on cuda:1
    if new_rank:
        saved["ranks"][0]["new_rank"] = True
        monkeypatch.setattr(torch, "manual_seed", lambda seed: gpus.set(torch.tensor([seed % 256], dtype=torch.uint8), 1))
    _hooks(tmp_path, torch.device("cuda", 1))._restore(saved, trainer)
    assert set(gpus.states) == {1}
    if not new_rank:
        assert torch.equal(gpus.states[1], torch.tensor([33], dtype=torch.uint8))


def _format_1(cfg_overrides: list[str], world_size: int = 2) -> tuple[dict, dict]:
    """A format-1 checkpoint of the oldest layout (tests/old_checkpoints.py) of the config that
    ``cfg_overrides`` compose now, and that config: each rank trained on GPU ``rank``, whose
    generator state is ``10 + rank``; step 32, 2 batches into its epoch."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import pipesgd.schema  # noqa: F401  (registers the structured config)
    from old_checkpoints import as_format_1
    from pipesgd.config import validate
    from runs import ROOT

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["+experiment=mnist_mlp", *cfg_overrides])
    validate(cfg)
    new = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    state = {"format": FORMAT, "step": 32, "epoch": 1, "consumed": 2 * new["data"]["batch_size"] * world_size,
             "world_size": world_size, "config": ckpt.hashed_config(new), "evals": [], "model": {"w": torch.arange(3.0)},
             "ranks": [{"rng": {**rng_state(), "cuda": torch.tensor([10 + r], dtype=torch.uint8)}}
                       for r in range(world_size)]}
    return as_format_1(state, oldest=True), new


def test_a_format_1_checkpoint_is_refused_naming_the_command_that_converts_it(tmp_path):
    d = CheckpointDir(tmp_path / "checkpoints")
    path = d.save(_format_1(["staleness=lookahead"])[0], 32)
    with pytest.raises(CheckpointError, match=rf"checkpoint {path} has format 1, from before the staleness config "
                                              rf"group .*; convert it with: python -m pipesgd.reliability.checkpoint convert {path}$"):
        CheckpointDir.load(path)
    with pytest.raises(CheckpointError, match=r"no valid checkpoint in .*python -m pipesgd.reliability.checkpoint convert"):
        d.newest_valid()  # trainer.resume=auto stops with the same advice, rather than starting over


@pytest.mark.parametrize("overrides,rule", [
    (["staleness=dc", "staleness.dc_lambda=0.1", "staleness.dc_momentum=0.9"], "dc"),
    (["staleness=lookahead"], "lookahead"),
    ([], "none"),
])
def test_convert_writes_format_2_with_its_checksum_and_the_digest_the_run_computes(tmp_path, overrides, rule):
    """The digest the removed shim matched is the one a run composing the group computes now."""
    from pipesgd.reliability.checkpoint import main
    from pipesgd.staleness import rule_class

    old_state, running = _format_1(overrides)
    old = CheckpointDir(tmp_path / "old").save(old_state, 32)
    new = tmp_path / "run" / "checkpoints" / "step-00000032.pt"
    assert main(["convert", str(old), str(new)]) == 0
    assert subprocess.run(["sha256sum", "-c", new.name + ".sha256"], cwd=new.parent).returncode == 0
    assert sorted(p.name for p in new.parent.iterdir()) == [new.name, new.name + ".sha256"], "no temporaries"
    got = CheckpointDir.load(new)
    assert got["format"] == FORMAT == 2
    assert got["config_digest"] == config_digest(running) != old_state["config_digest"]
    cls = rule_class(rule)
    assert got["config"]["staleness"] == running["staleness"]
    assert running["staleness"]["_target_"] == f"{cls.__module__}.{cls.__qualname__}"
    assert not {"staleness", "dc_lambda", "dc_adaptive", "dc_momentum"} & set(got["config"]["trainer"])
    assert got["consumed"] == 2 * running["data"]["batch_size"] * 2 and got["evals"] == []
    assert [int(r["rng"]["cuda"]) for r in got["ranks"]] == [10, 11], "each rank its own GPU's generator"
    assert torch.equal(got["model"]["w"], torch.arange(3.0))
    other = _format_1(["staleness=dc", "staleness.dc_lambda=0.2"])[1]
    assert rule != "dc" or got["config_digest"] != config_digest(other), "the digest still sees the rule's options"


def test_convert_in_place_and_what_it_refuses(tmp_path, capsys):
    from pipesgd.reliability.checkpoint import main

    path = CheckpointDir(tmp_path).save(_format_1(["staleness=dc"])[0], 32)
    assert main(["convert", str(path)]) == 0 and f"{path}: format 2" in capsys.readouterr().out
    assert CheckpointDir.load(path)["config"]["staleness"]["dc_lambda"] == 0.04
    assert main(["convert", str(path)]) == 0, "a format-2 checkpoint is left as it is"
    path.write_bytes(path.read_bytes()[:-1])
    assert main(["convert", str(path)]) == 2 and "is corrupt: sha256" in capsys.readouterr().err
    odd = CheckpointDir(tmp_path / "odd").save({"format": 0, "step": 1}, 1)
    assert main(["convert", str(odd)]) == 2 and "cannot convert format 0" in capsys.readouterr().err
    gone, _ = _format_1(["staleness=dc"])
    gone["config"]["trainer"]["staleness"] = "late"  # a rule this pipesgd does not register
    gone = CheckpointDir(tmp_path / "gone").save(gone, 32)
    assert main(["convert", str(gone)]) == 2
    assert "cannot convert its config.trainer.staleness: staleness='late' is not known" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match="has format 1"):
        CheckpointDir.load(gone)  # left as it was
