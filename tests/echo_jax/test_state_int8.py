"""`EchoConfig.state_dtype="int8"`: the compensator state as 8-bit codes with a per-group scale.

Checked against a NumPy reference written here from the format's definition (compensator module
docstring): per group of 128 consecutive values of a rank's flattened average, s the smallest
power of two with 127 s >= max|v| (0 below 2^-100), q = rne(v / s), read back as q * s;
Algorithm 1 (Eqs. 4, 10, 11) in fp32 on the values read back. Also: zero and
non-finite groups, init_state / check_state, the plan (the CPU custom call fuses it with
group_size 128; elsewhere it runs in JAX around the call), the CPU call bit for bit against the
JAX path (the CUDA kernels: tests/echo_jax/test_p2p_cuda.py), and a scan carry.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import echo_jax as ej
from echo_jax import compensator as comp
from echo_jax import transports
from echo_jax.transports import cuda
from conftest import quantized_state_sites
from np_reference import coefficients, state_quantize, state_read

F32 = np.float32
INT8 = ej.EchoConfig(bits=4, transport="xla", state_dtype="int8")
#: The quantized states that the scan and backward-site tests run with: the int8 state, and the
#: int4 state with the local residual (its own tests: test_state_int4.py).
QUANTIZED = {"int8": INT8, "int4": INT8.replace(state_dtype="int4", residual="local")}


def _np(a):
    """An array as NumPy, int4 codes widened to int8 (exact) so NumPy compares them."""
    return np.asarray(a).astype(np.int8) if a.dtype == jnp.int4 else np.asarray(a)


def ref_quantize(v):
    """The NumPy reference of the state (`np_reference.state_quantize`, levels 127)."""
    return state_quantize(v, 127)


ref_read = state_read


@pytest.mark.parametrize("state_dtype", ["int8", "int4"])
def test_the_format_matches_the_numpy_reference(state_dtype):
    """Both quantized states against `np_reference.state_quantize` (levels 127 / 7), bit for bit:
    the codes, the scales and the values read back."""
    levels, dtype = (127, jnp.int8) if state_dtype == "int8" else (7, jnp.int4)
    rng = np.random.default_rng(0)
    # Magnitudes from 1e-35 (below 2^-100: zeros) to 3e38 (near fp32's largest), and groups
    # whose max|v| sits exactly at the largest code times a power of two (the comparison's edge).
    for n in (1, 127, 128, 300, 1000, 20000):
        v = (rng.standard_normal(n) * rng.choice([1e-35, 1e-6, 1.0, 3e4], size=n)).astype(F32)
        if n >= 300:
            v[:128] = 0.25
            v[5] = levels * 2.0 ** -3     # exactly levels s: s = 2^-3, the largest code
            v[6] = -3.5 * 2.0 ** -3       # a tie: rne(-3.5) = -4
            v[128:256] *= F32(1e-32)
            v[256] = F32(3e38)
        q, s = comp.quantize_state(jnp.asarray(v), dtype)
        rq, rs = state_quantize(v, levels)
        assert q.dtype == dtype and q.shape == (n,) and s.shape == (-(-n // 128),)
        np.testing.assert_array_equal(_np(q), rq)
        np.testing.assert_array_equal(np.asarray(s).view(np.uint32), rs.view(np.uint32))
        back = np.asarray(comp.dequantize_state(q, s))
        np.testing.assert_array_equal(back.view(np.uint32), state_read(rq, rs).view(np.uint32))
        with np.errstate(over="ignore"):
            err = np.abs(back.astype(np.float64) - v)
        # Within half a step of each group's scale.
        fin = np.isfinite(back)
        assert np.all(err[fin] <= np.repeat(rs, 128)[:n][fin] * 0.5 + 1e-30)
        if n >= 300:
            assert rq[5] == levels and rq[6] == -4 and rs[0] == F32(2.0 ** -3)
        if state_dtype == "int8":
            assert fin.all()
        elif n >= 300:
            # Above 1.75 * 2^127 the int4 scale is 2^126 and a code of 4 reads back as 2^128:
            # inf (the compensator module docstring); every implementation's product overflows
            # alike.
            assert rq[256] == 4 and back[256] == np.inf and fin.sum() == n - 1


def test_zero_and_non_finite_groups():
    v = np.zeros(384, F32)
    v[130] = np.nan
    v[300] = 2.0
    q, s = comp.quantize_state(jnp.asarray(v).reshape(3, 128))
    back = np.asarray(comp.dequantize_state(q, s)).reshape(-1)
    assert q.shape == (3, 128)
    assert np.all(back[:128] == 0) and float(s[0]) == 0.0           # all zeros: exact
    assert np.all(np.isnan(back[128:256]))                           # a NaN poisons its group
    assert back[300] == 2.0 and np.all(back[256:300] == 0)           # the max is exact


def test_a_coefficient_folds_into_the_scale_exactly_from_2_to_the_minus_20():
    """The CUDA stages compute (c s) q for c (q s) (FoldedState); NumPy's correctly rounded
    fp32 products say both are the same bits for every c in {0} U [2^-20, 1], every scale the
    format makes (powers of two 2^-106 .. 2^121, 0, inf, NaN) and every code, and not below
    2^-20, which EchoConfig refuses with the int8 state."""
    rng = np.random.default_rng(0)
    q = np.arange(-127, 128).astype(F32)[:, None]
    scales = np.concatenate([2.0 ** np.arange(-106, 122), [0.0, np.inf, np.nan]]).astype(F32)

    def folded_equals_plain(c):
        c = F32(c)
        with np.errstate(all="ignore"):
            folded = (c * scales)[None, :] * q
            plain = c * (q * scales[None, :])
        return np.array_equal(folded.view(np.uint32), plain.view(np.uint32)) or (
            np.array_equal(np.isnan(folded), np.isnan(plain))
            and np.array_equal(folded[~np.isnan(folded)], plain[~np.isnan(plain)])
            and np.array_equal(np.signbit(folded[~np.isnan(folded)]),
                               np.signbit(plain[~np.isnan(plain)])))

    cs = [0.0, 2.0 ** -20, 1.0, 0.2625, 0.4875, 0.7, 0.3]
    cs += list(2.0 ** rng.uniform(-20, 0, 200))
    assert all(folded_equals_plain(c) for c in cs)
    assert not folded_equals_plain(2.0 ** -20 * 0.7)  # below: c s is subnormal, inexact
    ej.EchoConfig(state_dtype="int8", eta=0.0)
    ej.EchoConfig(state_dtype="int8", eta=1.0, blend=1.0, beta1=0.0, beta2=2.0 ** -20)
    with pytest.raises(ValueError, match=r"needs beta2 to be 0 or at least 2\^-20, got 5\.96"):
        ej.EchoConfig(state_dtype="int8", beta2=2.0 ** -21 * 1.25)
    with pytest.raises(ValueError, match=r"needs eta \* blend .*state_dtype='bfloat16'"):
        ej.EchoConfig(state_dtype="int8", eta=1e-7)
    ej.EchoConfig(state_dtype="float32", eta=1e-7)  # only the int8 state folds


def test_init_and_check_state():
    x = jnp.ones((3, 100), jnp.bfloat16)
    st = ej.init_state(x, INT8)
    assert st.quantized and isinstance(st.m1, ej.QuantizedMoment)
    assert st.m1.codes.dtype == jnp.int8 and st.m1.codes.shape == (3, 100)
    assert st.m1.scales.dtype == jnp.float32 and st.m1.scales.shape == (3,)  # ceil(300 / 128)
    m1, m2 = ej.init_state(x)  # the other state dtypes: two arrays, as before
    assert not ej.init_state(x).quantized and m1.shape == (3, 100)
    comp.check_state(st, x, config=INT8)
    with pytest.raises(ValueError, match=r"state\.m1 must be a QuantizedMoment"):
        comp.check_state(ej.CompensatorState(st.m1.codes, st.m2.codes), x, config=INT8)
    with pytest.raises(ValueError, match=r"state\.m1\.scales must be float32 of shape \(3,\)"):
        comp.check_state(ej.CompensatorState(ej.QuantizedMoment(st.m1.codes, st.m1.scales[:2]),
                                             st.m2), x, config=INT8)
    with pytest.raises(ValueError, match=r"got a QuantizedMoment"):
        comp.check_state(st, x)


def test_one_call_matches_algorithm_1_with_the_int8_store():
    nranks, n = 4, 300
    x = jax.random.normal(jax.random.key(1), (nranks, n))
    m1 = 0.05 * jax.random.normal(jax.random.key(2), (nranks, n))
    m2 = 0.05 * jax.random.normal(jax.random.key(3), (nranks, n))
    st = jax.vmap(lambda a, b: comp.CompensatorState(
        comp.QuantizedMoment(*comp.quantize_state(a)),
        comp.QuantizedMoment(*comp.quantize_state(b))))(m1, m2)
    f = jax.jit(jax.vmap(lambda v, s: ej.echo_psum(v, "tp", config=INT8, state=s,
                                                   rescale=False), axis_name="tp"))
    y, new = f(x, st)
    ea, eb, b1, c1, b2, c2 = coefficients(INT8)
    for r in range(nranks):
        a1 = ref_read(np.asarray(st.m1.codes[r]), np.asarray(st.m1.scales[r]))
        a2 = ref_read(np.asarray(st.m2.codes[r]), np.asarray(st.m2.scales[r]))
        xp = np.asarray(x[r], F32) + ((ea * a1).astype(F32) + (eb * a2).astype(F32))
        u = xp - (np.asarray(y[r], F32) * F32(1.0 / nranks)).astype(F32)
        for got, m, b, c in ((new.m1, a1, b1, c1), (new.m2, a2, b2, c2)):
            q_got, s_got = got
            rq, rs = ref_quantize((b * m).astype(F32) + (c * u).astype(F32))
            np.testing.assert_array_equal(np.asarray(q_got[r]), rq)
            np.testing.assert_array_equal(np.asarray(s_got[r]).view(np.uint32),
                                          rs.view(np.uint32))


def test_the_plan_fuses_it_where_a_wire_group_is_a_state_group(monkeypatch):
    t = transports.CPU
    for cfg in (INT8, INT8.replace(rotation="hadamard")):
        rotation, compensation, reasons = transports.call_modes(t, cfg, "int8")
        assert compensation == "fused" and not reasons
    for cfg, why in ((INT8.replace(group_size=64), "int8 state needs group_size 128"),
                     (INT8.replace(state_update="separate"), "applied call takes no int8")):
        rotation, compensation, reasons = transports.call_modes(t, cfg, "int8")
        assert compensation == "jax" and any(why in r for r in reasons), reasons
    # The separate update's kernel takes the wide states only.
    assert transports.plan_with(t, INT8.replace(state_update="separate"),
                                state_dtype="int8").separate_update == "jax"
    # The CUDA kernels' int8 instances (fast stages only): planned, but not where the handlers
    # are told to run the generic stages.
    for cfg in (INT8, INT8.replace(rotation="hadamard")):
        assert transports.call_modes(transports.CUDA, cfg, "int8")[1:] == ("fused", ())
    assert transports.call_modes(transports.CUDA, INT8.replace(group_size=64), "int8")[1] == "jax"
    monkeypatch.setenv(cuda.GENERIC_ENV, "1")
    rotation, compensation, reasons = transports.call_modes(transports.CUDA, INT8, "int8")
    assert compensation == "jax" and any("fast stages only" in r and cuda.GENERIC_ENV in r
                                         for r in reasons), reasons
    monkeypatch.setenv(cuda.GENERIC_ENV, "0")
    assert transports.call_modes(transports.CUDA, INT8, "int8")[1] == "fused"


@pytest.mark.parametrize("dtype, rotation, rescale", [(jnp.float32, "none", True),
                                                      (jnp.bfloat16, "hadamard", "auto")],
                         ids=["f32", "bf16-rotated"])
def test_the_cpu_call_matches_the_jax_path_bit_for_bit(dtype, rotation, rescale):
    """The fused CPU call with the int8 state (one wire group a state group) against the same
    sites on the xla transport (Algorithm 1 in JAX, checked against NumPy above): the sums and
    every code and scale of both averages, over three sites, rescaled (rescale=True: the factor
    an operand of the call) or not (echo_psum's default), a short last group (n = 300) and a
    group holding a NaN, which poisons its scale."""
    n = 300
    xs = np.asarray(jax.random.normal(jax.random.key(5), (4, n)), np.float32) * 3
    xs[1, 140] = np.nan  # rank 1's second group: its sums are NaN, its state groups NaN
    xs = jnp.asarray(xs).astype(dtype)
    cfg = INT8.replace(transport="p2p", rotation=rotation)
    (y_call, s_call), f = quantized_state_sites(cfg, xs, 3, rescale)
    assert "echo_allreduce_comp_q8_cpu" in f.lower(xs).as_text()
    (y_ref, s_ref), _ = quantized_state_sites(cfg.replace(transport="xla"), xs, 3, rescale)
    both_nan = np.isnan(np.asarray(y_call, F32)) & np.isnan(np.asarray(y_ref, F32))
    np.testing.assert_array_equal(np.where(both_nan, 0, np.asarray(y_call, F32)),
                                  np.where(both_nan, 0, np.asarray(y_ref, F32)))
    assert both_nan.any()
    for got, want in zip(jax.tree.leaves(s_call), jax.tree.leaves(s_ref), strict=True):
        got, want = np.asarray(got), np.asarray(want)
        assert got.dtype == want.dtype and got.shape == want.shape
        if got.dtype == np.float32:  # scales: a NaN group's scale is NaN on both
            assert np.array_equal(np.isnan(got), np.isnan(want))
            got, want = np.where(np.isnan(got), 0, got), np.where(np.isnan(want), 0, want)
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
        else:
            np.testing.assert_array_equal(got, want)
    assert np.isnan(np.asarray(s_call.m1.scales)).any()


@pytest.mark.slow
@pytest.mark.parametrize("nranks, n", [(3, 5), (8, 300), (8, 1025), (2, 127)])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32])
@pytest.mark.parametrize("rotation", ["none", "hadamard"])
def test_the_cpu_call_matches_the_jax_path_on_odd_layouts(nranks, n, dtype, rotation):
    """The grid behind the case above: P up to 8 (segments of padding alone), n below one group
    and not a multiple of 128, both bit widths (odd n: 8 bits), large values (x 50, rescaled:
    rescale=True)."""
    xs = np.asarray(jax.random.normal(jax.random.key(nranks * 1000 + n), (nranks, n)), F32)
    xs = jnp.asarray(xs * 50).astype(dtype)
    cfg = INT8.replace(transport="p2p", rotation=rotation, bits=8 if n % 2 else 4)
    (y_call, s_call), _ = quantized_state_sites(cfg, xs, 2, True)
    (y_ref, s_ref), _ = quantized_state_sites(cfg.replace(transport="xla"), xs, 2, True)
    np.testing.assert_array_equal(np.asarray(y_call), np.asarray(y_ref))
    for got, want in zip(jax.tree.leaves(s_call), jax.tree.leaves(s_ref), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_the_explicit_call_names_what_to_fix():
    from echo_jax.transports import cpu
    x = jnp.zeros((256,), jnp.float32)
    st = ej.init_state(x, INT8)
    with pytest.raises(ValueError, match=r"int8 state needs group_size 128.*got 64"):
        jax.vmap(lambda v: cpu.allreduce_compensated(v, st.m1, st.m2, "tp", 1,
                                                     INT8.replace(group_size=64)),
                 axis_name="tp")(x[None])
    bad = ej.QuantizedMoment(st.m1.codes, st.m1.scales[:1])
    with pytest.raises(ValueError, match=r"m1_flat must be a QuantizedMoment .* scales \[2\]"):
        jax.vmap(lambda v: cpu.allreduce_compensated(v, bad, st.m2, "tp", 1, INT8),
                 axis_name="tp")(x[None])


@pytest.mark.parametrize("name", QUANTIZED)
def test_a_scan_over_sites_keeps_the_quantized_state(name):
    cfg = QUANTIZED[name]
    x = jax.random.normal(jax.random.key(4), (2, 8, 64))

    def sites(v):
        st = ej.init_state(v, cfg)

        def body(carry, _):
            h, s = carry
            y, s = ej.echo_psum(h, "tp", config=cfg, state=s)
            return (0.5 * y, s), None

        (h, s), _ = lax.scan(body, (v, st), None, length=3)
        return h, s

    h, s = jax.jit(jax.vmap(sites, axis_name="tp"))(x)
    assert s.m1.codes.dtype == jnp.dtype(name) and s.m1.scales.shape == (2, 4)
    assert bool(jnp.isfinite(h).all()) and bool((s.m1.scales > 0).all())


def test_the_gspmd_helpers_and_the_layers_gspmd_mode_refuse_it_with_the_fix():
    from echo_jax import gspmd
    from echo_jax.flax import sites
    with pytest.raises(ValueError, match=r"state_for: .*'int8'.*use state_dtype='float32'"):
        gspmd.state_for(jax.ShapeDtypeStruct((4, 8), jnp.float32), axis="tp",
                        mesh=jax.make_mesh((1,), ("tp",)), config=INT8)
    with pytest.raises(ValueError, match=r"reset: .*'int8'.*not yet in \"gspmd\" mode.*"
                                         r"run the model inside jax.shard_map"):
        with jax.set_mesh(jax.make_mesh((1,), ("tp",))):
            sites.zero_state(jnp.zeros((4, 8)), config=INT8, mode="gspmd")
    st = sites.zero_state(jnp.zeros((4, 128)), config=INT8)  # "local": no axis, no mesh
    assert st.m1.codes.dtype == jnp.int8 and st.m1.scales.shape == (4,)


@pytest.mark.parametrize("name", QUANTIZED)
def test_a_backward_site_carries_the_quantized_state_as_a_cotangent(name):
    """Two backward sites with the int8 (int4) state: the gradient and the final backward
    state (the cotangent of the state passed in the carrier form) equal, bit for bit, the two
    compensated all-reduces of the cotangent written out with echo_psum (rescaled, as the
    backward site runs them), the state threaded between them in backward order."""
    from echo_jax import compensator as C
    from echo_jax import tp
    cfg, codes = QUANTIZED[name], jnp.dtype(name)
    carrier = C.CODES_CARRIER if name == "int8" else C.CODES_CARRIER_4
    x = jax.random.normal(jax.random.key(5), (2, 256))

    def loss(v, st):
        h, st = tp.backward_site(v, "tp", cfg, st)
        h2, st = tp.backward_site(jnp.sin(h), "tp", cfg, st)
        return jnp.sum(h2 ** 2)

    def run(v):
        return jax.grad(loss, argnums=(0, 1))(v, C.as_carrier(ej.init_state(v, cfg)))

    def by_hand(v):
        ct, st = ej.echo_psum(2 * jnp.sin(v), "tp", config=cfg, rescale=True,
                              state=ej.init_state(v, cfg))            # the second site first
        return ej.echo_psum(ct * jnp.cos(v), "tp", config=cfg, rescale=True, state=st)

    gx, gs = jax.jit(jax.vmap(run, axis_name="tp"))(x)
    want_x, want_s = jax.jit(jax.vmap(by_hand, axis_name="tp"))(x)
    assert gs.m1.codes.dtype == carrier
    got_s = C.from_carrier(gs)
    assert got_s.m1.codes.dtype == codes and np.abs(_np(got_s.m1.codes)).max() > 0
    np.testing.assert_array_equal(np.asarray(gx), np.asarray(want_x))
    for got, want in zip(jax.tree.leaves(got_s), jax.tree.leaves(want_s)):
        np.testing.assert_array_equal(_np(got), _np(want))
    # Given as codes (from init_state), the state still flows between the sites; only its
    # final value, the cotangent of an integer input, has no values (float0).
    g_int8 = jax.jit(jax.vmap(lambda v: jax.grad(loss)(v, ej.init_state(v, cfg)),
                              axis_name="tp"))(x)
    np.testing.assert_array_equal(np.asarray(g_int8), np.asarray(want_x))
    # A float32 config with the quantized state: the call names the mismatch.
    def mismatched(v):
        return jax.grad(lambda u: jnp.sum(tp.backward_site(
            u, "tp", cfg.replace(state_dtype="float32"), ej.init_state(u, cfg))[0] ** 2))(v)
    with pytest.raises(ValueError, match=r"state.m1 must be a float32 array"):
        jax.vmap(mismatched, axis_name="tp")(x)
    fwd = jax.vmap(lambda v: loss(v, ej.init_state(v, cfg)), axis_name="tp")
    np.testing.assert_allclose(np.asarray(fwd(x)), np.asarray(jnp.sum(jnp.sin(x) ** 2, axis=1)),
                               rtol=1e-6)

    def forward(v):
        y, s = tp.forward_site(v, "tp", cfg, ej.init_state(v, cfg))
        return y, s

    y, s = jax.jit(jax.vmap(forward, axis_name="tp"))(x)
    assert s.m1.codes.dtype == codes
    want = np.asarray(x, np.float64).sum(0)
    assert np.abs(np.asarray(y[0], np.float64) - want).max() < 0.5 * np.abs(want).max()
