"""Smoke tests of the toy-stack demo (echo_jax_tools.demo) and the CLI `python -m echo_jax demo`.

The demo is run at tiny sizes; the assertions check what it is meant to show: the Echo paper's
error ordering between modes, the partial-sum bounds of Theorem 1 / Eq. 21 on the measured
errors, and the constants 1 + mu_w.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from echo_jax.__main__ import main, request_host_devices
from echo_jax.config import EchoConfig
from echo_jax_tools import demo

RANKS = 4
SITES = 12
TINY = dict(ranks=RANKS, sites=SITES, tokens=8, dim=64, hidden=128, seed=0, progress=False)
REPO = Path(__file__).resolve().parents[2]


def _need_devices(n=RANKS):
    have = len(jax.devices("cpu"))
    if have < n:
        pytest.skip(f"the demo needs {n} CPU devices, only {have} present "
                    "(set XLA_FLAGS=--xla_force_host_platform_device_count=8)")


@pytest.fixture(scope="module")
def result():
    _need_devices()
    return demo.run_demo(**TINY)


@pytest.fixture(scope="module")
def rows(result):
    return {r["mode"]: r for r in result["rows"]}


def test_rows_complete_and_finite(result):
    assert [r["mode"] for r in result["rows"]] == list(demo.MODE_NAMES)
    for row in result["rows"]:
        assert set(row) == {"mode", *demo.ROW_KEYS}
        for key in demo.ROW_KEYS:
            assert math.isfinite(row[key]) and row[key] > 0, (row["mode"], key, row[key])
    cfg = result["config"]
    assert (cfg["ranks"], cfg["sites"], cfg["tokens"], cfg["dim"]) == (RANKS, SITES, 8, 64)


def test_compensation_bounds_partial_sum(rows):
    # The point of the compensator (Sec. 5.2): smaller accumulated error and output error.
    assert rows["4-bit comp"]["max_partial_sum"] < rows["4-bit"]["max_partial_sum"]
    assert rows["4-bit comp"]["accumulation_ratio"] < rows["4-bit"]["accumulation_ratio"]
    assert rows["4-bit comp"]["final_rel_error"] < rows["4-bit"]["final_rel_error"]


def test_bit_width_ordering(rows):
    # 16 levels against 256 per group: 8-bit errors are about 16x smaller than 4-bit ones.
    assert rows["8-bit"]["max_site_error"] < rows["4-bit"]["max_site_error"] / 4
    assert rows["8-bit"]["mean_site_error"] < rows["4-bit"]["mean_site_error"] / 4
    # bf16 rounds each value relative to itself, 8-bit relative to its group's range.
    assert rows["16-bit"]["max_site_error"] < rows["8-bit"]["max_site_error"] / 2
    assert rows["16-bit"]["max_partial_sum"] < rows["8-bit"]["max_partial_sum"] / 2
    final = [rows[m]["final_rel_error"] for m in ("16-bit", "8-bit", "4-bit comp", "4-bit")]
    assert final == sorted(final), final


def replay(mode, mesh, w1, w2, z0):
    """The demo's stack once more, site by site, with every measurement in NumPy float64.

    JAX computes only what the demo's row is about: each rank's block output (the demo's
    `block_contribution` under the same shard_map) and the all-reduce itself (psum, or
    echo_psum with the state it returned at the previous site). The exact sums, the corrections
    c = eta (a m1 + (1 - a) m2) (Eq. 10, from the config's fields), rho_k (Eq. 5), delta_k
    (Eq. 1, against x' = x + c), S_t (Eq. 6) and their norms are computed here.

    Returns (||rho_k||, ||delta_k||, ||S_t||) per site and the final hidden state.
    """
    spec = (P(), P(None, "tp"), P("tp", None))
    contrib = jax.jit(jax.shard_map(lambda z, a, b: demo.block_contribution(z, a, b)[None],
                                    mesh=mesh, in_specs=spec, out_specs=P("tp")))
    cfg = mode.config

    def reduce_body(x, m1, m2):
        x, m1, m2 = x[0], m1[0], m2[0]
        if mode.kind == "exact":
            y = lax.psum(x, "tp")
        elif mode.kind == "bf16":
            y = lax.psum(x.astype(jnp.bfloat16), "tp").astype(jnp.float32)
        elif not mode.compensated:
            y = demo.echo_psum(x, "tp", config=cfg)
        else:
            y, st = demo.echo_psum(x, "tp", config=cfg, state=demo.comp.CompensatorState(m1, m2))
            m1, m2 = st.m1, st.m2
        mat = getattr(jax.typeof(y), "mat", None)
        y = y if mat is not None and "tp" in mat.varying else lax.pcast(y, "tp", to="varying")
        return y[None], m1[None], m2[None]

    reduce = jax.jit(jax.shard_map(reduce_body, mesh=mesh, in_specs=(P("tp"),) * 3,
                                   out_specs=(P("tp"),) * 3))
    z = np.asarray(z0, np.float32)
    m1 = m2 = np.zeros((RANKS,) + z.shape, np.float32)
    s_sum = np.zeros(z.shape, np.float64)
    rho_n, delta_n, s_n = [], [], []
    for k in range(w1.shape[0]):
        x = np.asarray(contrib(z, w1[k], w2[k]))                       # [P, tokens, d]
        y, n1, n2 = (np.asarray(a) for a in reduce(x, m1, m2))
        assert all(np.array_equal(y[0], y[r]) for r in range(RANKS))
        x64 = x.astype(np.float64)
        if mode.compensated:
            e, a = cfg.eta, cfg.blend
            xp = x64 + e * (a * m1.astype(np.float64) + (1 - a) * m2.astype(np.float64))
        else:
            xp = x64
        rho = y[0].astype(np.float64) - x64.sum(0)
        s_sum = s_sum + rho
        rho_n.append(np.linalg.norm(rho))
        delta_n.append(np.linalg.norm(y[0].astype(np.float64) - xp.sum(0)))
        s_n.append(np.linalg.norm(s_sum))
        z = z + y[0]                                                   # fp32, as the demo
        m1, m2 = n1, n2
    return np.array(rho_n), np.array(delta_n), np.array(s_n), z


def test_rows_match_an_independent_replay(result):
    """Every number of every row against the replay's float64 measurements: mean / max
    ||rho_k||, max ||delta_k|| (q), max ||S_t||, their ratio and the final relative error."""
    mesh = demo.make_mesh(RANKS)
    w1, w2 = demo.init_weights(SITES, TINY["dim"], TINY["hidden"], TINY["seed"])
    z0 = demo.init_hidden(TINY["tokens"], TINY["dim"], TINY["seed"])
    modes = {m.name: m for m in demo.demo_modes()}
    runs = {name: replay(m, mesh, w1, w2, z0) for name, m in modes.items()}
    z_exact = runs["exact"][3].astype(np.float64)
    assert runs["exact"][0].max() < 1e-4 * np.linalg.norm(z_exact)   # the reference is exact
    for row in result["rows"]:
        rho, delta, s_n, z = runs[row["mode"]]
        want = {"mean_site_error": rho.mean(), "max_site_error": rho.max(),
                "max_injected_error": delta.max(), "max_partial_sum": s_n.max(),
                "accumulation_ratio": s_n.max() / rho.max(),
                "final_rel_error": np.linalg.norm(z - z_exact) / np.linalg.norm(z_exact)}
        for key, v in want.items():
            assert row[key] == pytest.approx(v, rel=1e-4), (row["mode"], key, row[key], v)
    # Compensation changes what enters the stream: rho_k and delta_k differ there (Eq. 5).
    rho, delta = runs["4-bit comp"][:2]
    assert np.all(np.abs(rho - delta)[1:] > 1e-3 * delta[1:])


def test_partial_sums_within_paper_bounds(result, rows):
    # Eq. 21 holds for any error sequence with ||delta_k|| <= q; q is measured in the same run.
    # (Without compensation max ||S_t|| <= N q is the triangle inequality, true of any
    # sequence; the rows' numbers themselves are checked by the replay above.)
    comp = rows["4-bit comp"]
    bound = result["config"]["eq21_factor"] * comp["max_injected_error"]
    assert comp["max_partial_sum"] <= bound * (1 + 1e-4)


@pytest.mark.slow   # the demo's stack once more at eta = 1; the fast set runs the stack (the
#                    `result` fixture) and Theorem 1 at eta = 1 (test_compensator.py)
def test_theorem1_at_full_gain():
    _need_devices()
    comp = {r["mode"]: r for r in demo.run_demo(**TINY, eta=1.0)["rows"]}["4-bit comp"]
    # Theorem 1: max_t ||S_t|| <= (1 + mu_w) q at eta = 1.
    assert comp["max_partial_sum"] <= demo.theorem1_factor() * comp["max_injected_error"] * 1.0001


def test_theorem1_constants():
    assert demo.theorem1_factor() == pytest.approx(1 + 0.35 * 0.7 / 0.3 + 0.65 * 0.3 / 0.7)
    assert demo.theorem1_factor() == pytest.approx(2.0952, abs=1e-4)  # the paper's "about 2.1"
    w = demo.compensator_weights(400)
    assert w.sum() == pytest.approx(1.0)
    assert float(np.sum(np.arange(400) * w)) == pytest.approx(demo.mean_age())
    # 1 + mu_w = sum_m T_m with the tails T_m = sum_{r >= m} w_r (Eq. 18, 19).
    tails = np.cumsum(w[::-1])[::-1]
    assert float(tails.sum()) == pytest.approx(demo.theorem1_factor())
    cfg = EchoConfig(blend=0.5, beta1=0.5, beta2=0.0)
    assert demo.theorem1_factor(cfg) == pytest.approx(1.5)
    assert demo.theorem1_factor(beta1=0.0, beta2=0.0) == pytest.approx(1.0)
    assert demo.eq21_factor(56, eta=1.0) == pytest.approx(demo.theorem1_factor())
    assert demo.eq21_factor(56, eta=0.0) == pytest.approx(56.0)
    with pytest.raises(ValueError, match="beta1"):
        demo.theorem1_factor(beta1=1.0)


def test_too_few_devices_is_a_clear_error():
    have = len(jax.devices("cpu"))
    with pytest.raises(ValueError, match=rf"needs {have + 1} cpu devices.*only {have}"):
        demo.make_mesh(have + 1)


def test_main_reports_too_few_devices(capsys):
    have = len(jax.devices("cpu"))
    status = main(["demo", "--ranks", str(have * 2), "--sites", "2", "--tokens", "8",
                   "--dim", "64", "--hidden", str(have * 2), "--no-progress"])
    assert status == 2
    err = capsys.readouterr().err
    assert str(have * 2) in err and str(have) in err


def test_request_host_devices(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/dev/null")
    request_host_devices(4)
    assert os.environ["XLA_FLAGS"] == ("--xla_dump_to=/dev/null "
                                       "--xla_force_host_platform_device_count=8")
    monkeypatch.delenv("XLA_FLAGS")
    request_host_devices(16)
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=16"
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    request_host_devices(16)  # an explicit count is the user's choice
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "echo_jax", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def test_cli_help():
    proc = _cli("--help")
    assert proc.returncode == 0, proc.stderr
    assert "demo" in proc.stdout


def test_cli_demo_json(tmp_path):
    out = tmp_path / "demo.json"
    proc = _cli("demo", "--sites", "8", "--tokens", "8", "--dim", "64", "--hidden", "128",
                "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    for name in demo.MODE_NAMES:
        assert name in proc.stdout
    assert "Theorem 1" in proc.stdout
    data = json.loads(out.read_text())
    assert data["config"]["sites"] == 8 and data["config"]["ranks"] == 4
    assert [r["mode"] for r in data["rows"]] == list(demo.MODE_NAMES)
    for row in data["rows"]:
        for key in ("mean_site_error", "max_site_error", "max_partial_sum",
                    "accumulation_ratio", "final_rel_error"):
            assert math.isfinite(row[key])
