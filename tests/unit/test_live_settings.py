"""``trainer.live.*`` (the lighthouse and the replica groups of trainer.mode=live): a bad value is
refused before any worker starts, naming the key; the values the config sets reach the
lighthouse and every replica group's options. No lighthouse, process or timing involved."""

from __future__ import annotations

import importlib.util
import re

import pytest
from omegaconf import OmegaConf

from pipesgd.config import ConfigError, command_line_keys, staleness_rule, validate
from pipesgd.live import launch as live_launch
from pipesgd.live.options import LiveOptions, options_from_env
from test_config import composed


@pytest.mark.parametrize("override,message", [
    ("trainer.live.heartbeat_timeout_ms=0", "trainer.live.heartbeat_timeout_ms=0 is invalid: must be an integer >= 1"),
    ("trainer.live.join_timeout_ms=-5", "trainer.live.join_timeout_ms=-5 is invalid"),
    ("trainer.live.min_replicas=0", "trainer.live.min_replicas=0 is invalid"),
    ("trainer.live.timeout_s=0", "trainer.live.timeout_s=0.0 is invalid: must be a number of seconds > 0"),
    ("trainer.live.quorum_timeout_s=-1", "trainer.live.quorum_timeout_s=-1.0 is invalid"),
    ("trainer.live.lighthouse_port=70000", "trainer.live.lighthouse_port=70000 is invalid"),
    ("trainer.live.host=''", "trainer.live.host='' would listen on every interface"),
    ("+trainer.live.heartbeat_ms=5", "trainer.live.heartbeat_ms is not a setting; did you mean "
                                     "trainer.live.heartbeat_timeout_ms?"),
])
def test_a_bad_live_setting_is_refused_naming_the_key_and_value(override, message):
    overrides = ["trainer.mode=live", override]
    with pytest.raises(ConfigError) as err:
        validate(composed(*overrides), command_line_keys(overrides))
    assert message in str(err.value)


def test_a_wrongly_typed_live_setting_is_refused_by_the_schema():
    with pytest.raises(Exception) as err:
        composed("trainer.mode=live", "trainer.live.heartbeat_timeout_ms=soon")
    assert "could not be converted to Integer" in f"{err.value} {err.value.__cause__}"


def test_live_settings_on_another_mode_are_an_error():
    overrides = ["trainer.mode=pipe", "trainer.live.heartbeat_timeout_ms=2000"]
    with pytest.raises(ConfigError, match=r"trainer.live.heartbeat_timeout_ms is not used by trainer.mode=pipe; "
                                          r"only trainer.mode=live\|torchft_diloco read trainer.live"):
        validate(composed(*overrides), command_line_keys(overrides))
    validate(composed("trainer.mode=pipe"), command_line_keys(["trainer.mode=pipe"]))  # the file's defaults: fine


class _Stop(Exception):
    pass


def test_the_configured_heartbeat_and_timeouts_reach_the_lighthouse_and_the_replicas(monkeypatch, tmp_path):
    overrides = ["trainer.mode=live", "trainer.live.heartbeat_timeout_ms=2500", "trainer.live.join_timeout_ms=700",
                 "trainer.live.min_replicas=2", "trainer.live.timeout_s=12", "trainer.live.quorum_timeout_s=45"]
    cfg = composed(*overrides)
    validate(cfg, command_line_keys(overrides))
    container = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    seen = {}

    class Lighthouse:  # records what the launcher starts it with; a real one needs torchft
        def __init__(self, options):
            seen["lighthouse"] = options
            self.address = "http://127.0.0.1:1"

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    class Context:  # records the first replica group's environment instead of starting it
        def Process(self, target, args, name):  # noqa: N802 (multiprocessing's spelling)
            seen["env"] = args[0]
            raise _Stop

    monkeypatch.setattr(live_launch, "Lighthouse", Lighthouse)
    monkeypatch.setattr(live_launch.multiprocessing, "get_context", lambda method: Context())
    with pytest.raises(_Stop):
        live_launch.run(lambda *a: None, (container, str(tmp_path)), nproc=2)
    lighthouse = seen["lighthouse"]
    assert (lighthouse.heartbeat_timeout_ms, lighthouse.join_timeout_ms, lighthouse.min_replicas) == (2500, 700, 2)
    for key, value in seen["env"].items():
        monkeypatch.setenv(key, value)
    replica = options_from_env()
    assert (replica.timeout_s, replica.quorum_timeout_s, replica.min_replicas, replica.replica) == (12, 45, 2, 0)
    assert replica.init_sync is False
    assert replica.lighthouse == "http://127.0.0.1:1"


@pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="torchft is not installed")
def test_the_lighthouse_hands_its_options_to_torchfts_server(monkeypatch):
    import torchft.coordination

    from pipesgd.live.lighthouse import Lighthouse, LighthouseOptions

    seen = {}

    class Server:
        def __init__(self, **kwargs):
            seen.update(kwargs)

        def address(self):
            return "http://somehost:4321"

        def shutdown(self):
            pass

    monkeypatch.setattr(torchft.coordination, "LighthouseServer", Server)
    with Lighthouse(LighthouseOptions(heartbeat_timeout_ms=2500, join_timeout_ms=700, min_replicas=2)) as lighthouse:
        assert lighthouse.address == "http://127.0.0.1:4321"
    assert seen == {"bind": "127.0.0.1:0", "min_replicas": 2, "join_timeout_ms": 700, "quorum_tick_ms": 20,
                    "heartbeat_timeout_ms": 2500}


def test_the_defaults_are_the_library_defaults():
    """conf/trainer/default.yaml's trainer.live and the schema's defaults build what the library
    builds when given nothing."""
    from pipesgd.live.lighthouse import LighthouseOptions

    lighthouse, replica = live_launch.settings(OmegaConf.to_container(composed("trainer.mode=live").trainer.live))
    # but for torchft's step-0 sync: the composition root seeds every group alike, a library caller may not
    assert lighthouse == LighthouseOptions() and replica == LiveOptions("-", "-", 0, init_sync=False)
    assert live_launch.settings({}) == (lighthouse, LiveOptions("-", "-", 0, init_sync=True))


@pytest.mark.parametrize("rule", ["none", "lookahead", "predict", "dc", "dga"])
def test_the_live_mode_takes_every_staleness_rule_whose_heal_is_tested(rule):
    overrides = ["trainer.mode=live", f"staleness={rule}"]
    cfg = composed(*overrides)
    validate(cfg, command_line_keys(overrides))
    assert staleness_rule(cfg) == rule


def test_dga_under_the_live_mode_still_refuses_an_optimizer_it_cannot_follow():
    overrides = ["trainer.mode=live", "staleness=dga", "optimizer=adamw", "~optimizer.momentum"]
    with pytest.raises(ConfigError, match=r"staleness=dga assumes the update of torch.optim.sgd.SGD and cannot run "
                                          r"with optimizer torch.optim.adamw.AdamW"):
        validate(composed(*overrides), command_line_keys(overrides))


def test_the_live_engine_refuses_a_rule_whose_heal_is_not_tested():
    """A rule registered later runs under live only once it is in STALENESSES, with a test of its heal."""
    import torch

    from pipesgd.live.engine import LiveEngine
    from pipesgd.staleness.none import Plain

    class Untested(Plain):
        name = "untested"

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="staleness=untested is not available with trainer.mode=live; allowed: "
                                         "none, lookahead, predict, dc, dga"):
        LiveEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), LiveOptions("http://127.0.0.1:1", "r", 0),
                   staleness=Untested())


@pytest.mark.parametrize("comm,compressor", [("ring", "int8"), ("ring", "fp16"), ("ring", "bf16"), ("ring", "none"),
                                             ("native", "fp16"), ("native", "bf16"), ("auto", "int8"),
                                             ("ring", "topk"), ("auto", "powersgd"), ("native", "powersgd"),
                                             ("ring", "int8 compressor.error_feedback=true"),
                                             ("native", "bf16 compressor.error_feedback=true"),
                                             ("tree", "none"), ("tree", "int8"), ("tree", "bf16")])
def test_the_live_mode_takes_the_ring_the_tree_and_the_native_allreduce_with_what_each_carries(comm, compressor):
    overrides = ["trainer.mode=live", f"comm={comm}", *f"compressor={compressor}".split()]
    validate(composed(*overrides), command_line_keys(overrides))


# the one allreduce the live mode refuses, with its reason
HIERARCHICAL = ("comm=hierarchical is not available with trainer.mode=live: its levels are nodes of several "
                "processes, and a live replica group is one process (one rank of torchft's group): there is no node "
                "to reduce inside, and over one process per group it is the ring, comm=ring; allowed: auto, native, "
                "ring, tree")


@pytest.mark.parametrize("overrides,message", [
    (["comm=hierarchical"], HIERARCHICAL),
    (["comm=native", "compressor=int8"], "compressor='int8' cannot ride the backend's all_reduce"),
    (["comm=native", "compressor=int8", "compressor.error_feedback=true"],
     "compressor='int8' cannot ride the backend's all_reduce"),
])
def test_what_the_live_mode_cannot_honour_is_refused_naming_the_key(overrides, message):
    overrides = ["trainer.mode=live", *overrides]
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(composed(*overrides), command_line_keys(overrides))


@pytest.mark.parametrize("kwargs,message", [
    ({"allreduce": "hierarchical"}, HIERARCHICAL),
    ({"allreduce": "native", "compressor": "int8"}, "compressor='int8' cannot ride the backend's all_reduce"),
])
def test_the_live_engine_refuses_what_it_cannot_carry_before_it_starts_anything(kwargs, message):
    import torch

    from pipesgd.live.engine import LiveEngine

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=re.escape(message)):
        LiveEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), LiveOptions("http://127.0.0.1:1", "r", 0),
                   **kwargs)
