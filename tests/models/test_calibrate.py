"""Per-site precision (models.config.SitePolicy, models.calibrate): the policy JSON round trip and
its validation errors, a policy of one config equals the uniform CommConfig bit for bit, the
early-8bit policy equals the early_8bit flag bit for bit, the vmap simulation equals shard_map bit
for bit under a mixed policy, each table entry reaches its own site, the wire-bit accounting,
the greedy knapsack, and a calibration CLI smoke run on random tiny weights (seconds)."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import echo_jax as ej
from conftest import make_mesh
from models import calibrate as K
from models import cli as CLI
from models import config as C
from models import model as M
from models import train as T

TINY = C.get_config("tiny")                                    # 2 layers, fp32
DEEP = TINY.replace(n_layers=4, name="tiny-4")
E4 = ej.EchoConfig(bits=4, transport="xla")
E8 = E4.replace(bits=8)
E4G32 = E4.replace(group_size=32)


def bits(x):
    x = np.asarray(x)
    return x.view(np.uint32) if x.dtype == np.float32 else x.view(np.uint16)


def same_bits(a, b, what=""):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb), what
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(bits(x), bits(y), err_msg=what)


@pytest.fixture(scope="module")
def data():
    toks = jax.random.randint(jax.random.key(1), (2, 17), 0, TINY.vocab_size, jnp.int32)
    return toks[:, :-1], toks[:, 1:]


@pytest.fixture(scope="module")
def tiny4():
    full = M.init_params(jax.random.key(3), TINY)
    return M.shard_params(full, 4, TINY)


# --------------------------------------------------------------------------------------------
# the policy: JSON, validation, wire bits


def mixed_policy(n_layers=2, backward=True):
    fwd = tuple(((0, 1), (2, 0), (1, 1), (0, 2))[:n_layers])
    bwd = tuple(((1, 0), (0, 0), (2, 1), (1, 0))[:n_layers]) if backward else None
    return C.SitePolicy((E4, E8, None), fwd, bwd, "mixed")


def test_policy_json_round_trip(tmp_path):
    pol = mixed_policy().replace(configs=(E4, E8.replace(group_size=64, policy="sym"), None))
    rec = pol.save(tmp_path / "p.json", model="tiny", tp=2, extra={"calibration": {"x": 1}})
    assert rec["format"] == C.POLICY_FORMAT and rec["n_layers"] == 2 and rec["tp"] == 2
    assert rec["configs"][2] is None and rec["configs"][0]["bits"] == 4
    assert "transport" not in rec["configs"][0]              # the caller's choice
    back, raw = C.load_site_policy(tmp_path / "p.json", transport="xla", return_record=True)
    assert back.configs == pol.configs and back.forward == pol.forward
    assert back.backward == pol.backward and back.name == str(tmp_path / "p.json")
    assert raw["calibration"] == {"x": 1}
    # Site order: layer 0 attention, layer 0 MLP, layer 1 ...; 16 bits at exact sites.
    assert [C.config_label(c) for c in back.site_configs()] == ["4g128", "8g64-sym", "16",
                                                               "4g128"]
    assert back.wire_bits_per_element() == pytest.approx((4.25 + 8.25 + 16 + 4.25) / 4)
    assert [C.config_label(c) for c in back.site_configs(backward=True)] == [
        "8g64-sym", "4g128", "4g128", "4g128"]


def write(tmp_path, rec, name="bad.json"):
    p = tmp_path / name
    p.write_text(json.dumps(rec))
    return p


@pytest.mark.parametrize("change,needle", [
    ({"format": "v0"}, '"format" = \'v0\''),
    ({"forward": [[0, 3], [0, 0]]}, '"forward"[0][1] = 3 is not an index'),
    ({"forward": [[0], [0, 0]]}, '"forward"[0] = [0]'),
    ({"backward": [[0, 0]]}, '"backward" has 1 rows'),
    ({"n_layers": 3}, '"n_layers" = 3'),
    ({"configs": [{"bits": 5}]}, '"configs"[0].bits = 5'),
    ({"configs": [{"bitz": 4}]}, '"configs"[0].bitz = 4: not a field'),
    ({"configs": [{"group_size": 48, "rotation": "hadamard"}]}, '"configs"[0]'),
    ({"configs": [{"bits": 4}, {"bits": 4}]}, "repeats"),
    ({"configs": []}, '"configs" = []'),
])
def test_policy_file_errors_name_file_field_and_value(tmp_path, change, needle):
    rec = C.SitePolicy.uniform(E4, 2).to_dict()
    rec.update(change)
    path = write(tmp_path, rec)
    with pytest.raises(ValueError) as info:
        C.load_site_policy(path)
    msg = str(info.value)
    assert str(path) in msg and needle in msg, msg


def test_policy_errors_against_the_model_and_comm(tmp_path):
    pol = C.SitePolicy.uniform(E4, 3, name="three.json")
    with pytest.raises(ValueError, match="three.json.* 3 layers .* 'tiny' has 2"):
        C.check_comm(TINY, C.CommConfig(tp=2, site_policy=pol))
    with pytest.raises(ValueError, match="3 layers"):
        M.apply_simulated(M.shard_params(M.init_params(jax.random.key(0), TINY), 2, TINY),
                          jnp.zeros((1, 4), jnp.int32), TINY, C.CommConfig(tp=2, site_policy=pol))
    with pytest.raises(ValueError, match="site_policy and CommConfig.echo are exclusive"):
        C.CommConfig(tp=2, echo=E4, site_policy=pol)
    with pytest.raises(ValueError, match="site_policy must be a SitePolicy"):
        C.CommConfig(tp=2, site_policy={"forward": []})
    with pytest.raises(ValueError, match=r"forward\[1\]\[0\] = 2 is not an index"):
        C.SitePolicy((E4, E8), ((0, 0), (2, 0)))
    with pytest.raises(FileNotFoundError, match="nope.json"):
        C.load_site_policy(tmp_path / "nope.json")
    (tmp_path / "notjson.json").write_text("{")
    with pytest.raises(ValueError, match="notjson.json: not valid JSON"):
        C.load_site_policy(tmp_path / "notjson.json")


def test_wire_bits_per_element():
    assert C.CommConfig(tp=2).wire_bits_per_element(2) == 16.0
    assert C.CommConfig(tp=2, echo=E4).wire_bits_per_element(30) == 4.25
    assert C.CommConfig(tp=2, echo=E4.replace(group_size=64)).wire_bits_per_element(2) == 4.5
    assert C.CommConfig(tp=2, echo=E4.replace(policy="sym", group_size=64)
                        ).wire_bits_per_element(2) == 4.25
    assert C.CommConfig(tp=2, echo=E4, early_8bit=True).wire_bits_per_element(2) == 6.25
    assert C.CommConfig(tp=2, echo=E4, early_8bit=True).wire_bits_per_element(3) == \
        pytest.approx((2 * 2 * 8.25 + 2 * 4.25) / 6)           # layers 0, 1 of 3 at 8 bits
    pol = C.SitePolicy.from_choices([E4, E4G32, E8], [0, 0, 2, 1])
    assert pol.configs == (E4, E4G32, E8) and pol.forward == ((0, 0), (2, 1))
    assert C.CommConfig(tp=2, site_policy=pol).wire_bits_per_element(2) == \
        pytest.approx((4.25 + 4.25 + 8.25 + 5.0) / 4)
    for c in (E4, E8, E4G32, E4.replace(policy="sym")):        # one wire-format definition
        assert C.config_wire_bits(c) == pytest.approx(
            ej.quant.wire_bytes_per_group(c.group_size, c.bits, c.policy) * 8 / c.group_size)
    from models import eval as E

    assert E.wire_bits_per_element(TINY, C.CommConfig(tp=2, site_policy=pol), 64) == \
        pytest.approx((4.25 + 4.25 + 8.25 + 5.0) / 4)


def test_comm_flags_with_site_bits(tmp_path):
    path = tmp_path / "p.json"
    mixed_policy().save(path)
    ap = T.build_parser()
    comm = CLI.comm_from_args(ap.parse_args(["--tp", "2", "--site-bits", str(path),
                                             "--transport", "xla"]))
    assert comm.site_policy.configs == (E4, E8, None) and comm.echo is None
    assert comm.compensate_forward and "site policy" in comm.describe()
    off = CLI.comm_from_args(ap.parse_args(["--tp", "2", "--site-bits", str(path),
                                            "--no-compensation"]))
    assert off.forward_configs()[0].eta == 0.0 and "nocomp" in off.describe()
    d = CLI.comm_to_dict(comm)
    assert d["bits"] is None and d["site_policy"]["forward"] == [[0, 1], [2, 0]]
    json.dumps(d)
    with pytest.raises(ValueError, match="exclusive"):
        CLI.comm_from_args(ap.parse_args(["--site-bits", str(path), "--early-8bit"]))
    with pytest.raises(ValueError, match="--site-bits: .*missing.json"):
        CLI.comm_from_args(ap.parse_args(["--site-bits", str(tmp_path / "missing.json")]))


# --------------------------------------------------------------------------------------------
# the model under a policy


@pytest.mark.slow
def test_uniform_policy_equals_uniform_config_bit_for_bit(tiny4, data):
    x, _ = data
    want = M.apply_simulated(tiny4, x, TINY, C.CommConfig(tp=4, echo=E4))
    one = C.CommConfig(tp=4, site_policy=C.SitePolicy.uniform(E4, 2))
    same_bits(M.apply_simulated(tiny4, x, TINY, one), want, "one config")
    # Two configs, every site at the first: through the lax.switch, still the same bits.
    two = C.CommConfig(tp=4, site_policy=C.SitePolicy((E4, E8), ((0, 0), (0, 0))))
    same_bits(M.apply_simulated(tiny4, x, TINY, two), want, "switch")
    exact = C.CommConfig(tp=4, site_policy=C.SitePolicy((None, E8), ((0, 0), (0, 0))))
    same_bits(M.apply_simulated(tiny4, x, TINY, exact),
              M.apply_simulated(tiny4, x, TINY, C.CommConfig(tp=4)), "exact")


@pytest.mark.slow
def test_early_8bit_policy_equals_the_flag_bit_for_bit(tiny4, data):
    x, y = data
    flag = C.CommConfig(tp=4, echo=E4, early_8bit=True)
    pol = C.CommConfig(tp=4, site_policy=C.SitePolicy.early_8bit(E4, TINY.n_layers))
    assert pol.site_policy.forward == ((0, 0), (1, 1))
    assert flag.wire_bits_per_element(2) == pol.wire_bits_per_element(2) == 6.25
    same_bits(M.apply_simulated(tiny4, x, TINY, pol), M.apply_simulated(tiny4, x, TINY, flag),
              "logits")
    same_bits(M.loss_and_grad_simulated(tiny4, x, y, TINY, pol),
              M.loss_and_grad_simulated(tiny4, x, y, TINY, flag), "loss and grads")


@pytest.mark.slow
def test_simulation_matches_shard_map_under_a_mixed_policy(data):
    """Mixed bits, group sizes, rotation and an exact site, separate backward table: the vmap
    simulation equals shard_map bit for bit (logits, loss, every gradient). In bf16 the exact branch of the
    switch sums in fp32 like XLA:CPU's all-reduce (fp32 Echo is covered by the uniform tests of
    test_model.py, which the one-config policy equals bit for bit)."""
    cfg, tp = TINY.replace(dtype="bfloat16", qk_norm=False, name="tiny-bf16"), 2
    x, y = data
    full = M.init_params(jax.random.key(7), cfg)
    st = M.shard_params(full, tp, cfg)
    mesh = make_mesh((tp,), ("tp",))
    pol = C.SitePolicy((E4, E8, None, E4G32, E4G32.replace(rotation="hadamard")),
                       ((4, 3), (2, 1)), ((1, 2), (3, 4)), "mixed")
    comm = C.CommConfig(tp=tp, site_policy=pol)
    same_bits(M.apply_simulated(st, x, cfg, comm), M.apply_sharded(st, x, cfg, comm, mesh),
              "logits")
    same_bits(M.loss_and_grad_simulated(st, x, y, cfg, comm),
              M.loss_and_grad_sharded(st, x, y, cfg, comm, mesh), "loss and grads")


@pytest.mark.slow   # p2p == xla bit for bit is in the library's fast set (test_p2p_cpu.py)
def test_p2p_equals_xla_under_a_mixed_policy(data):
    """The custom call inside the per-site switch: the same bits as the pure-JAX transport
    (shard_map; logits, loss and gradients, i.e. forward and backward sites), the same logits
    on every rank."""
    from echo_jax.transports import cpu

    if "cpu" not in cpu.available_platforms():
        pytest.skip("echo_jax._ffi (the compiled custom call) is not built")
    x, y = data
    st = M.shard_params(M.init_params(jax.random.key(8), TINY), 2, TINY)
    mesh = make_mesh((2,), ("tp",))

    def comm(transport):
        e = E4.replace(transport=transport)
        return C.CommConfig(tp=2, site_policy=C.SitePolicy(
            (e, e.replace(bits=8), None, e.replace(group_size=32),
             e.replace(group_size=64, rotation="hadamard")), ((4, 3), (2, 1)),
            ((1, 2), (3, 4))))

    same_bits(M.apply_sharded(st, x, TINY, comm("p2p"), mesh),
              M.apply_sharded(st, x, TINY, comm("xla"), mesh), "logits")
    same_bits(M.loss_and_grad_sharded(st, x, y, TINY, comm("p2p"), mesh),
              M.loss_and_grad_sharded(st, x, y, TINY, comm("xla"), mesh), "loss and grads")
    # Every rank holds the same logits.
    per_rank = M.jit_per_rank(lambda p, t: M.forward_local(p, t, TINY, comm("p2p")).logits,
                              comm("p2p"), mesh, stacked_in=(True, False), stacked_out=True)
    logits = np.asarray(per_rank(st, x))
    assert logits.shape[0] == 2
    same_bits(logits[1], logits[0], "rank 1 vs rank 0")


def test_each_table_entry_reaches_its_own_site(data):
    """One site at 8 bits, the rest at 4: the forward-state norms equal the all-4-bit run's up
    to that site and differ from it on; a backward-only change leaves the logits alone. The
    tables are traced inputs here (`site_choices`, as in calibration): one compiled program."""
    x, y = data
    st = M.shard_params(M.init_params(jax.random.key(4), DEEP), 2, DEEP)
    base = np.zeros((4, 2), np.int32)
    comm = C.CommConfig(tp=2, site_policy=C.SitePolicy((E4, E8), ((0, 0),) * 4))

    def fn(params, tokens, targets, ftab, btab):
        def loss(p):
            out = M.forward_local(p, tokens, DEEP, comm, return_state_norms=True,
                                  site_choices=(ftab, btab))
            return M.cross_entropy(out.logits, targets), (out.logits, out.state_norms)
        (_, (logits, norms)), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return logits, norms, grads["layers"]["attn"]["q_proj"]["kernel"]

    run = M.jit_per_rank(fn, comm, None, stacked_in=(True, False, False, False, False),
                         stacked_out=(False, False, True))
    logits4, n4, g4 = jax.device_get(run(st, x, y, base, base))
    n4 = np.asarray(n4).reshape(-1)                          # [L * 3]: entering, attn, mlp
    for layer, site in ((2, 0), (1, 1), (3, 1)):
        table = base.copy()
        table[layer, site] = 1
        _, n, _ = jax.device_get(run(st, x, y, table, base))
        n = np.asarray(n).reshape(-1)
        first = 3 * layer + 1 + site                         # the norm after that site
        np.testing.assert_array_equal(n[:first], n4[:first], err_msg=str((layer, site)))
        assert n[first] != n4[first], (layer, site)
    # Backward table only: the same forward pass, other gradients (layer 1's f sites at 8 bits).
    btab = base.copy()
    btab[1] = 1
    logits_b, _, gb = jax.device_get(run(st, x, y, base, btab))
    same_bits(logits_b, logits4)
    assert not np.array_equal(np.asarray(gb)[:, 1], np.asarray(g4)[:, 1])
    # Traced tables give the bits of the static policy.
    ftab = base.copy()
    ftab[1, 0] = 1
    static = C.CommConfig(tp=2, site_policy=C.SitePolicy((E4, E8), tuple(map(tuple, ftab))))
    same_bits(run(st, x, y, ftab, base)[0], M.apply_simulated(st, x, DEEP, static))


# --------------------------------------------------------------------------------------------
# calibration


def test_parse_options():
    assert K.parse_option("4g128") == E4
    assert K.parse_option("8g64-sym") == E8.replace(group_size=64, policy="sym")
    assert K.parse_option("4g32-naive").policy == "asym_naive"
    assert K.parse_option("16") is None
    assert K.parse_option("4g64-h").rotation == "hadamard"
    assert K.parse_option("4g64", rotation="hadamard").rotation == "hadamard"
    with pytest.raises(ValueError, match="--options: site config '4x128' is not a name"):
        K.parse_option("4x128")
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        K.parse_option("5g128")
    with pytest.raises(ValueError, match="repeats"):
        K.parse_options(["4g128", "4g128-asym"])
    assert list(K.option_costs(K.parse_options(["4g128", "4g64", "4g32", "8g128", "16"]))) == \
        [4.25, 4.5, 5.0, 8.25, 16.0]


def test_greedy_knapsack():
    costs = [4.25, 4.5, 5.0, 8.25]
    est = np.array([[0.0, -0.001, -0.002, -0.003],       # site 0: small gains
                    [0.0, -0.010, -0.012, -0.200],       # site 1: massive activations
                    [0.0, 0.001, 0.000, -0.001],         # site 2: nothing to gain from g64
                    [0.0, -0.004, -0.005, -0.006]])
    choice, steps = K.choose_sites(est, costs, 4.25)
    assert choice == [0, 0, 0, 0] and steps == []
    choice, steps = K.choose_sites(est, costs, 5.25)     # 4 extra bits in all
    assert choice[1] == 3                                 # 0.2 / 4 bits beats the rest
    assert sum(costs[c] for c in choice) / 4 <= 5.25 + 1e-12
    assert steps[0]["site"] == 1 and steps[0]["to"] == 3
    choice, _ = K.choose_sites(est, costs, 4.5)
    assert sum(costs[c] for c in choice) <= 4.5 * 4 + 1e-12 and choice[2] == 0
    with pytest.raises(ValueError, match="below the cheapest option"):
        K.choose_sites(est, costs, 4.0)
    # Equal-cost options: a better one at no extra cost is taken.
    choice, _ = K.choose_sites(np.array([[0.0, -1.0]]), [4.25, 4.25], 4.25)
    assert choice == [1]


TEXT = ("Shall I compare thee to a summer's day? Thou art more lovely and more temperate. "
        "Rough winds do shake the darling buds of May, and summer's lease hath all too short "
        "a date. ") * 6


@pytest.mark.grid("proxy")
@pytest.mark.parametrize("method", ["measure", "proxy"])
def test_calibrate_cli_writes_a_policy_within_budget(tmp_path, method):
    text = tmp_path / "calib.txt"
    text.write_text(TEXT)
    out, stats = tmp_path / "policy.json", tmp_path / "stats.json"
    opts = ["4g128", "4g64", "4g32", "8g128"] + (["16"] if method == "proxy" else [])
    argv = ["--checkpoint", "random:tiny", "--tp", "2", "--simulate", "--windows", "3",
            "--window", "32", "--text", str(text), "--budget-bits", "4.6", "--method", method,
            "--options", *opts, "--out", str(out), "--json", str(stats), "--quiet"]
    assert K.main(argv) == 0
    pol, rec = C.load_site_policy(out, return_record=True)
    assert pol.n_layers == 2 and pol.wire_bits_per_element() <= 4.6 + 1e-9
    assert rec["wire_bits_per_element"] == pytest.approx(pol.wire_bits_per_element())
    cal = rec["calibration"]
    assert cal["method"] == method and cal["budget_bits"] == 4.6 and len(cal["chosen"]) == 4
    assert cal["text"] == [str(text)] and cal["tokens"] == 96
    s = json.loads(stats.read_text())
    assert len(s["sites"]) == 4 and s["sites"][1]["name"] == "L0.mlp"
    for site in s["sites"]:
        assert site["output_rms"] > 0 and site["grad_rms"] > 0
        o = site["options"]
        assert o["4g128"]["injected_error_rms"] > o["8g128"]["injected_error_rms"] > 0
        assert o["4g128"]["proxy_dnll"] >= 0
        if method == "measure":
            assert o["4g128"]["measured_dnll"] == 0.0 and o["4g64"]["measured_dnll"] is not None
        else:
            assert o["16"]["injected_error_rms"] == 0.0 and o["16"]["proxy_dnll"] == 0.0
    assert [st["site_name"] for st in s["greedy_steps"]]  # something was upgraded
    # The policy runs (shard_map, compensated) and the budget error is clear.
    comm = C.CommConfig(tp=2, site_policy=pol.with_configs(lambda c: c.replace(transport="xla")))
    st = M.shard_params(M.init_params(jax.random.key(0), TINY), 2, TINY)
    assert np.isfinite(np.asarray(M.apply_simulated(st, jnp.zeros((1, 8), jnp.int32), TINY,
                                                    comm))).all()
    assert K.main([*argv, "--budget-bits", "4"]) == 1       # below the cheapest option
