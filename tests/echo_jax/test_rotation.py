"""Randomized Hadamard rotation (EchoConfig.rotation="hadamard"): the transform itself, and
echo_psum with it (same bits on every rank and transport, psum gradients, outlier accuracy)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import echo_jax as ej
from echo_jax import rotation
from echo_jax.transports import cpu
from conftest import make_mesh, put
from np_reference import allreduce_error_bound

HAVE_CPU_CALL = "cpu" in cpu.available_platforms()
needs_call = pytest.mark.skipif(not HAVE_CPU_CALL, reason="the CPU custom call is not built")


def bits_of(a):
    return np.asarray(np.asarray(a).astype(np.float32)).view(np.uint32)


def assert_same_bits(got, want, what=""):
    np.testing.assert_array_equal(bits_of(got), bits_of(want), err_msg=what)


def sylvester(g):
    h = np.ones((1, 1), np.float64)
    while h.shape[0] < g:
        h = np.block([[h, h], [h, -h]])
    return h


# --------------------------------------------------------------------------------------------
# The transform


@pytest.mark.grid("3-128", "17-32")
@pytest.mark.parametrize("g", [32, 64, 128, 256])
@pytest.mark.parametrize("blocks", [1, 3, 17])
def test_roundtrip_orthogonality_and_definition(g, blocks):
    rng = np.random.default_rng(g + blocks)
    x = (rng.standard_normal(g * blocks) * 3).astype(np.float32)
    y = np.asarray(ej.hadamard_rotate(jnp.asarray(x), g))
    z = np.asarray(ej.hadamard_unrotate(jnp.asarray(y), g))
    np.testing.assert_allclose(z, x, rtol=0, atol=1e-6 * np.abs(x).max() * np.log2(g))
    np.testing.assert_allclose(np.linalg.norm(y.reshape(blocks, g), axis=1),
                               np.linalg.norm(x.reshape(blocks, g), axis=1), rtol=1e-5)
    # y = H_g / sqrt(g) diag(s) x per block, in float64.
    s = ej.hadamard_signs(g).astype(np.float64)
    want = (x.reshape(blocks, g).astype(np.float64) * s) @ sylvester(g).T / np.sqrt(g)
    np.testing.assert_allclose(y.reshape(blocks, g), want, rtol=0, atol=1e-5 * np.abs(x).max())


def test_signs_are_fixed_and_identical_across_calls():
    for g in (2, 32, 128, 1024):
        s = ej.hadamard_signs(g)
        assert s.dtype == np.float32 and s.shape == (g,) and set(np.unique(s)) <= {-1.0, 1.0}
        np.testing.assert_array_equal(s, rotation._signs.__wrapped__(g))  # recomputed, uncached
        assert not s.flags.writeable
    s = ej.hadamard_signs(1024)
    assert 400 < (s < 0).sum() < 624  # a balanced pseudo-random pattern
    np.testing.assert_array_equal(ej.hadamard_signs(128), s[:128])
    # Eager, jit and vmap give the same bits.
    x = jax.random.normal(jax.random.key(0), (4, 512))
    eager = np.stack([np.asarray(ej.hadamard_rotate(r, 128)) for r in x])
    assert_same_bits(jax.jit(jax.vmap(lambda v: ej.hadamard_rotate(v, 128)))(x), eager)


@pytest.mark.parametrize("policy", ["asym", "sym", "asym_naive"])
def test_unrotating_a_decoded_4bit_group_is_exact_in_integers(policy):
    # The CUDA tail's exact path (ffi/fast_io.cuh, ExactDecoder) rests on this identity of the
    # reference: a 4-bit group whose zero point z is an integer in [0, 15] and whose scale s is
    # below 2^117 rotates back to (s I) (+-f) with I = H (c - z) in integers, rounded once;
    # I stays within fp16's exact integers. Checked against int64 arithmetic, groups over the
    # fp32 range.
    from echo_jax import quant
    g, blocks = 128, 400
    rng = np.random.default_rng(7)
    scale = 10.0 ** rng.uniform(-29, 33, (blocks, 1))
    x = rng.standard_normal((blocks, g)) * scale
    signs = ej.hadamard_signs(g).astype(np.float64)
    x[0] = -3.0 * signs                         # rotated: one negative value, the rest 0
    x[1] = 3.0 * signs                          # one positive value: z = -0
    x[2] *= 1e37 / scale[2]                     # s >= 2^117
    xr = ej.hadamard_rotate(jnp.asarray(x.astype(np.float32)).reshape(-1), g).reshape(blocks, g)
    packed, params = quant.quantize_groups(xr, 4, policy)
    decoded = quant.dequantize_groups(packed, params, 4, policy)
    want = np.asarray(ej.hadamard_unrotate(decoded.reshape(-1), g)).reshape(blocks, g)
    codes = np.asarray(quant.unpack_codes(packed, 4)).astype(np.int64)
    s = np.asarray(quant.group_scales(params))[:, :1]
    z = np.float32(8) if policy == "sym" else np.asarray(quant.group_zero_points(params))[:, :1]
    z = np.broadcast_to(z, s.shape)
    exact = ((s > 0) & (s < np.float32(2.0 ** 117)) & (z >= 0) & (z <= 15) & (z == np.round(z)))
    rows = exact[:, 0]
    ints = (codes[rows] - z[rows].astype(np.int64)) @ sylvester(g).astype(np.int64).T
    assert np.abs(ints).max() <= 2048
    f = np.float32(1.0 / np.sqrt(g))
    signed_s = (s[rows] * ej.hadamard_signs(g)).astype(np.float32)   # +-s, exact
    got = (ints.astype(np.float32) * signed_s) * f                    # s I exact, one rounding
    assert_same_bits(got, want[rows])
    # Rotated sums straddle 0, so every other group is exact with asym and sym; asym_naive's
    # zero point is an integer only by chance. Row 0's range ends at 0, so its zero point is
    # -lo / s, not an integer (asym); row 1's is -0; row 2's scale is too large.
    assert not rows[2] and rows[1] and rows[0] == (policy == "sym")
    if policy != "asym_naive":
        assert rows[3:].all()


def test_transform_errors():
    with pytest.raises(ValueError, match="power of two"):
        ej.hadamard_rotate(jnp.ones(96), 96)
    with pytest.raises(ValueError, match="multiple of group_size"):
        ej.hadamard_unrotate(jnp.ones(100), 32)
    with pytest.raises(ValueError, match="float32"):
        ej.hadamard_rotate(jnp.ones(64, jnp.bfloat16), 32)


def rotate64(x, g):
    """Float64 reference rotation of the last axis, in blocks of g: H_g / sqrt(g) diag(s) x."""
    blocks = np.asarray(x, np.float64).reshape(*np.shape(x)[:-1], -1, g)
    rot = (blocks * ej.hadamard_signs(g).astype(np.float64)) @ sylvester(g).T / np.sqrt(g)
    return rot.reshape(np.shape(x))


def check_rotated_error(y, x, cfg):
    """|rotate(y - exact)| within the independent bound of the all-reduce of the rotated
    contributions (`np_reference.allreduce_error_bound`), element by element in the rotated
    basis, where the quantizer works (the rotation is orthogonal, so this is the error).

    y: result [n] in x's dtype; x: [P, n]. Float64 throughout: the rotation from its definition
    (Sylvester matrix, the fixed signs), never the code's. Slack: the fp32 rotations (a few ulps
    of the group norm) and, for a 16-bit result, its rounding (half an ulp of each |y|, at most
    the norm of those in any rotated coordinate)."""
    g = cfg.group_size
    x32 = np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)
    nr, n = x32.shape
    padded = -(-n // g) * g
    xr = rotate64(np.pad(x32, ((0, 0), (0, padded - n))), g)
    bound = allreduce_error_bound(xr.astype(np.float32), cfg.bits, g, cfg.policy)
    y64 = np.asarray(jnp.asarray(y).astype(jnp.float32), np.float64)
    err = rotate64(np.pad(y64 - x32.sum(0), (0, padded - n)), g)
    half_ulp = {2: 2.0 ** -8 if jnp.asarray(y).dtype == jnp.bfloat16 else 2.0 ** -11,
                4: 0.0}[jnp.asarray(y).dtype.itemsize]
    norms = lambda v: np.linalg.norm(v.reshape(-1, g), axis=1, keepdims=True)  # noqa: E731
    slack = (1e-5 * norms(np.abs(xr).sum(0)) + half_ulp * norms(np.pad(y64, (0, padded - n))))
    excess = np.abs(err).reshape(-1, g) - (bound.reshape(-1, g) + slack)
    assert np.all(excess <= 0), float(excess.max())


# --------------------------------------------------------------------------------------------
# echo_psum with rotation


def as_varying(y, axis="tp"):
    mat = getattr(jax.typeof(y), "mat", None)
    return y if mat is not None and axis in mat.varying else lax.pcast(y, axis, to="varying")


def run_shard_map(x, cfg, state=None, rescale=False):
    """x: [P, ...] per-rank contributions -> [P, ...] results (and per-rank m1, m2)."""
    mesh = make_mesh((x.shape[0],), ("tp",))

    def body(xr, *st):
        if st:
            s = ej.CompensatorState(st[0][0], st[1][0])
            y, s = ej.echo_psum(xr[0], "tp", config=cfg, state=s, rescale=rescale)
            return as_varying(y)[None], s.m1[None], s.m2[None]
        return as_varying(ej.echo_psum(xr[0], "tp", config=cfg, rescale=rescale))[None]

    args = (x,) if state is None else (x, state.m1, state.m2)
    out = P("tp") if state is None else (P("tp"),) * 3
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"),) * len(args), out_specs=out))
    return f(*[put(a, mesh, P("tp")) for a in args])


def run_vmap(x, cfg, state=None, rescale=False):
    if state is None:
        return jax.jit(jax.vmap(lambda v: ej.echo_psum(v, "tp", config=cfg, rescale=rescale),
                                axis_name="tp"))(x)
    f = jax.vmap(lambda v, s: ej.echo_psum(v, "tp", config=cfg, state=s, rescale=rescale),
                 axis_name="tp")
    y, s = jax.jit(f)(x, state)
    return y, s.m1, s.m2


def some_state(x):
    x32 = jnp.asarray(x, jnp.float32)
    return ej.CompensatorState(0.1 * x32, -0.05 * x32)


@pytest.mark.grid("2-4-1000-float32")
@pytest.mark.parametrize("nranks,bits,n,dtype", [
    (2, 4, 1000, jnp.float32), (4, 4, 4097, jnp.bfloat16), (8, 4, 1000, jnp.bfloat16),
    (2, 8, 4097, jnp.bfloat16), (4, 8, 1000, jnp.float32), (8, 8, 4097, jnp.float32),
])
def test_identical_ranks_and_transports(nranks, bits, n, dtype):
    cfg = ej.EchoConfig(bits=bits, rotation="hadamard", transport="xla")
    x = jax.random.normal(jax.random.key(nranks * 10 + bits), (nranks, n)).astype(dtype)
    st = some_state(x)
    y = run_shard_map(x, cfg)
    yc, m1, m2 = run_shard_map(x, cfg, st)
    assert y.dtype == dtype and y.shape == x.shape
    for r in range(1, nranks):
        assert_same_bits(y[r], y[0], f"rank {r}")
        assert_same_bits(yc[r], yc[0], f"compensated, rank {r}")
    check_rotated_error(y[0], x, cfg)
    # The rotation changes the bits (it is not a no-op) ...
    assert not np.array_equal(bits_of(y), bits_of(run_shard_map(x, cfg.replace(rotation="none"))))
    # ... and the custom call gives the same bits and the same state.
    if HAVE_CPU_CALL:
        cp = cfg.replace(transport="p2p")
        assert_same_bits(run_shard_map(x, cp), y, "p2p vs xla")
        pc, p1, p2 = run_shard_map(x, cp, st)
        assert_same_bits(pc, yc, "p2p vs xla, compensated")
        assert_same_bits(p1, m1, "m1")
        assert_same_bits(p2, m2, "m2")
    # Simulated ranks (vmap) agree with shard_map bit for bit.
    assert_same_bits(run_vmap(x, cfg), y, "vmap")
    for got, want in zip(run_vmap(x, cfg, st), (yc, m1, m2)):
        assert_same_bits(got, want, "vmap, compensated")


def test_compensator_state_semantics_in_the_original_basis():
    """The state update is Eq. 4/11 on the un-rotated compensated input and result."""
    cfg = ej.EchoConfig(bits=4, rotation="hadamard", transport="xla")
    x = jax.random.normal(jax.random.key(1), (4, 3, 100))
    st = some_state(x)
    y, m1, m2 = run_vmap(x, cfg, st)
    # Float64 from the config's fields (not the code's Coefficients or update_state).
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    e, a, b1, b2 = cfg.eta, cfg.blend, cfg.beta1, cfg.beta2
    xp = f64(x) + e * (a * f64(st.m1) + (1 - a) * f64(st.m2))        # Eq. 10
    u = xp - f64(y) / 4                                              # Eq. 4
    np.testing.assert_allclose(np.asarray(m1), b1 * f64(st.m1) + (1 - b1) * u, rtol=0, atol=2e-6)
    np.testing.assert_allclose(np.asarray(m2), b2 * f64(st.m2) + (1 - b2) * u, rtol=0, atol=2e-6)
    # The result is the rotated quantized sum of x' (in the original basis, Eq. 1).
    check_rotated_error(np.asarray(y)[0].reshape(-1), xp.reshape(4, -1), cfg)


@needs_call
def test_p2p_with_rotation_runs_the_fused_call():
    # The rotation, the compensator and the protocol all stay in the one custom call, with the
    # default rescale ("auto": no factor, so no collective at all besides the call) and with
    # rescale=True (its factor, from x, is an operand of the call: one scalar pmax).
    mesh = make_mesh((4,), ("tp",))
    cfg = ej.EchoConfig(rotation="hadamard", transport="p2p")
    for rescale in ("auto", True):
        def body(v, rescale=rescale):
            y, s = ej.echo_psum(v[0], "tp", config=cfg, state=ej.init_state(v[0]),
                                rescale=rescale)
            return as_varying(y)[None], s.m1[None]

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"),
                                  out_specs=(P("tp"), P("tp"))))
        hlo = f.lower(put(jnp.ones((4, 4096)), mesh, P("tp"))).compile().as_text()
        assert cpu.TARGET_COMPENSATED in hlo and "rotate = 1" in hlo, rescale
        for op in ("all-to-all(", "all-gather("):
            assert op not in hlo
        reduces = [ln for ln in hlo.splitlines() if "all-reduce(" in ln]
        if rescale is True:
            assert len(reduces) == 1 and "f32[] " in reduces[0], reduces
        else:
            assert not reduces, reduces


def outlier_data(seed, nranks=4, tokens=64, channels=1024, outlier=100.0):
    x = np.random.default_rng(seed).standard_normal((nranks, tokens, channels)).astype(np.float32)
    if outlier:
        x[:, :, 37] *= outlier  # one massive channel in every token (an LLM outlier feature)
    return jnp.asarray(x)


def rel_error(x, cfg):
    y = np.asarray(run_vmap(x, cfg))[0]
    exact = np.asarray(x, np.float64).sum(0)
    return np.linalg.norm(y - exact) / np.linalg.norm(exact)


def test_rotation_reduces_the_error_of_outlier_channels():
    base = ej.EchoConfig(bits=4, transport="xla")
    rotated = base.replace(rotation="hadamard")
    x = outlier_data(2)
    ratio = rel_error(x, rotated) / rel_error(x, base)
    print(f"\nhadamard/none relative error, 4-bit, one channel x100: {ratio:.3f}")
    # Without rotation the zero-aware map already keeps the outlier group's near-zero values
    # within |x| of themselves (0 is a grid point), so the rotation's gain is a factor of about
    # 0.6 here (0.616 measured), not more.
    assert ratio < 0.75
    g = outlier_data(3, outlier=0)
    ratio_g = rel_error(g, rotated) / rel_error(g, base)
    print(f"hadamard/none relative error, 4-bit, Gaussian: {ratio_g:.3f}")
    assert ratio_g < 1.3


def test_grad_is_psum_grad():
    nranks = 4
    x = jax.random.normal(jax.random.key(4), (nranks, 3, 100))
    w = jax.random.normal(jax.random.key(5), (nranks, 3, 100))
    mesh = make_mesh((nranks,), ("tp",))
    cfg = ej.EchoConfig(bits=4, rotation="hadamard", transport="xla")

    reducers = {
        "psum": lambda v: lax.psum(v, "tp"),
        "echo": lambda v: ej.echo_psum(v, "tp", config=cfg),
        "rescale": lambda v: ej.echo_psum(v, "tp", config=cfg, rescale=True),
        "state": lambda v: ej.echo_psum(v, "tp", config=cfg, state=some_state(v))[0],
    }
    if HAVE_CPU_CALL:
        reducers["p2p"] = lambda v: ej.echo_psum(v, "tp", config=cfg.replace(transport="p2p"),
                                                 state=some_state(v))[0]

    # A loss linear in the sum: its gradient does not depend on the forward value, so the
    # straight-through derivative must give psum's gradient bit for bit.
    def linear_grad(reduce):
        def body(v, wr):
            return jax.grad(lambda u: jnp.sum(wr[0] * reduce(jnp.tanh(u[0]) * 1.5)))(v)
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P("tp")),
                                  out_specs=P("tp")))
        return f(put(x, mesh, P("tp")), put(w, mesh, P("tp")))

    want = linear_grad(reducers["psum"])
    for name, reduce in reducers.items():
        assert_same_bits(linear_grad(reduce), want, name)

    # vmap-simulated ranks: the same gradients as psum there (and as shard_map up to the
    # order of the 4-term sum).
    def vgrad(reduce):
        return jax.jit(jax.vmap(jax.grad(lambda u, wr: jnp.sum(wr * reduce(jnp.tanh(u) * 1.5))),
                                axis_name="tp"))(x, w)

    assert_same_bits(vgrad(reducers["echo"]), vgrad(reducers["psum"]), "vmap")
    np.testing.assert_allclose(np.asarray(vgrad(reducers["echo"])), np.asarray(want), rtol=1e-6)


def test_rescale_with_rotation_handles_tiny_and_huge_magnitudes():
    x = jax.random.normal(jax.random.key(7), (4, 512))
    cfg = ej.EchoConfig(bits=8, rotation="hadamard", transport="xla")
    for scale in (1e-20, 1.0, 1e7):
        y = np.asarray(run_shard_map(x * scale, cfg, rescale=True))
        exact = np.asarray(x).sum(0) * scale
        np.testing.assert_allclose(y[0], exact, rtol=0, atol=0.03 * np.abs(exact).max())
    # The factor comes from x and multiplies it before the rotation: scaling x by a power of two
    # scales the result by it exactly.
    assert_same_bits(run_shard_map(x * 2.0 ** 10, cfg, rescale=True),
                     run_shard_map(x, cfg, rescale=True) * 2.0 ** 10)
    assert_same_bits(run_vmap(x, cfg, rescale=True), run_shard_map(x, cfg, rescale=True))


def test_size_gate_takes_precedence():
    cfg = ej.EchoConfig(bits=4, rotation="hadamard", transport="xla", min_bytes=1 << 20)
    x = jax.random.normal(jax.random.key(9), (4, 256))
    st = some_state(x)
    y, m1, m2 = run_shard_map(x, cfg, st)
    mesh = make_mesh((4,), ("tp",))
    psum = jax.jit(jax.shard_map(lambda v: lax.psum(v[0], "tp")[None], mesh=mesh,
                                 in_specs=P("tp"), out_specs=P("tp"), check_vma=False))
    assert_same_bits(y, psum(put(x, mesh, P("tp"))))
    assert_same_bits(m1, st.m1)
    assert_same_bits(m2, st.m2)


def test_pytree_and_group_sizes():
    tree = {"a": jax.random.normal(jax.random.key(10), (2, 7, 33)),
            "b": jax.random.normal(jax.random.key(11), (2, 1))}
    for g in (32, 64, 256):
        cfg = ej.EchoConfig(bits=8, group_size=g, rotation="hadamard", transport="xla")
        y = jax.jit(jax.vmap(functools.partial(ej.echo_psum, axis_name="tp", config=cfg),
                             axis_name="tp"))(tree)
        for k in tree:
            check_rotated_error(np.asarray(y[k][0]).reshape(-1), np.asarray(tree[k]).reshape(2, -1),
                                cfg)
