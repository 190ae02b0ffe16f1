"""Config validation, no workers: the schema rejects unknown keys and wrong types with Hydra's
message; forced keys, ranges, settings a mode does not use, and the removed trainer.* staleness
aliases are one-line errors naming the key (and the aliases' new spelling); an option its group's
``_target_`` does not take (an experiment's optimizer.momentum under optimizer=adamw) names the
key, the target, the file that set it and the way out."""

from __future__ import annotations

import copy

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

import pipesgd.schema  # noqa: F401  (registers the structured config)
from pipesgd.outer import fill, settings
from pipesgd.config import ConfigError, check_removed, check_targets, command_line_keys, staleness_rule, validate
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
    ("dist.cpu_affinity=core", "dist.cpu_affinity='core' is not known; allowed: null, rank, local_rank"),
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
    (["trainer.mode=ps_async", "staleness=dc"], "staleness=dc is not used by trainer.mode=ps_async"),
])
def test_a_setting_the_mode_does_not_use_is_an_error(overrides, message):
    with pytest.raises(ConfigError) as err:
        validate(composed(*overrides), command_line_keys(overrides))
    assert message in str(err.value)


@pytest.mark.parametrize("overrides,width,staleness", [
    (["trainer.mode=ddp"], 1, "none"),                      # mnist_mlp's width 2 is pipe's default: ddp runs at 1
    (["trainer.mode=ddp", "trainer.width=2", "staleness=lookahead", "compressor=powersgd"], 2, "lookahead"),  # the pipelined hook
    (["trainer.mode=sync", "trainer.width=1", "trainer.warmup_sync_steps=0"], 1, "none"),  # the mode's own values
    (["trainer.mode=pipe", "trainer.width=4", "staleness=dc"], 4, "dc"),
])
def test_a_mode_ignores_the_config_files_width_but_not_the_command_lines(overrides, width, staleness):
    cfg = composed(*overrides)
    before = OmegaConf.to_container(cfg)
    settled = validate(cfg, command_line_keys(overrides))
    assert (settled.width, settled.staleness) == (width, staleness)  # what build() and the rule run at
    assert OmegaConf.to_container(cfg) == before, "validation leaves the config as composed"


def test_ddp_runs_the_pipelined_hook_only_when_the_command_line_asks_for_width_2():
    for overrides, width in ((["trainer.mode=ddp"], 1), (["trainer.mode=ddp", "trainer.width=2"], 2)):
        cfg = composed(*overrides)
        assert cfg.trainer.width == 2, "the config files' width is pipe's"
        assert validate(cfg, command_line_keys(overrides)).width == width
        assert cfg.trainer.width == 2, "and stays in the config"


def test_the_staleness_group_sets_the_rule_and_its_options():
    from hydra.utils import instantiate

    from pipesgd.reliability.checkpoint import config_digest

    cfg = composed("staleness=dc", "staleness.dc_lambda=0.1")
    validate(cfg)
    assert staleness_rule(cfg) == "dc"
    rule = instantiate(cfg.staleness)
    assert (rule.name, rule.dc_lambda, rule.momentum) == ("dc", 0.1, 0.95)
    assert instantiate(composed("staleness=dc", "staleness.dc_momentum=0.9").staleness).momentum == 0.9
    default = composed("staleness=dc")
    validate(default)
    as_dict = [OmegaConf.to_container(c, resolve=True, enum_to_str=True) for c in (cfg, default)]
    assert config_digest(as_dict[0]) != config_digest(as_dict[1]), "the digest sees the rule's options"
    assert "dc_lambda" not in cfg.trainer and "staleness" not in cfg.trainer


@pytest.mark.parametrize("override,spelling", [
    ("trainer.staleness=dc", "use staleness=dc (docs/convergence.md)"),
    ("+trainer.staleness=lookahead", "use staleness=lookahead"),
    ("trainer.dc_lambda=0.1", "use staleness=dc staleness.dc_lambda=0.1"),
    ("trainer.dc_adaptive=true", "use staleness=dc staleness.dc_adaptive=true"),
    ("trainer.staleness=none,lookahead", "use staleness=none,lookahead"),  # a sweep
])
def test_the_removed_staleness_aliases_name_their_new_spelling(override, spelling):
    """The entry point checks the command line before Hydra, whose message would suggest ``+``."""
    with pytest.raises(ConfigError) as err:
        check_removed(["+experiment=mnist_mlp", override])
    assert str(err.value).startswith(f"{override} is no longer a setting") and spelling in str(err.value)
    check_removed(["staleness=dc", "staleness.dc_lambda=0.1", "trainer.width=2"])  # the new spelling passes


def test_a_forced_removed_alias_is_refused_by_validation_with_its_new_spelling():
    """``+trainer.staleness=dc`` composes (``+`` appends past the schema); validation refuses it."""
    with pytest.raises(ConfigError, match=r"^trainer.staleness=dc is no longer a setting: .* use staleness=dc "):
        validate(composed("+trainer.staleness=dc"))
    with pytest.raises(ConfigError, match=r"use staleness=dc staleness.dc_lambda=0.1 "):
        validate(composed("+trainer.dc_lambda=0.1"))


def test_an_experiment_files_staleness_rule_is_pipes_default_not_a_conflict():
    """resnet_cifar's lookahead is pipe's setting: a mode without staleness runs it as none, unless the
    command line asks for the rule itself."""
    from hydra.utils import instantiate

    def resnet(*overrides):
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=["+experiment=resnet_cifar", *overrides])
        return cfg, validate(cfg, command_line_keys(["+experiment=resnet_cifar", *overrides]))

    cfg, settled = resnet("trainer.mode=ddp")
    assert settled.staleness == "none" and not settled.from_group
    assert staleness_rule(cfg) == "lookahead", "the config stays as composed"
    assert settled.record(OmegaConf.to_container(cfg))["staleness"] == {
        "_target_": "pipesgd.staleness.none.Plain"}, "checkpoints record the rule that runs, as before"
    assert resnet()[1].staleness == "lookahead" and instantiate(resnet()[0].staleness).name == "lookahead"
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
    from pipesgd.reliability.checkpoint import config_digest

    whole = OmegaConf.to_container(composed(), resolve=True)
    stopped = OmegaConf.to_container(composed("trainer.stop_after_step=390"), resolve=True)
    assert stopped["trainer"]["stop_after_step"] == 390
    older = {**whole, "trainer": {k: v for k, v in whole["trainer"].items() if k != "stop_after_step"}}
    assert config_digest(stopped) == config_digest(whole) == config_digest(older)


@pytest.mark.parametrize("mode, width, warmup, total, warned", [
    ("pipe", 2, 300, 300, True),    # the GPT recipe cut to 300 steps: synchronous throughout
    ("pipe", 2, 300, 301, False),   # one pipelined step
    ("pipe", 1, 300, 10, False),    # width 1 never pipelines anyway
    ("ddp", 2, 300, 10, False),     # the pipelined DDP hook does not read the warm-up
])
def test_a_warm_up_covering_the_whole_run_is_said(mode, width, warmup, total, warned, caplog):
    from pipesgd.train import _warn_if_never_pipelined

    cfg = OmegaConf.create({"trainer": {"mode": mode, "warmup_sync_steps": warmup}})
    with caplog.at_level("WARNING", logger="pipesgd.train"):
        _warn_if_never_pipelined(cfg, width, total, is_main=True)
    assert ("trainer.warmup_sync_steps=300 covers all" in caplog.text) == warned


def _with_origin(*overrides: str):
    """The composed job config without its hydra node, and where its keys came from."""
    from pipesgd.config import KeyOrigin

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    origin = KeyOrigin(cfg.hydra.runtime.choices, overrides)
    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        cfg.pop("hydra")
    return cfg, origin


@pytest.mark.parametrize("overrides,message", [
    (["+experiment=mnist_mlp", "optimizer=adamw"],
     "optimizer.momentum=0.9 is not an option of optimizer=adamw (pipesgd.optim.adamw), which takes betas, eps, "
     "exclude_1d, lr, params, weight_decay; it was set by conf/experiment/mnist_mlp.yaml. An option written for "
     "another optimizer outlives a swap to this one: drop it with ~optimizer.momentum on the command line"),
    (["+experiment=resnet_cifar", "optimizer=adam"], "optimizer.momentum=0.9 is not an option of optimizer=adam "
                                                     "(torch.optim.Adam)"),
    (["scheduler=constant", "+scheduler.gamma=1"], "scheduler.gamma=1 is not an option of "
                                                           "scheduler=constant"),
    (["+model.depth=3"], "model.depth=3 is not an option of model=resnet20"),
    (["+data.shuffle=false"], "data.shuffle=False is not an option of data=cifar10 (pipesgd.data.CIFAR10)"),
    (["compressor=int8", "+compressor.rank=2"], "compressor.rank=2 is not an option of compressor=int8 "
                                                "(pipesgd.compress.int8.Int8), which takes block_size, error_feedback"),
    (["staleness=dc", "+staleness.lr=1"], "staleness.lr=1 is not an option of staleness=dc"),
])
def test_an_option_the_target_does_not_take_is_refused_naming_key_target_and_origin(overrides, message):
    cfg, origin = _with_origin(*overrides)
    with pytest.raises(ConfigError) as err:
        validate(cfg, command_line_keys(overrides), origin)
    assert message in str(err.value), str(err.value)
    if any(o.startswith("+") and "." in o for o in overrides):
        assert "it was set by the command line (+" in str(err.value)


def test_the_way_out_of_a_swapped_optimizer_passes():
    cfg, origin = _with_origin("+experiment=mnist_mlp", "optimizer=adamw", "~optimizer.momentum")
    check_targets(cfg, origin)


EXPERIMENTS = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))
VARIANTS = sorted(p.stem for p in (ROOT / "conf" / "variant").glob("*.yaml"))


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_and_variant_passes_the_target_check(experiment):
    """The examples' sweep script runs mnist_mlp x trainer.mode x compressor by default: options only
    of groups that keep their targets; the variants are the study's deltas."""
    for extra in [[], *([f"+variant={v}"] for v in VARIANTS), ["compressor=int8"]]:
        check_targets(_with_origin(f"+experiment={experiment}", *extra)[0])


def test_the_gpt_diloco_recipe_streams_fragments_that_land_a_step_late_and_mix():
    # measured (docs/period-h.md, "The controls"): fragments landing a step late and mixed half and
    # half end on sync's loss at H = 10 (three seeds); kept on top, +1.53 %; the whole round late
    # (eager, plain step) +8.9 %: the recipe takes the first, at the share that follows M ("The
    # landing's share follows M"), and passes every check
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["+experiment=gpt_diloco"])
    settled = validate(cfg, command_line_keys(["+experiment=gpt_diloco"]))
    assert (cfg.trainer.sync_every, settled.width, settled.staleness) == (10, 2, "none")
    assert (cfg.trainer.fragments, cfg.trainer.sync_delay, cfg.compressor._target_) == (5, 1, "pipesgd.compress.int8.Int8")
    assert cfg.trainer.landing_alpha == "auto"  # the local share follows M (pipesgd.outer.landing_alpha)
    # the outer step follows H and M (outer_optimizer=auto), at H = 10 the papers' Nesterov 0.7 / 0.9
    outer = fill(OmegaConf.to_container(cfg.outer_optimizer), cfg.trainer.sync_every, cfg.dist.nproc)
    assert (outer["lr"], outer["momentum"], outer["nesterov"]) == (0.7, 0.9, True)


def test_every_independent_problem_is_named_in_one_refusal():
    overrides = ["+experiment=gpt_shakespeare", "trainer.sync_every=10", "trainer.fragments=3", "trainer.log_every=0"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    with pytest.raises(ConfigError) as err:
        validate(cfg, command_line_keys(overrides))
    lines = str(err.value).splitlines()
    assert lines[0] == "3 problems in this config:", str(err.value)
    assert lines[1].startswith("  1. trainer.log_every=0 is invalid")
    assert lines[2].startswith("  2. staleness=lookahead is a rule for per-step gradients")
    assert lines[3].startswith("  3. trainer.fragments=3 does not divide trainer.sync_every=10")
    with pytest.raises(ConfigError) as one:  # one problem: its own message, as before
        validate(composed("trainer.log_every=0"))
    assert str(one.value).startswith("trainer.log_every=0 is invalid")


@pytest.mark.parametrize("h", [5, 10, 25])
def test_a_user_who_sets_only_sync_every_gets_the_outer_step_of_that_h(h):
    """outer_optimizer=auto by default: nothing set but trainer.sync_every, and the run's outer step
    is pipesgd.outer.settings(H, M); a value set on the command line is kept."""
    from pipesgd.train import _outer_optimizer

    overrides = ["+experiment=gpt_shakespeare", "trainer.mode=sync", "trainer.width=1", "staleness=none",
                 "trainer.warmup_sync_steps=0", f"trainer.sync_every={h}"]
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
        kept = compose("config", overrides=[*overrides, "outer_optimizer.lr=0.25"])
    validate(cfg, command_line_keys(overrides))
    opt = _outer_optimizer(cfg, 2)([torch.zeros(1, requires_grad=True)])
    group = opt.param_groups[0]
    assert (group["lr"], group["momentum"], group["nesterov"]) == tuple(settings(h, 2).as_dict().values())
    assert _outer_optimizer(kept, 2)([torch.zeros(1, requires_grad=True)]).param_groups[0]["lr"] == 0.25
