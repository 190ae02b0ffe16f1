"""Config validation, no workers: the schema rejects unknown keys and wrong types with Hydra's
message; forced keys, ranges, settings a mode does not use, and the staleness group against its
trainer.* aliases are one-line errors naming the key; old checkpoints' digests still match."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import pipesgd.schema  # noqa: F401  (registers the structured config)
from pipesgd.config import ConfigError, command_line_keys, validate
from runs import ROOT


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=["+experiment=mnist_mlp", *overrides])


@pytest.mark.parametrize("override,message", [
    ("trainer.widht=3", "Could not override 'trainer.widht'"),
    ("dist.timeot_s=3", "Could not override 'dist.timeot_s'"),
    ("trainer.width=two", "Value 'two' of type 'str' could not be converted to Integer"),
    ("dist.timeout_s=soon", "Value 'soon' of type 'str' could not be converted to Float"),
    ("trainer.nonfinite=maybe", "Invalid value 'maybe', expected one of [skip, abort]"),
    ("trainer.checkpoint_every=often", "could not be converted to Integer"),
])
def test_schema_rejects_unknown_keys_and_wrong_types_with_hydras_message(override, message):
    with pytest.raises(Exception) as err:
        composed(override)
    text = f"{err.value} {err.value.__cause__}"
    assert message in text, text


@pytest.mark.parametrize("override,message", [
    ("+trainer.widht=3", "trainer.widht is not a setting; did you mean trainer.width? allowed: mode, width"),
    ("+dist.procs=3", "dist.procs is not a setting; did you mean dist.nproc?"),
    ("+sed=1", "sed is not a setting; did you mean seed?"),
    ("trainer.keep_checkpoints=0", "trainer.keep_checkpoints=0 is invalid: must be an integer >= 1"),
    ("trainer.checkpoint_every=0", "trainer.checkpoint_every=0 is invalid: must be an integer >= 1 (steps between "
                                   "checkpoints, or null for none)"),
    ("trainer.check_every=-1", "trainer.check_every=-1 is invalid"),
    ("trainer.stop_after_step=0", "trainer.stop_after_step=0 is invalid: must be an integer >= 1 (or null to run "
                                  "to the end)"),
    ("optimizer.lr=-1", "optimizer.lr=-1 is invalid: must be a number > 0"),
    ("optimizer.lr=0", "optimizer.lr=0 is invalid"),
    ("dist.backend=mpi", "dist.backend='mpi' is not known; allowed: auto, gloo, nccl"),
    ("trainer.resume=/nonexistent/step-00000008.pt", "trainer.resume='/nonexistent/step-00000008.pt' is not a "
                                                     "checkpoint file; allowed: auto"),
])
def test_forced_keys_and_ranges_are_explained(override, message):
    """``+key=value`` appends past a schema by Hydra's design; validate() names such keys."""
    with pytest.raises(ConfigError) as err:
        validate(composed(override))
    assert message in str(err.value)


@pytest.mark.parametrize("overrides,message", [
    (["trainer.mode=ddp", "trainer.width=4"], "trainer.width=4 is not used by trainer.mode=ddp, which runs at width 1 "
                                              "or 2"),
    (["trainer.mode=ddp", "trainer.width=2", "staleness=dc"], "staleness=dc is not available with trainer.mode=ddp "
                                                              "trainer.width=2; allowed: none, lookahead"),
    (["trainer.mode=ddp", "staleness=lookahead"], "staleness=lookahead is not used by trainer.mode=ddp; only sync, "
                                                  "pipe, live apply a staleness rule (and ddp at trainer.width=2)"),
    (["trainer.mode=ddp", "compressor=int8"], "compressor=int8 is not available with trainer.mode=ddp: it declares no "
                                              "DDP comm hook (ddp_hook()); allowed: none, bf16, fp16, powersgd"),
    (["trainer.mode=sync", "trainer.width=2"], "trainer.width=2 is not used by trainer.mode=sync"),
    (["trainer.mode=local", "trainer.warmup_sync_steps=5"], "trainer.warmup_sync_steps=5 is not used by "
                                                            "trainer.mode=local"),
    (["trainer.mode=ps_async", "trainer.staleness=dc"], "staleness=dc is not used by trainer.mode=ps_async"),
])
def test_a_setting_the_mode_does_not_use_is_an_error(overrides, message):
    with pytest.raises(ConfigError) as err:
        validate(composed(*overrides), command_line_keys(overrides))
    assert message in str(err.value)


@pytest.mark.parametrize("overrides,width,staleness", [
    (["trainer.mode=ddp"], 1, "none"),                      # mnist_mlp's width 2 is pipe's default: ddp runs at 1
    (["trainer.mode=ddp", "trainer.width=2", "staleness=lookahead", "compressor=powersgd"], 2, "lookahead"),  # the pipelined hook
    (["trainer.mode=sync", "trainer.width=1", "trainer.warmup_sync_steps=0"], 1, "none"),  # the mode's own values
    (["trainer.mode=pipe", "trainer.width=4", "trainer.staleness=dc"], 4, "dc"),
])
def test_a_mode_ignores_the_config_files_width_but_not_the_command_lines(overrides, width, staleness):
    from pipesgd.modes import get_mode

    cfg = composed(*overrides)
    validate(cfg, command_line_keys(overrides))
    assert get_mode(cfg.trainer.mode).runs_at(cfg.trainer.width) == width  # what build() runs at
    assert cfg.trainer.staleness == staleness and cfg.trainer.mode == overrides[0].split("=")[1]


def test_ddp_runs_the_pipelined_hook_only_when_the_command_line_asks_for_width_2():
    for overrides, width in ((["trainer.mode=ddp"], 1), (["trainer.mode=ddp", "trainer.width=2"], 2)):
        cfg = composed(*overrides)
        assert cfg.trainer.width == 2, "the config files' width is pipe's"
        validate(cfg, command_line_keys(overrides))
        assert cfg.trainer.width == width


def test_the_staleness_group_and_its_alias_build_the_same_run():
    from hydra.utils import instantiate

    from pipesgd.checkpoint import config_digest

    group = composed("staleness=dc", "staleness.dc_lambda=0.1")
    alias = composed("trainer.staleness=dc", "trainer.dc_lambda=0.1")
    for cfg in (group, alias):
        validate(cfg)
    assert group.trainer.staleness == alias.trainer.staleness == "dc", "validation names the rule"
    assert OmegaConf.to_container(group.staleness) == OmegaConf.to_container(alias.staleness)
    rule = instantiate(group.staleness)
    assert (rule.name, rule.dc_lambda, rule.momentum) == ("dc", 0.1, 0.95)
    assert instantiate(composed("staleness=dc", "staleness.dc_momentum=0.9").staleness).momentum == 0.9
    as_dict = [OmegaConf.to_container(c, resolve=True, enum_to_str=True) for c in (group, alias)]
    assert config_digest(as_dict[0]) == config_digest(as_dict[1])


def test_a_checkpoint_from_before_the_staleness_group_still_matches():
    """Its config had ``trainer.staleness`` and ``trainer.dc_*`` and no ``staleness`` group."""
    from pipesgd.checkpoint import config_digest

    cfg = composed("trainer.staleness=lookahead")
    validate(cfg)
    new = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    old = {k: v for k, v in new.items() if k != "staleness"}
    old["trainer"] = dict(new["trainer"], staleness="lookahead", dc_lambda=0.04, dc_adaptive=False)
    assert config_digest(old) == config_digest(new)
    old["trainer"]["staleness"] = "none"
    assert config_digest(old) != config_digest(new), "the digest still sees the rule"


@pytest.mark.parametrize("overrides,message", [
    (["trainer.staleness=dc", "staleness=lookahead"], "trainer.staleness=dc and staleness=lookahead name two rules"),
    (["staleness=lookahead", "trainer.dc_lambda=0.1"], "trainer.dc_lambda=0.1 is an option of staleness=dc, not of "
                                                       "staleness=lookahead"),
    (["trainer.staleness=late"], "trainer.staleness='late' is not known; allowed: none, dc, dga, lookahead, predict"),
])
def test_conflicting_staleness_settings_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError) as err:
        validate(composed(*overrides))
    assert message in str(err.value)


def test_an_experiment_files_staleness_rule_is_pipes_default_not_a_conflict():
    """resnet_cifar's lookahead is pipe's setting: a mode without staleness runs it as none, unless the
    command line asks for the rule itself."""
    from hydra.utils import instantiate

    def resnet(*overrides):
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=["+experiment=resnet_cifar", *overrides])
        validate(cfg, command_line_keys(["+experiment=resnet_cifar", *overrides]))
        return cfg

    cfg = resnet("trainer.mode=ddp")
    assert cfg.trainer.staleness == "none" and instantiate(cfg.staleness).name == "none"
    assert resnet().trainer.staleness == "lookahead"
    with pytest.raises(ConfigError, match="staleness=lookahead is not used by trainer.mode=ddp"):
        resnet("trainer.mode=ddp", "staleness=lookahead")


def test_a_comm_that_is_not_a_registered_allreduce_fails_validation():
    """Every run's timing prediction reads the allreduce's declared cost: an unknown comm stops in
    the launcher, naming the registered ones, not at the trainer's first log point."""
    cfg = composed("comm.name=butterfly")
    with pytest.raises(ConfigError, match=r"comm.name: allreduce='butterfly' is not known; allowed: ring, native, "
                                          r"tree, auto, hierarchical"):
        validate(cfg)


def test_a_compressor_the_allreduce_cannot_carry_fails_validation():
    with pytest.raises(ConfigError, match="compressor='int8' cannot ride the backend's all_reduce"):
        validate(composed("comm=native", "compressor=int8"))


def test_stopping_after_a_step_is_not_part_of_the_recipe():
    """A rerun stopped at a curve's first evaluation has the digest of the run it reruns (and a
    checkpoint written before the key existed still matches)."""
    from pipesgd.checkpoint import config_digest

    whole = OmegaConf.to_container(composed(), resolve=True)
    stopped = OmegaConf.to_container(composed("trainer.stop_after_step=390"), resolve=True)
    assert stopped["trainer"]["stop_after_step"] == 390
    older = {**whole, "trainer": {k: v for k, v in whole["trainer"].items() if k != "stop_after_step"}}
    assert config_digest(stopped) == config_digest(whole) == config_digest(older)
