"""models.experiments (the accuracy study): CPU smoke tests of every sub-command.

Random weights of the `tiny` preset (the text fed as UTF-8 bytes), a couple of 32-token windows,
so each run takes seconds. The tests check that the pipeline runs and writes the JSON fields and
the PNG, not the numbers; and that the measurements of the error-process study (the model's own
forward pass, read through its site tap) equal the hand-written forward pass they replaced.
"""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from echo_jax import compensator as comp
from echo_jax.collective import echo_psum
from echo_jax_tools.provenance import device_name
from models import data as D
from models import experiments as X
from models import model as M
from models.config import get_config

TEXT = ("Shall I compare thee to a summer's day? Thou art more lovely and more temperate. "
        "Rough winds do shake the darling buds of May, and summer's lease hath all too short "
        "a date. ") * 4


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("exp") / "sonnet.txt"
    path.write_text(TEXT)
    return path


def common(text_file, out, *extra):
    return ["--checkpoint", "random:tiny", "--tp", "2", "--window", "32", "--windows", "2",
            "--text", str(text_file), "--out-dir", str(out), "--quiet", *extra]


def read(path):
    return json.loads(Path(path).read_text())


def assert_png(path):
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_help_exits_zero(capsys):
    for argv in (["--help"], ["inference", "--help"], ["ablations", "--help"],
                 ["error-process", "--help"], ["pretrain-table", "--help"], ["beyond", "--help"]):
        with pytest.raises(SystemExit) as exc:
            X.main(argv)
        assert exc.value.code == 0, argv
    assert "--max-tokens" in capsys.readouterr().out


@pytest.mark.slow
def test_inference_writes_every_row(text_file, tmp_path):
    assert X.main(["inference", *common(text_file, tmp_path)]) == 0
    out = tmp_path / "accuracy_inference_random-tiny.json"
    r = read(out)
    assert_png(out.with_suffix(".png"))
    keys = [row["config"] for row in r["rows"]]
    assert keys == ["16bit", "8bit-comp", "8bit-none", "4bit-comp", "4bit-none", "4bit-sym",
                    "4bit-naive", "early-8bit"]
    m = r["meta"]
    assert m["tp"] == 2 and m["window"] == 32 and m["windows"] == 2 and m["tokens_scored"] == 64
    assert m["forward_sites"] == 4 and r["command"].startswith("python -m models.experiments")
    for row in r["rows"]:
        for k in ("perplexity", "nll", "tokens", "greedy_agreement", "delta_ppl_vs_16bit",
                  "next_token_accuracy", "wire_bits_per_element", "bits", "policy",
                  "group_size", "compensated", "eta", "early_8bit"):
            assert k in row, (row["config"], k)
        assert row["tokens"] == 64 and 0 <= row["greedy_agreement"] <= 1
    by = {row["config"]: row for row in r["rows"]}
    assert by["16bit"]["greedy_agreement"] == 1.0 and by["16bit"]["delta_ppl_vs_16bit"] == 0.0
    assert by["4bit-none"]["eta"] == 0.0 and not by["4bit-none"]["compensated"]
    assert by["4bit-sym"]["policy"] == "sym" and by["4bit-naive"]["policy"] == "asym_naive"
    assert by["early-8bit"]["early_8bit"] and by["early-8bit"]["bits"] == 4


def test_inference_named_extra_rows(text_file, tmp_path):
    """The rows that run only when named: a bfloat16 state and the update as its own op
    (recorded as state_dtype / state_update); in float32 compute the separate update gives the
    in-call update's perplexity exactly."""
    argv = common(text_file, tmp_path, "--name", "extra", "--configs", "4bit-comp",
                  "4bit-comp-bf16state", "4bit-comp-separate")
    assert X.main(["inference", *argv]) == 0
    r = read(tmp_path / "accuracy_inference_extra.json")
    by = {row["config"]: row for row in r["rows"]}
    assert list(by) == ["16bit", "4bit-comp", "4bit-comp-bf16state", "4bit-comp-separate"]
    assert by["4bit-comp-bf16state"]["state_dtype"] == "bfloat16"
    assert by["4bit-comp-separate"]["state_update"] == "separate"
    assert by["4bit-comp"]["state_update"] == "in_call"
    assert by["4bit-comp-separate"]["perplexity"] == by["4bit-comp"]["perplexity"]


@pytest.mark.slow
def test_beyond_rows_pareto_and_calibrated_policy(text_file, tmp_path):
    argv = common(text_file, tmp_path, "--name", "smoke", "--configs", "4g64", "4g128-sym",
                  "4g64-h", "calib-4.5", "calib-4.5-h-proxy", "--calib-text", str(text_file),
                  "--calib-windows", "2", "--calib-window", "32")
    assert X.main(["beyond", *argv]) == 0
    out = tmp_path / "accuracy_beyond_smoke.json"
    r = read(out)
    assert_png(out.with_suffix(".png"))
    assert [row["key"] for row in r["rows"]] == ["16bit", "4g64", "4g128-sym", "4g64-h",
                                                 "calib-4.5", "calib-4.5-h-proxy"]
    by = {row["key"]: row for row in r["rows"]}
    for row in r["rows"]:
        for k in ("label", "config", "wire_bits_per_element", "perplexity", "delta_ppl_vs_16bit",
                  "rel_delta_ppl_vs_16bit_pct", "greedy_agreement", "tokens", "seconds",
                  "pareto"):
            assert k in row, (row["key"], k)
        assert row["tokens"] == 64
    assert by["16bit"]["wire_bits_per_element"] == 16.0
    assert by["4g64"]["wire_bits_per_element"] == 4.5
    assert by["4g128-sym"]["wire_bits_per_element"] == 4.125     # 4 + 16 / 128
    cal = by["calib-4.5"]
    assert cal["wire_bits_per_element"] <= 4.5 + 1e-9 and cal["config"]["site_policy"]
    assert cal["calibration"]["method"] == "measure"                # tiny: auto measures
    policy = Path(cal["calibration"]["policy_file"])
    assert policy.name == "policy_beyond_smoke_b4.5.json" and policy.is_file()
    assert {k: read(policy)[k] for k in ("command", "commit", "device")} == \
        {k: r[k] for k in ("command", "commit", "device")}
    proxy = by["calib-4.5-h-proxy"]
    assert proxy["calibration"]["method"] == "proxy"
    assert all(c.endswith("-h") for c in proxy["calibration"]["options"])
    assert by["4g64-h"]["config"]["rotation"] == "hadamard"
    assert r["goal"]["budget_bits"] == 4.5 and r["pareto"]
    assert by["4g128-sym"]["pareto"]                                 # the cheapest row
    # --resume keeps the rows and adds a policy-file row.
    assert X.main(["beyond", *argv, "--resume", "--policy", str(policy)]) == 0
    keys = [row["key"] for row in read(out)["rows"]]
    assert keys == ["16bit", "4g64", "4g128-sym", "4g64-h", "calib-4.5", "calib-4.5-h-proxy",
                    "policy:" + policy.name]
    assert X.main(["beyond", *common(text_file, tmp_path, "--configs", "4g5")]) == 1


def test_pareto_front():
    rows = [{"wire_bits_per_element": b, "rel_delta_ppl_vs_16bit_pct": d}
            for b, d in ((16, 0.0), (4.25, 70.0), (4.5, 40.0), (5.0, 45.0), (8.25, 0.1),
                         (4.5, 30.0))]
    assert X.pareto_front(rows) == [1, 5, 4, 0]


def test_ablations_rows_and_aliases(text_file, tmp_path):
    argv = common(text_file, tmp_path, "--variants", "full", "m1-only", "--tag", "smoke")
    assert X.main(["ablations", *argv]) == 0
    out = tmp_path / "accuracy_ablations_smoke.json"
    r = read(out)
    assert_png(out.with_suffix(".png"))
    # The record starts with what made it: the P = 2 ranks are simulated on one device.
    assert list(r)[:3] == ["command", "commit", "device"]
    assert r["command"] == "python -m models.experiments ablations " + " ".join(argv)
    assert r["meta"]["mode"].startswith("vmap simulation")
    assert r["commit"] and r["device"] == device_name(jax.devices()[:1])
    rows = r["rows"]
    assert rows[0]["bits"] == 16 and rows[0]["key"] == "16bit"
    for bits in (4, 8):
        got = {row["key"]: row for row in rows if row["bits"] == bits}
        assert set(got) == {"full", "m1-only", "a0.35", "eta0.75"}
        assert got["full"]["delta_ppl_vs_full"] == 0.0 and got["full"]["bits"] == bits
        assert got["m1-only"]["blend"] == 1.0 and got["m1-only"]["eta"] == 0.75
        assert got["a0.35"]["same_run_as"] == "full"
        for row in got.values():
            assert {"perplexity", "greedy_agreement", "delta_ppl_vs_16bit", "variant",
                    "group"} <= set(row)


def test_ablation_rows_cover_the_issue():
    rows = {v.key: v.comm.echo for v in X.ablation_variants(3, 4)}
    assert rows["sym"].policy == "sym" and rows["naive"].policy == "asym_naive"
    assert rows["full"].policy == "asym" and rows["full"].group_size == 128
    assert rows["g256"].group_size == 256 and rows["nocomp"].eta == 0.0
    assert {rows[k].blend for k in ("m1-only", "m2-only", "a0.25", "a0.5")} == {1, 0, .25, .5}
    etas = {e.eta for e in rows.values()}
    assert {0.5, 0.7, 0.75, 0.9, 1.0} <= etas
    assert len({(e.beta1, e.beta2) for e in rows.values()}) >= 5
    assert all(v.comm.echo.bits == 8 for v in X.ablation_variants(3, 8))


def test_unknown_variant_is_a_clear_error(text_file, tmp_path, capsys):
    assert X.main(["ablations", *common(text_file, tmp_path, "--variants", "nope")]) == 1
    assert "nope" in capsys.readouterr().err


def test_error_process_writes_per_site_arrays(text_file, tmp_path, monkeypatch):
    """The CLI writes a row and per-site arrays for each mode of `error_process_modes`. The run
    takes three of the six (one compiled program each): the exact reference, and 4-bit without
    and with the compensator (the 8-bit and eta-1 modes run the same code with other config
    values)."""
    from models.experiments import error_process as XE

    all_modes = X.error_process_modes(2)
    assert [v.key for v in all_modes] == ["exact", "8bit-none", "8bit-comp", "4bit-none",
                                          "4bit-comp", "4bit-comp-eta1"]
    keep = ("exact", "4bit-none", "4bit-comp")
    monkeypatch.setattr(XE, "error_process_modes",
                        lambda tp, *a, **k: [v for v in all_modes if v.key in keep])
    assert X.main(["error-process", *common(text_file, tmp_path)]) == 0
    out = tmp_path / "accuracy_error_process.json"
    r = read(out)
    assert_png(out.with_suffix(".png"))
    n = r["meta"]["n_sites"]
    assert n == 4
    modes = [row["mode"] for row in r["rows"]]
    assert modes == list(keep)
    for row in r["rows"]:
        for k in ("max_injected_error", "max_partial_sum", "final_resid_rel_error",
                  "perplexity", "greedy_agreement"):
            assert k in row
    for mode, sites in r["per_site"].items():
        assert set(X.SITE_KEYS) | {"delta_median", "partial_sum_median"} <= set(sites)
        assert all(len(v) == n for v in sites.values())
    assert max(r["per_site"]["exact"]["delta"]) == 0.0          # the exact sum injects nothing
    # Uncompensated rho = delta by definition (C_k = 0); the measured values themselves are
    # checked against a NumPy replay in test_instrumented_sites_match_a_numpy_replay.
    none = r["per_site"]["4bit-none"]
    np.testing.assert_allclose(none["rho"], none["delta"], rtol=1e-6)
    last = r["rows"][-1]
    assert "theorem1_factor" in last and "eq21_factor" in last and "token_ratio_median" in last


@pytest.mark.slow
def test_instrumented_forward_equals_the_model():
    tp = 3
    cfg = get_config("tiny")
    params = M.shard_params(M.init_params(jax.random.key(3), cfg), tp, cfg)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 16)).astype(np.int32)
    modes = {v.key: v for v in X.error_process_modes(tp)}
    for v in (modes["exact"], modes["4bit-none"], modes["4bit-comp"]):
        want = np.asarray(M.apply_simulated(params, tokens, cfg, v.comm))
        got = X.measure_error_process(params, tokens, cfg, v.comm)
        np.testing.assert_allclose(got["logits"], want, rtol=1e-5, atol=1e-6, err_msg=v.key)


def test_instrumented_sites_match_a_numpy_replay():
    """The per-site measurements of the error-process study against a replay in NumPy float64:
    a hook taps every rank's contribution x_k,i and the all-reduced y_k; Algorithm 1 is
    replayed from those (c = eta (a m1 + (1 - a) m2), u = x' - y / P, Eq. 11, from the config's
    fields, zero state at the first site), and rho_k = y_k - sum_i x_k,i, delta_k = y_k -
    sum_i x'_k,i and S_t = sum rho_k are measured per token."""
    tp = 2
    cfg = get_config("tiny")
    params = M.shard_params(M.init_params(jax.random.key(5), cfg), tp, cfg)
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 16)).astype(np.int32)
    modes = {v.key: v for v in X.error_process_modes(tp)}
    def tap(part, y, _):
        return part.astype(jax.numpy.float32), y.astype(jax.numpy.float32)

    for key in ("4bit-none", "4bit-comp"):
        comm = modes[key].comm
        fn = jax.jit(jax.vmap(lambda p, t: X.measure_sites(p, t, cfg, comm, hook=tap)[2],
                              in_axes=(0, None), axis_name=comm.axis_name))
        sites = jax.device_get(fn(params, tokens))
        parts, ys = (np.asarray(a, np.float64) for a in sites["hook"])   # [P, 2L, B, T, D]
        e = comm.echo
        eta = e.eta if e.compensated and comm.compensate_forward else 0.0
        m1 = m2 = np.zeros(parts.shape[:1] + parts.shape[2:])
        s_sum = 0.0
        norm = lambda v: np.linalg.norm(v, axis=-1)  # noqa: E731
        for k in range(parts.shape[1]):
            x, y = parts[:, k], ys[0, k]
            xp = x + eta * (e.blend * m1 + (1 - e.blend) * m2)          # Eq. 10
            u = xp - y / tp                                              # Eq. 4
            m1 = e.beta1 * m1 + (1 - e.beta1) * u                        # Eq. 11
            m2 = e.beta2 * m2 + (1 - e.beta2) * u
            rho = y - x.sum(0)
            s_sum = s_sum + rho
            for name, want in (("rho", norm(rho)), ("delta", norm(y - xp.sum(0))),
                               ("partial_sum", norm(s_sum))):
                got = np.asarray(sites[name][0, k], np.float64)
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6,
                                           err_msg=f"{key} site {k} {name}")
        d, r = sites["delta"][0, 1:], sites["rho"][0, 1:]
        if eta:  # the correction is live: after the first site delta and rho differ
            assert np.mean(np.abs(d - r)) > 0.1 * np.mean(d)


def test_instrumented_forward_under_shard_map():
    tp = 2
    cfg = get_config("tiny")
    params = M.shard_params(M.init_params(jax.random.key(4), cfg), tp, cfg)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (1, 16)).astype(np.int32)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:tp]), ("tp",))
    comm = X.error_process_modes(tp)[4].comm                     # 4-bit compensated
    sim = X.measure_error_process(params, tokens, cfg, comm)
    shm = X.measure_error_process(M.place_params(params, mesh, comm), tokens, cfg, comm, mesh)
    for k in ("logits", "delta", "partial_sum"):
        np.testing.assert_allclose(shm[k], sim[k], rtol=1e-5, atol=1e-6, err_msg=k)


def fake_run(label, bits, eta, lr, final, steps=300, seed=0):
    """A models.train --json record whose loss decays to about `final`."""
    rng = np.random.default_rng(seed)
    s = np.arange(1, steps + 1)
    loss = final + 3.0 * np.exp(-s / 40) + 0.01 * rng.standard_normal(steps)
    echo = None if bits == 16 else {"bits": bits, "group_size": 128, "policy": "asym",
                                    "eta": eta, "blend": 0.35, "beta1": 0.7, "beta2": 0.3}
    return {"label": label,
            "config": {"comm": {"tp": 4, "bits": bits, "echo": echo, "early_8bit": False},
                       "optim": {"lr": lr}, "args": {"lr": 1e-3, "lr_mult": lr / 1e-3},
                       "batch_size": 16, "seq_len": 512, "model": {"name": "small"}},
            "history": [{"step": int(i), "loss": float(v)} for i, v in zip(s, loss)],
            "eval": [{"step": steps, "loss": final + 0.1}],
            "tail100_mean_loss": float(np.mean(loss[-100:]))}


def test_pretrain_table_from_fake_logs(tmp_path):
    runs = {"4c": fake_run("4-bit comp", 4, 0.75, 1e-3, 3.03, seed=1),
            "16": fake_run("16-bit", 16, None, 1e-3, 3.00, seed=0),
            "4n": fake_run("4-bit none", 4, 0.0, 1e-3, 3.20, seed=2),
            "4lr": fake_run("4-bit comp 1.17x LR", 4, 0.75, 1.17e-3, 3.01, seed=3)}
    for name, commit in (("4c", "aaa1111"), ("16", "aaa1111"), ("4n", "bbb2222")):
        runs[name].update(commit=commit, device="cpu")     # 4lr: a log without them
    paths = []
    for name, run in runs.items():
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps(run))
        paths.append(str(p))
    out_dir = tmp_path / "res"
    assert X.main(["pretrain-table", *paths, "--out-dir", str(out_dir)]) == 0
    r = read(out_dir / "accuracy_pretrain.json")
    assert r["commit"] == "aaa1111, bbb2222" and r["device"] == "cpu"  # the runs', once each
    assert_png(out_dir / "accuracy_pretrain.png")
    rows = {row["label"]: row for row in r["rows"]}
    assert rows["16-bit"]["baseline"] and rows["16-bit"]["gap_vs_baseline_pct"] == 0.0
    base = rows["16-bit"]["tail100_mean_loss"]
    for label, row in rows.items():
        for k in ("tail100_mean_loss", "gap_vs_baseline", "gap_vs_baseline_pct", "bits",
                  "compensated", "peak_lr", "lr_ratio_to_baseline", "steps", "tokens",
                  "loss_at_early_step", "heldout_loss", "file"):
            assert k in row, (label, k)
        assert row["gap_vs_baseline_pct"] == pytest.approx(
            100 * (row["tail100_mean_loss"] - base) / base)
        assert row["tail100_mean_loss"] == pytest.approx(row["tail100_in_file"])
    assert rows["4-bit none"]["compensated"] is False and rows["4-bit comp"]["compensated"]
    assert rows["4-bit comp 1.17x LR"]["lr_ratio_to_baseline"] == pytest.approx(1.17)
    assert rows["16-bit"]["early_step"] == 30 and rows["16-bit"]["tokens"] == 300 * 16 * 512


def test_pretrain_table_rejects_a_log_without_history(tmp_path, capsys):
    p = tmp_path / "empty.json"
    p.write_text(json.dumps({"label": "x", "config": {}, "history": []}))
    assert X.main(["pretrain-table", str(p), "--out-dir", str(tmp_path)]) == 1
    assert "no history" in capsys.readouterr().err


def test_window_selection_and_limits(text_file, tmp_path, capsys):
    tokens = np.arange(1001)
    w = D.select_windows(tokens, 100, 3, contiguous=False)          # 10 candidates, 3 spread
    assert w.shape == (3, 101) and int(w[0][0]) == 0 and int(w[-1][0]) == 900
    w = D.select_windows(tokens, 100, 3, contiguous=True)
    assert [int(x[0]) for x in w] == [0, 100, 200]
    assert D.select_windows(tokens, 100, None, contiguous=False).shape == (10, 101)
    # --max-tokens below one window is a clear error, not an empty table.
    assert X.main(["inference", *common(text_file, tmp_path, "--max-tokens", "16")]) == 1
    assert "below one --window" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        X.main(["inference", *common(text_file, tmp_path, "--windows", "0")])


# --------------------------------------------------------------------------------------------
# The site tap against the hand-written forward pass it replaced


def _reference_instrumented_forward(params, tokens, model_cfg, comm, hook=None, hook_xs=None):
    """The hand-written per-rank forward pass the error-process study used before the model got
    its site tap: kept here only as the reference of the parity test.

    One rank's forward pass (as ``models.model.forward_local``) measuring every forward site.

    Call it inside ``jax.vmap(..., axis_name=comm.axis_name)`` or shard_map, like the model. It
    computes the same values as the Flax model (same building blocks, the same
    ``echo_psum`` / ``lax.psum`` call at every site g) and, beside each all-reduce, the exact fp32
    sum of the contributions, so that at site k (two per layer: attention, then MLP):

        delta_k = y_k - sum_i x'_k,i    the error the all-reduce injects (Eq. 1; x' = x + c)
        rho_k   = y_k - sum_i x_k,i     net error, delta_k + C_k (Eq. 5; = delta_k uncompensated)
        S_t     = sum_{k <= t} rho_k    the accumulated error (Eq. 6)

    All are measured per token, as the L2 norm of one d-dimensional hidden-state vector (the
    norm of the paper's bounds); also the block output sum_i x_k,i, the hidden state after the
    site and this rank's compensator state sqrt(||m1||^2 + ||m2||^2).

    Args:
      params: this rank's parameters (``models.model.param_shapes(model_cfg, P)``).
      tokens: int [B, T].
      model_cfg, comm: the configs (``comm.echo`` None: exact; early 8-bit and site policies
        not supported).
      hook: optional extra tap, hook(part, y, xs) -> pytree of arrays, called at every site with
        this rank's contribution, the all-reduced sum and the site's slice of `hook_xs`
        (``models.calibrate`` measures the error of other configs there).
      hook_xs: pytree of arrays [2 L, ...] (site k's slice goes to its hook call), or None.

    Returns:
      (final hidden state after the final norm [B, T, D] in the compute dtype, logits fp32
      [B, T, V], residual stream before the final norm fp32 [B, T, D], a dict of fp32
      [2 L, B, T] per-token norms keyed by `SITE_KEYS`; with a hook also "hook": its outputs
      stacked [2 L, ...]).
    """
    if comm.early_8bit or comm.site_policy is not None:
        raise ValueError("_reference_instrumented_forward: early_8bit and site policies are not "
                         "supported")
    cfg, axis, p = model_cfg, comm.axis_name, comm.tp
    f32 = jnp.float32
    dt = jnp.dtype(cfg.dtype)
    b, t = tokens.shape
    e = comm.echo
    compensated = e is not None and e.compensated and comm.compensate_forward
    coef = comp.Coefficients.from_config(e) if compensated else None
    positions = jnp.arange(t, dtype=jnp.int32)
    cos, sin = M.rope_tables(positions, cfg.head_dim, cfg.rope_base)

    def norm(v):  # per-token L2 norm over the hidden dimension: [B, T]
        return jnp.sqrt(jnp.sum(jnp.square(v.astype(f32)), axis=-1))

    def dense(x, w):
        return jnp.dot(x.astype(dt), w.astype(dt))

    def site(part, s_sum, state):
        exact = lax.psum(part.astype(f32), axis)               # sum_i x_k,i, fp32
        if e is None:
            y = lax.psum(part, axis)
            injected = exact
        elif not compensated:
            y = echo_psum(part, axis, config=e)
            injected = exact
        else:
            injected = lax.psum(comp.apply_correction(part.astype(f32), state, coef), axis)
            y, state = echo_psum(part, axis, config=e, state=state)
        y32 = y.astype(f32)
        rho = y32 - exact
        s_sum = s_sum + rho
        st = (jnp.sqrt(jnp.square(norm(state.m1)) + jnp.square(norm(state.m2)))
              if state is not None else jnp.zeros((b, t), f32))
        return y, s_sum, state, (norm(y32 - injected), norm(rho), norm(s_sum), norm(exact), st)

    def layer(carry, xs):
        lp, hx = xs
        h, s_sum, state = carry
        at = lp["attn"]
        x = M.rms_norm(h, lp["attn_norm"]["scale"], cfg.norm_eps).astype(dt)
        heads, kv, hd = cfg.n_heads // p, cfg.n_kv_heads // p, cfg.head_dim
        q = dense(x, at["q_proj"]["kernel"]).reshape(b, t, heads, hd)
        k = dense(x, at["k_proj"]["kernel"]).reshape(b, t, kv, hd)
        v = dense(x, at["v_proj"]["kernel"]).reshape(b, t, kv, hd)
        if cfg.qk_norm:
            q = M.rms_norm(q, at["q_norm"]["scale"], cfg.norm_eps).astype(dt)
            k = M.rms_norm(k, at["k_norm"]["scale"], cfg.norm_eps).astype(dt)
        q, k = M.apply_rope(q, cos, sin), M.apply_rope(k, cos, sin)
        part = dense(M.attention(q, k, v, positions, positions), at["o_proj"]["kernel"])
        y, s_sum, state, st1 = site(part, s_sum, state)
        tap1 = None if hook is None else hook(part, y, jax.tree.map(lambda a: a[0], hx))
        h = h + y
        hid1 = norm(h)
        ml = lp["mlp"]
        x = M.rms_norm(h, lp["mlp_norm"]["scale"], cfg.norm_eps).astype(dt)
        gate = dense(x, ml["gate_proj"]["kernel"])
        up = dense(x, ml["up_proj"]["kernel"])
        part = dense(jax.nn.silu(gate) * up, ml["down_proj"]["kernel"])
        y, s_sum, state, st2 = site(part, s_sum, state)
        tap2 = None if hook is None else hook(part, y, jax.tree.map(lambda a: a[1], hx))
        h = h + y
        hid2 = norm(h)
        stats = [jnp.stack([a, c]) for a, c in zip(st1, st2)]  # per key: [2, B, T]
        stats.insert(4, jnp.stack([hid1, hid2]))
        taps = None if hook is None else jax.tree.map(lambda a, c: jnp.stack([a, c]), tap1, tap2)
        return (h, s_sum, state), (tuple(stats), taps)

    emb = params["embed"]["embedding"]
    h = jnp.take(emb.astype(dt), tokens, axis=0)                       # [B, T, D]
    state = comp.init_state(h, e) if compensated else None
    carry = (h, jnp.zeros(h.shape, f32), state)
    n_layers = cfg.n_layers
    hx = None if hook_xs is None else jax.tree.map(
        lambda a: a.reshape((n_layers, 2) + a.shape[1:]), hook_xs)   # [2L, ...] -> [L, 2, ...]
    (h, _, _), (stats, taps) = lax.scan(layer, carry, (params["layers"], hx))
    resid = h.astype(f32)
    hn = M.rms_norm(h, params["final_norm"]["scale"], cfg.norm_eps).astype(dt)
    head = emb.T if cfg.tie_embeddings else params["lm_head"]
    logits = jnp.einsum("btd,dv->btv", hn, head.astype(dt), preferred_element_type=f32)
    per_site = {k: s.reshape(-1, b, t) for k, s in zip(X.SITE_KEYS, stats)}  # [L,2,..] -> [2L,..]
    if hook is not None:
        per_site["hook"] = jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), taps)
    return hn, logits, resid, per_site


@pytest.mark.slow   # measure_sites' per-site values against an independent NumPy float64 replay
#                    are in the fast set: test_instrumented_sites_match_a_numpy_replay
@pytest.mark.parametrize("key", ["exact", "4bit-none", "4bit-comp"])
def test_site_tap_equals_the_old_instrumented_forward(key):
    """`measure_sites` (the model's own forward pass, read through its site tap) gives the
    per-site values, logits, residual stream and hook outputs of the old hand-written forward.

    The modes of test_instrumented_forward_equals_the_model. At 8 bits the two programs (compiled
    apart: the model has optimization barriers the old one had not) put a few values one
    quantization level apart, which only says that they round differently."""
    tp = 2
    cfg = get_config("tiny")
    params = M.shard_params(M.init_params(jax.random.key(7), cfg), tp, cfg)
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 16)).astype(np.int32)
    comm = {v.key: v for v in X.error_process_modes(tp)}[key].comm
    n_sites = 2 * cfg.n_layers
    scale = jnp.arange(1, n_sites + 1, dtype=jnp.float32)         # per-site hook input

    def hook(part, y, s):
        return {"part": part.astype(jnp.float32) * s, "y": y.astype(jnp.float32)}

    def new(p, t):
        return X.measure_sites(p, t, cfg, comm, hook=hook, hook_xs=scale)

    def old(p, t):
        _, logits, resid, sites = _reference_instrumented_forward(p, t, cfg, comm, hook=hook,
                                                                  hook_xs=scale)
        return logits, resid, sites

    run = lambda f: jax.device_get(jax.jit(jax.vmap(  # noqa: E731
        f, in_axes=(0, None), axis_name=comm.axis_name))(params, tokens))
    (logits, resid, sites), (ref_logits, ref_resid, ref_sites) = run(new), run(old)
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(resid, ref_resid, rtol=1e-5, atol=1e-6)
    assert set(sites) == set(ref_sites) == set(X.SITE_KEYS) | {"hook"}
    for k in X.SITE_KEYS:
        assert sites[k].shape == (tp, n_sites, 2, 16)
        np.testing.assert_allclose(sites[k], ref_sites[k], rtol=1e-5, atol=1e-6, err_msg=k)
    for k in ("part", "y"):
        np.testing.assert_allclose(sites["hook"][k], ref_sites["hook"][k], rtol=1e-5, atol=1e-6,
                                   err_msg=k)
