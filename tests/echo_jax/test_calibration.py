"""echo_jax.calibration: site-config names, wire costs and the greedy choice under a budget."""

import itertools

import numpy as np
import pytest

import echo_jax as ej


@pytest.mark.parametrize("name,bits,g,policy,rotation,wire", [
    ("4g128", 4, 128, "asym", "none", 4.25),
    ("4g64", 4, 64, "asym", "none", 4.5),
    ("4g32", 4, 32, "asym", "none", 5.0),
    ("4g64-sym", 4, 64, "sym", "none", 4.25),
    ("4g128-naive-h", 4, 128, "asym_naive", "hadamard", 4.25),
    ("8g128", 8, 128, "asym", "none", 8.25),
])
def test_names_round_trip_and_wire_bits(name, bits, g, policy, rotation, wire):
    cfg = ej.parse_site_config(name)
    assert (cfg.bits, cfg.group_size, cfg.policy, cfg.rotation) == (bits, g, policy, rotation)
    assert ej.site_config_label(cfg) == name
    assert ej.parse_site_config(ej.site_config_label(cfg)) == cfg
    assert ej.site_wire_bits(cfg) == wire == cfg.wire_bits_per_element


def test_eta_suffix_round_trips():
    cfg = ej.parse_site_config("4g128-h-eta0")
    assert cfg.eta == 0.0 and cfg.rotation == "hadamard"
    assert ej.site_config_label(cfg) == "4g128-h-eta0"
    assert ej.parse_site_config("8g64-sym-eta0.5").eta == 0.5
    with pytest.raises(ValueError, match="eta must be in"):
        ej.parse_site_config("4g128-eta2")
    with pytest.raises(ValueError, match="'eta1.2.3' is not eta<number>"):
        ej.parse_site_config("4g128-eta1.2.3")


def test_exact_and_rotation_default():
    assert ej.parse_site_config("16") is None and ej.parse_site_config("exact") is None
    assert ej.site_wire_bits(None) == 16.0 and ej.site_config_label(None) == "16"
    assert ej.parse_site_config("4g64", rotation="hadamard").rotation == "hadamard"


@pytest.mark.parametrize("bad", ["4bit", "g128", "4g", "4g128-foo", "3g7"])
def test_bad_names_name_the_value(bad):
    with pytest.raises(ValueError, match=bad):
        ej.parse_site_config(bad)


def test_greedy_spends_on_the_sensitive_site_and_respects_budget():
    # 4 sites, options 4.25 / 4.5 / 8.25 bits: site 2 gains most from 8 bits.
    costs = [4.25, 4.5, 8.25]
    est = np.array([[1.0, 0.9, 0.0], [1.0, 0.8, 0.0], [9.0, 6.0, 0.0], [1.0, 0.95, 0.0]])
    choice, steps = ej.choose_site_configs(est, costs, budget=5.25)
    assert choice[2] == 2 and sum(costs[c] for c in choice) / 4 <= 5.25
    assert steps[0]["site"] == 2
    assert steps[-1]["average_bits"] == pytest.approx(sum(costs[c] for c in choice) / 4)


def test_greedy_matches_exhaustive_on_a_convex_case():
    rng = np.random.default_rng(0)
    costs = np.array([4.25, 4.5, 5.0])
    # convex per-site gains: diminishing returns per bit, so greedy is optimal up to one item
    base = rng.uniform(0.5, 3.0, size=(5, 1))
    est = base * np.array([[1.0, 0.4, 0.1]])
    budget = 4.6
    choice, _ = ej.choose_site_configs(est, costs, budget)
    best = min((c for c in itertools.product(range(3), repeat=5)
                if costs[list(c)].mean() <= budget + 1e-9),
               key=lambda c: est[np.arange(5), list(c)].sum())
    got = est[np.arange(5), choice].sum()
    opt = est[np.arange(5), list(best)].sum()
    assert got <= opt + float(est.max() - est.min())  # within one item of the optimum
    assert costs[choice].mean() <= budget + 1e-9


def test_greedy_errors_name_the_values():
    with pytest.raises(ValueError, match="budget 4 .*cheapest option \\(4.25\\)"):
        ej.choose_site_configs(np.zeros((2, 2)), [4.25, 8.25], 4.0)
    with pytest.raises(ValueError, match="shapes \\(2, 2\\) and \\(3,\\)"):
        ej.choose_site_configs(np.zeros((2, 2)), [4.25, 8.25, 5.0], 5.0)
    choice, steps = ej.choose_site_configs([[1.0, np.nan]], [4.25, 8.25], 9.0)
    assert choice == [0] and steps == []
