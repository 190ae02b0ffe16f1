"""The outer step's defaults (pipesgd.outer): the sweep's points, what lies between, and the
config's nulls filled from them while a value a user set is kept."""

import pytest

from pipesgd import outer


@pytest.mark.parametrize("h,lr,momentum", outer.MEASURED)
def test_measured_points_are_the_defaults(h, lr, momentum):
    s = outer.settings(h, 2)
    assert (s.lr, s.momentum, s.nesterov) == (lr, momentum, momentum > 0)


def test_between_and_beyond_the_measured_points():
    (h0, lr0, m0), (h1, lr1, m1) = outer.MEASURED[0], outer.MEASURED[-1]
    assert outer.settings(2) == outer.settings(h0)  # below the first: the first's
    assert outer.settings(h1 * 20) == outer.settings(h1)  # beyond the last: the last's
    mid = outer.settings(round((h0 * h1) ** 0.5))
    assert min(m0, m1) <= mid.momentum <= max(m0, m1) and min(lr0, lr1) <= mid.lr <= max(lr0, lr1)


def test_fill_keeps_what_was_set():
    assert outer.fill({"lr": 0.5, "momentum": None, "nesterov": None}, 5, 2)["lr"] == 0.5
    auto = outer.fill({"lr": None, "momentum": None, "nesterov": None}, 10, 2)
    assert auto == outer.settings(10, 2).as_dict()
    # a momentum of 0 set by hand is never given Nesterov's (torch refuses it)
    assert outer.fill({"lr": None, "momentum": 0.0, "nesterov": None}, 10, 2)["nesterov"] is False


@pytest.mark.parametrize("h,m,name", [(0, 2, "sync_every=0"), (True, 2, "sync_every=True"), (5, 0, "replicas=0")])
def test_bad_values_are_named(h, m, name):
    with pytest.raises(ValueError, match=name):
        outer.settings(h, m)


def test_factory_builds_sgd_with_the_settings():
    import torch

    opt = outer.factory(10, 2)([torch.zeros(2, requires_grad=True)])
    assert outer.describe(opt) == {"optimizer": "SGD", **outer.settings(10, 2).as_dict()}


def test_the_landing_share_is_the_sweeps_best_and_one_over_the_replicas_between():
    low, high = outer.LANDING_REPLICAS
    assert [outer.landing_alpha(m) for m in (2, 4, 8)] == [0.25, 0.25, 0.125]  # the sweep's best at each M
    assert outer.landing_alpha(6) == 1 / 6
    assert outer.landing_alpha(1) == 1 / low and outer.landing_alpha(64) == 1 / high  # held beyond
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match=f"replicas={bad!r}"):
            outer.landing_alpha(bad)
