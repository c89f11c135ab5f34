"""echo_psum with the pure-JAX transport: psum semantics, exactness properties, error bounds."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import echo_jax as ej
from echo_jax import policies, quant
from np_reference import allreduce_error_bound, element_error_bound, max_scale
from conftest import make_mesh, put

POLICIES = policies.NAMES  # ("asym", "sym", "asym_naive")


def run_shard_map(x, cfg, state=None, rescale=False):
    """x: [P, ...] per-rank contributions -> ([P, ...] per-rank results, states)."""
    n = x.shape[0]
    mesh = make_mesh((n,), ("tp",))

    def body(xr, *st):
        if st:
            y, s = ej.echo_psum(xr[0], "tp", config=cfg, state=ej.CompensatorState(
                st[0][0], st[1][0]), rescale=rescale)
            return y[None], s.m1[None], s.m2[None]
        return ej.echo_psum(xr[0], "tp", config=cfg, rescale=rescale)[None]

    args = (x,) if state is None else (x, state.m1, state.m2)
    nout = 1 if state is None else 3
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"),) * len(args),
                              out_specs=(P("tp"),) * nout if nout > 1 else P("tp"),
                              check_vma=False))
    return f(*[put(a, mesh, P("tp")) for a in args])


def run_vmap(x, cfg, state=None):
    if state is None:
        return jax.jit(jax.vmap(lambda v: ej.echo_psum(v, "tp", config=cfg), axis_name="tp"))(x)
    f = jax.vmap(lambda v, s: ej.echo_psum(v, "tp", config=cfg, state=s), axis_name="tp")
    return jax.jit(f)(x, state)


def error_bound(x, cfg):
    """Per-element bound on |echo - exact sum| (Eq. 1), from the data alone (NumPy float64)."""
    return allreduce_error_bound(x, cfg.bits, cfg.group_size, cfg.policy)


@pytest.mark.grid("asym-4-3", "sym-8-4")
@pytest.mark.parametrize("nranks", [2, 3, 4, 8])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("policy", POLICIES)
def test_identical_ranks_and_bounded_error(nranks, bits, policy):
    cfg = ej.EchoConfig(bits=bits, policy=policy, transport="xla")
    rng = np.random.default_rng(nranks * 100 + bits)
    x = rng.standard_normal((nranks, 1000)).astype(np.float32) + 0.2
    y = np.asarray(run_shard_map(jnp.asarray(x), cfg))
    assert all(np.array_equal(y[0], y[r]) for r in range(nranks))
    err = np.abs(y[0] - x.sum(0))
    assert np.all(err <= error_bound(x, cfg)), float(err.max())
    if bits == 8:
        assert err.max() < 0.05 * np.abs(x.sum(0)).max()


@pytest.mark.grid("3-shape0-float32", "4-shape3-bfloat16", "3-shape4-float16")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("shape", [(1,), (7,), (127,), (3, 129), (2, 5, 33)])
@pytest.mark.parametrize("nranks", [3, 4])
def test_dtypes_and_odd_shapes(dtype, shape, nranks):
    cfg = ej.EchoConfig(bits=8, transport="xla")
    x = jax.random.normal(jax.random.key(1), (nranks, *shape)).astype(dtype)
    y = run_shard_map(x, cfg)
    assert y.dtype == dtype and y.shape == x.shape
    y = np.asarray(y.astype(jnp.float32))
    assert all(np.array_equal(y[0], y[r]) for r in range(nranks))
    x32 = np.asarray(x.astype(jnp.float32))
    exact = x32.astype(np.float64).sum(0)
    # The fp32 sum is within the independent bound; the result is then rounded once to x's
    # dtype (half an ulp: 2^-8 relative for bfloat16, 2^-11 for float16).
    bound = error_bound(x32, cfg)
    half_ulp = {jnp.float32: 0.0, jnp.bfloat16: 2.0 ** -8, jnp.float16: 2.0 ** -11}[dtype]
    tol = bound + half_ulp * (np.abs(exact) + bound)
    assert np.all(np.abs(y[0] - exact) <= tol), float(np.max(np.abs(y[0] - exact) - tol))


@pytest.mark.grid("asym-3")
@pytest.mark.parametrize("nranks", [2, 3, 8])
@pytest.mark.parametrize("policy", POLICIES)
def test_vmap_simulation_equals_shard_map_bit_for_bit(nranks, policy):
    cfg = ej.EchoConfig(bits=4, policy=policy, transport="xla")
    x = jax.random.normal(jax.random.key(2), (nranks, 3, 300))
    np.testing.assert_array_equal(np.asarray(run_vmap(x, cfg)), np.asarray(run_shard_map(x, cfg)))
    st = ej.init_state(x)
    st = ej.CompensatorState(st.m1 + 0.1 * x, st.m2 - 0.05 * x)
    yv, sv = run_vmap(x, cfg, st)
    ys, m1, m2 = run_shard_map(x, cfg, st)
    np.testing.assert_array_equal(np.asarray(yv), np.asarray(ys))
    np.testing.assert_array_equal(np.asarray(sv.m1), np.asarray(m1))
    np.testing.assert_array_equal(np.asarray(sv.m2), np.asarray(m2))


def test_axis_size_one_is_exact():
    mesh = make_mesh((1,), ("tp",))
    x = jax.random.normal(jax.random.key(3), (1, 100))
    f = jax.jit(jax.shard_map(lambda v: ej.echo_psum(v, "tp"), mesh=mesh, in_specs=P("tp"),
                              out_specs=P("tp")))
    np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(x))
    y = jax.vmap(lambda v: ej.echo_psum(v, "tp"), axis_name="tp")(x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


def test_unbound_axis_is_a_clear_error():
    with pytest.raises(ValueError, match="'tp' is not bound"):
        ej.echo_psum(jnp.ones(4), "tp")
    with pytest.raises(ValueError, match="'model' is not bound"):
        jax.vmap(lambda v: ej.echo_psum(v, "model"), axis_name="tp")(jnp.ones((2, 4)))


def test_bad_dtype_and_state_errors():
    f = jax.vmap(lambda v: ej.echo_psum(v, "tp"), axis_name="tp")
    with pytest.raises(ValueError, match="complex64"):
        f(jnp.ones((2, 4), jnp.complex64))
    with pytest.raises(ValueError, match="shape"):
        jax.vmap(lambda v: ej.echo_psum(v, "tp", state=ej.init_state(jnp.ones(3))),
                 axis_name="tp")(jnp.ones((2, 4)))
    with pytest.raises(ValueError, match="EchoConfig"):
        f2 = jax.vmap(lambda v: ej.echo_psum(v, "tp", config={"bits": 4}), axis_name="tp")
        f2(jnp.ones((2, 4)))


def test_pytrees():
    """Every leaf of a pytree is summed (within the independent bound of its own data) and, with
    a state, compensated: its result is the quantized sum of x' = x + c (Eq. 10) and its new
    state is Eq. 11 of its own residual, checked leaf by leaf in float64 from the config."""
    cfg = ej.EchoConfig(bits=4, transport="xla")
    rng = np.random.default_rng(20)
    f32 = np.float32
    tree = {"a": rng.standard_normal((4, 10)).astype(f32),
            "b": (rng.standard_normal((4, 6, 50)).astype(f32),
                  (rng.standard_normal((4, 3)) + 2).astype(f32))}
    y = jax.jit(jax.vmap(lambda t: ej.echo_psum(t, "tp", config=cfg), axis_name="tp"))(tree)
    assert jax.tree.structure(y) == jax.tree.structure(tree)
    for x, yl in zip(jax.tree.leaves(tree), jax.tree.leaves(y)):
        yl = np.asarray(yl)
        assert yl.shape == x.shape and all(np.array_equal(yl[0], yl[r]) for r in range(4))
        assert np.all(np.abs(yl[0] - x.astype(np.float64).sum(0)) <= error_bound(x, cfg))

    st = jax.tree.map(lambda v: ej.CompensatorState(
        (0.3 * rng.standard_normal(v.shape)).astype(f32),
        (-0.2 * rng.standard_normal(v.shape)).astype(f32)), tree)
    ys, st2 = jax.jit(jax.vmap(lambda t, s: ej.echo_psum(t, "tp", config=cfg, state=s),
                               axis_name="tp"))(tree, st)
    assert jax.tree.structure(ys) == jax.tree.structure(tree)
    assert jax.tree.structure(st2, is_leaf=lambda v: isinstance(v, ej.CompensatorState)) == \
        jax.tree.structure(st, is_leaf=lambda v: isinstance(v, ej.CompensatorState))
    assert isinstance(st2["b"][0], ej.CompensatorState)
    e, a, b1, b2 = cfg.eta, cfg.blend, cfg.beta1, cfg.beta2
    states = jax.tree.leaves(st, is_leaf=lambda v: isinstance(v, ej.CompensatorState))
    news = jax.tree.leaves(st2, is_leaf=lambda v: isinstance(v, ej.CompensatorState))
    for x, yl, s0, s1 in zip(jax.tree.leaves(tree), jax.tree.leaves(ys), states, news):
        m1, m2, yl = (np.asarray(v, np.float64) for v in (s0.m1, s0.m2, yl))
        xp = x + e * (a * m1 + (1 - a) * m2)                              # Eq. 10
        assert np.all(np.abs(yl[0] - xp.sum(0)) <= error_bound(xp, cfg) + 1e-5)
        u = xp - yl / 4                                                   # Eq. 4
        np.testing.assert_allclose(np.asarray(s1.m1), b1 * m1 + (1 - b1) * u, rtol=0, atol=2e-6)
        np.testing.assert_allclose(np.asarray(s1.m2), b2 * m2 + (1 - b2) * u, rtol=0, atol=2e-6)


def test_multi_axis_mesh_reduces_only_the_named_axis():
    mesh = make_mesh((2, 4), ("dp", "tp"))
    cfg = ej.EchoConfig(bits=8, transport="xla")
    x = jax.random.normal(jax.random.key(4), (2, 4, 256))
    f = jax.jit(jax.shard_map(lambda v: ej.echo_psum(v, "tp", config=cfg), mesh=mesh,
                              in_specs=P("dp", "tp"), out_specs=P("dp", "tp"), check_vma=False))
    y = np.asarray(f(put(x, mesh, P("dp", "tp"))))
    exact = np.asarray(x).sum(1)
    for d in range(2):
        bound = error_bound(np.asarray(x[d]), cfg)
        for t in range(4):
            assert np.all(np.abs(y[d, t] - exact[d]) <= bound)
        assert all(np.array_equal(y[d, 0], y[d, t]) for t in range(4))
    assert not np.allclose(y[0, 0], y[1, 0])


@pytest.mark.parametrize("transport", ["auto", "xla"])
def test_typed_shard_map_result_is_invariant_like_psum(transport):
    mesh = make_mesh((4,), ("tp",))
    x = jax.random.normal(jax.random.key(5), (4, 64))
    cfg = ej.EchoConfig(transport=transport)
    f = jax.jit(jax.shard_map(lambda v: ej.echo_psum(v[0], "tp", config=cfg), mesh=mesh,
                              in_specs=P("tp"), out_specs=P()))  # P() needs an invariant result
    err = np.abs(np.asarray(f(put(x, mesh, P("tp")))) - np.asarray(x, np.float64).sum(0))
    assert np.all(err <= error_bound(np.asarray(x), cfg)), float(err.max())
    # An invariant (replicated) input counts once per rank, as with lax.psum.
    cfg8 = cfg.replace(bits=8)
    g = jax.jit(jax.shard_map(lambda v: ej.echo_psum(v, "tp", config=cfg8),
                              mesh=mesh, in_specs=P(), out_specs=P()))
    err = np.abs(np.asarray(g(jnp.ones(64))) - 4.0)
    assert np.all(err <= error_bound(np.ones((4, 64), np.float32), cfg8))


def test_hlo_has_no_full_width_all_reduce():
    mesh = make_mesh((4,), ("tp",))
    x = jnp.ones((4, 4096))
    for rescale in (False, True):
        f = jax.jit(jax.shard_map(functools.partial(
            ej.echo_psum, axis_name="tp", rescale=rescale,
            config=ej.EchoConfig(transport="xla")), mesh=mesh, in_specs=P("tp"), out_specs=P()))
        hlo = f.lower(put(x, mesh, P("tp"))).compile().as_text()
        assert "all-to-all" in hlo and "all-gather" in hlo
        reduces = [ln for ln in hlo.splitlines() if " all-reduce(" in ln or "all-reduce-start(" in ln]
        # Only the one-scalar pmax of the rescaling may be an all-reduce.
        assert len(reduces) == (1 if rescale else 0), reduces
        for ln in reduces:
            assert "f32[] " in ln


def test_hlo_of_the_custom_call_has_no_collective_of_x():
    from echo_jax import transports
    reason = transports.unavailable_reason()
    if reason is not None and "shard_map" not in reason:
        pytest.skip(reason)
    mesh = make_mesh((4,), ("tp",))
    for rescale in (False, "auto", True):
        f = jax.jit(jax.shard_map(functools.partial(ej.echo_psum, axis_name="tp",
                                                    config=ej.EchoConfig(transport="p2p"),
                                                    rescale=rescale),
                                  mesh=mesh, in_specs=P("tp"), out_specs=P()))
        hlo = f.lower(put(jnp.ones((4, 4096)), mesh, P("tp"))).compile().as_text()
        assert "custom-call" in hlo and "echo_allreduce_cpu" in hlo
        for op in ("all-to-all(", "all-gather("):
            assert op not in hlo
        # rescale=True's factor: one scalar pmax of max |x|, never a collective of x. The
        # default ("auto") is rescale=False: no factor, so no max and no all-reduce at all.
        reduces = [ln for ln in hlo.splitlines() if "all-reduce(" in ln]
        assert len(reduces) == (1 if rescale is True else 0), (rescale, reduces)
        assert all("f32[] " in ln for ln in reduces), reduces
        assert ("maximum(" in hlo) == (rescale is True), rescale


def test_jit_grad_scan_remat():
    """A scanned, rematerialised stack of compensated sites under jit and grad: its gradient is
    the straight-through one, checked against a float64 backward pass written out by hand.

    Per rank r: h_0 = x_r, h_{k+1} = h_k + y_k / 4 with y_k = echo(tanh(h_k w_k)) (every rank
    the same sum), loss_r = sum(h_N). With y_k's derivative taken as the exact sum's, the
    gradient of sum_r loss_r is g_N = 1 and, going back,
        g_k[r] = g_{k+1}[r] + w_k / 4 * sech^2(h_k[r] w_k) * sum_r' g_{k+1}[r'],
    on the trajectory h_k the forward pass took (echo's own y_k)."""
    cfg = ej.EchoConfig(bits=8, transport="xla")
    ws = jnp.linspace(0.5, 1.5, 6)

    def stack(x):
        def site(carry, w):
            h, s = carry
            y, s = ej.echo_psum(jnp.tanh(h * w), "tp", config=cfg, state=s)
            return (h + y / 4, s), y
        (h, _), ys = lax.scan(jax.checkpoint(site), (x, ej.init_state(x)), ws)
        return jnp.sum(h), ys

    x = jax.random.normal(jax.random.key(6), (4, 32))
    f = jax.jit(jax.vmap(jax.value_and_grad(stack, has_aux=True), axis_name="tp"))
    (_, ys), g = f(x)
    ys = np.asarray(ys[0], np.float64)                     # [sites, 32], the same on every rank
    w64 = np.asarray(ws, np.float64)
    hs = [np.asarray(x, np.float64)]
    for k in range(len(w64)):
        hs.append(hs[-1] + ys[k] / 4)
    want = np.ones_like(hs[0])
    for k in reversed(range(len(w64))):
        sech2 = 1 - np.tanh(hs[k] * w64[k]) ** 2
        want = want + w64[k] / 4 * sech2 * want.sum(0)
    np.testing.assert_allclose(np.asarray(g), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["plain", "compensated", "rescale"])
@pytest.mark.parametrize("transport", ["xla", "p2p"])
def test_straight_through_gradient_values(transport, mode):
    """The derivative of echo_psum is the exact sum's (psum's transpose: the cotangents of all
    ranks summed), checked in float64 against the analytic gradient, for the "xla" transport and
    the custom call, without a state, with one (the fused call on "p2p") and rescaled.

    Loss of rank r: sum(w_r * sin(y)), y = echo(1.5 tanh(x_r)). Straight-through, the gradient
    of sum_r loss_r with respect to x_i is 1.5 sech^2(x_i) * sum_r w_r cos(y), at the y the
    forward pass returned."""
    from echo_jax.transports import cpu
    if transport == "p2p" and "cpu" not in cpu.available_platforms():
        pytest.skip("the CPU custom call is not built")
    nranks, n = 4, 300
    mesh = make_mesh((nranks,), ("tp",))
    cfg = ej.EchoConfig(bits=4, transport=transport)
    rng = np.random.default_rng(7)
    x, w, m1, m2 = (rng.standard_normal((nranks, n)).astype(np.float32) for _ in range(4))

    def body(v, wr, a, b):
        u = jnp.tanh(v[0]) * 1.5
        if mode == "compensated":
            y, _ = ej.echo_psum(u, "tp", config=cfg, state=ej.CompensatorState(a[0], b[0]))
        else:
            y = ej.echo_psum(u, "tp", config=cfg, rescale=mode == "rescale")
        mat = getattr(jax.typeof(y), "mat", None)   # per-rank copies out of shard_map
        y = y if mat is not None and "tp" in mat.varying else lax.pcast(y, "tp", to="varying")
        return jnp.sum(wr[0] * jnp.sin(y))[None], y[None]

    def total(v, wr, a, b):
        per_rank, y = jax.shard_map(body, mesh=mesh, in_specs=(P("tp"),) * 4,
                                    out_specs=(P("tp"), P("tp")))(v, wr, a, b)
        return jnp.sum(per_rank), y

    args = [put(a, mesh, P("tp")) for a in (x, w, 0.3 * m1, -0.2 * m2)]
    (_, y), g = jax.jit(jax.value_and_grad(total, has_aux=True))(*args)
    y = np.asarray(y, np.float64)
    assert all(np.array_equal(y[0], y[r]) for r in range(nranks))
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    want = 1.5 * (1 - np.tanh(x64) ** 2) * (w64 * np.cos(y[0])).sum(0)
    np.testing.assert_allclose(np.asarray(g), want, rtol=1e-5, atol=1e-6)
    if transport == "p2p" and mode == "compensated":   # the fused call ran (and was differentiated)
        hlo = jax.jit(jax.grad(lambda *a: total(*a)[0])).lower(*args).compile().as_text()
        assert cpu.TARGET_COMPENSATED in hlo


def test_rescale_handles_tiny_and_huge_magnitudes():
    """rescale=True (a shared power of two, max |x| into [256, 512)) keeps the sum within Eq. 1's
    bound (taken at that magnitude, where its absolute slack is meant) at any magnitude: below
    the wire format's 2^-100 scale floor (1e-32) and where a sum reaches its 2^126 limit. There
    rescale=False loses the tiny values (each quantization keeps them within 2^-101 of
    themselves, no closer) and makes the huge group NaN; at ordinary magnitudes (1e-20, 1e7) the
    two give the same bits (the factor commutes with the quantizer)."""
    cfg = ej.EchoConfig(bits=8, transport="xla")
    x = np.asarray(jax.random.normal(jax.random.key(7), (4, 512)), np.float32)
    x = x / np.abs(x).max()
    huge = x * np.float32(2.0 ** 120)
    huge[:, 5] = np.float32(1.5 * 2.0 ** 124)     # the sum of group 0 reaches 1.5 * 2^126

    def scaled_bound(v):
        f = 2.0 ** (9 - np.frexp(np.abs(v.astype(np.float64)).max())[1])
        return error_bound(v * np.float32(f), cfg) / f

    for xs in (x * np.float32(1e-32), x * np.float32(1e-20), x * np.float32(1e7), huge):
        y = np.asarray(run_shard_map(jnp.asarray(xs), cfg, rescale=True), np.float64)
        exact = xs.astype(np.float64).sum(0)
        assert np.isfinite(y).all()
        assert np.all(np.abs(y[0] - exact) <= scaled_bound(xs)), np.abs(xs).max()
        unscaled = np.asarray(run_shard_map(jnp.asarray(xs), cfg))
        if xs is huge:
            assert np.isnan(unscaled[:, :128]).all() and np.isfinite(unscaled[:, 128:]).all()
        elif np.abs(xs).max() < 2.0 ** -101:
            err = np.abs(unscaled[0].astype(np.float64) - exact)
            assert np.all(err <= 4 * 2.0 ** -101)
            assert np.linalg.norm(y[0] - exact) < 0.1 * np.linalg.norm(err)
        else:
            np.testing.assert_array_equal(unscaled, y.astype(np.float32))


def test_non_finite_input_poisons_only_its_groups():
    x = np.ones((4, 1024), np.float32)
    x[2, 700] = np.nan
    y = np.asarray(run_shard_map(jnp.asarray(x), ej.EchoConfig(bits=4, transport="xla")))
    assert np.all(np.isnan(y[:, 640:768]))
    assert np.all(np.isfinite(y[:, :640])) and np.all(np.isfinite(y[:, 768:]))


def test_kill_switch_and_unavailable_p2p(monkeypatch):
    from echo_jax import collective
    monkeypatch.setenv(collective.FORCE_XLA_ENV, "1")
    assert collective.resolve_transport(ej.EchoConfig(transport="p2p")) == "xla"
    monkeypatch.delenv(collective.FORCE_XLA_ENV)
    # Outside shard_map (here: no mesh at all) the custom call cannot run: a clear error for
    # "p2p", the pure-JAX transport for "auto".
    with pytest.raises(ValueError, match="p2p"):
        collective.resolve_transport(ej.EchoConfig(transport="p2p"), "tp")
    assert collective.resolve_transport(ej.EchoConfig(transport="auto"), "tp") == "xla"


# --------------------------------------------------------------------------------------------
# Size gate (EchoConfig.min_bytes): small messages go to lax.psum


def _psum_shard_map(x):
    mesh = make_mesh((x.shape[0],), ("tp",))
    f = jax.jit(jax.shard_map(lambda v: lax.psum(v[0], "tp")[None], mesh=mesh, in_specs=P("tp"),
                              out_specs=P("tp"), check_vma=False))
    return f(put(x, mesh, P("tp")))


@pytest.mark.grid("float32-xla", "bfloat16-p2p")
@pytest.mark.parametrize("transport", ["xla", "p2p"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_size_gate_below_threshold_is_psum_bit_for_bit(transport, dtype):
    from echo_jax.transports import cpu
    if transport == "p2p" and "cpu" not in cpu.available_platforms():
        pytest.skip("the CPU custom call is not built")
    x = jax.random.normal(jax.random.key(8), (4, 3, 100)).astype(dtype)
    nbytes = 300 * jnp.dtype(dtype).itemsize
    gated = ej.EchoConfig(bits=4, transport=transport, min_bytes=nbytes + 1)
    y = run_shard_map(x, gated)
    ref = _psum_shard_map(x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(ref))
    # Under vmap psum is a local reduction (its bf16 rounding differs from the all-reduce's).
    vref = jax.vmap(lambda v: lax.psum(v, "tp"), axis_name="tp")(x)
    np.testing.assert_array_equal(np.asarray(run_vmap(x, gated)), np.asarray(vref))
    # At the threshold the Echo all-reduce runs (4-bit: not the exact sum).
    echo = run_shard_map(x, gated.replace(min_bytes=nbytes))
    np.testing.assert_array_equal(np.asarray(echo),
                                  np.asarray(run_shard_map(x, gated.replace(min_bytes=0))))
    assert not np.array_equal(np.asarray(echo), np.asarray(ref))


def test_size_gate_passes_the_state_through():
    cfg = ej.EchoConfig(bits=4, transport="xla", min_bytes=1 << 20)
    x = jax.random.normal(jax.random.key(9), (4, 256))
    st = ej.CompensatorState(0.1 * x, -0.2 * x)
    y, m1, m2 = run_shard_map(x, cfg, st)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(_psum_shard_map(x)))
    np.testing.assert_array_equal(np.asarray(m1), np.asarray(st.m1))
    np.testing.assert_array_equal(np.asarray(m2), np.asarray(st.m2))
    yv, sv = run_vmap(x, cfg, st)
    np.testing.assert_array_equal(np.asarray(yv), np.asarray(y))
    np.testing.assert_array_equal(np.asarray(sv.m1), np.asarray(st.m1))


def test_size_gate_decides_per_pytree_leaf():
    cfg = ej.EchoConfig(bits=4, transport="xla", min_bytes=4 * 64)
    tree = {"small": jax.random.normal(jax.random.key(10), (4, 63)),
            "big": jax.random.normal(jax.random.key(11), (4, 640))}
    y = jax.jit(jax.vmap(lambda t: ej.echo_psum(t, "tp", config=cfg), axis_name="tp"))(tree)
    exact = jax.vmap(lambda t: lax.psum(t, "tp"), axis_name="tp")(tree)
    np.testing.assert_array_equal(np.asarray(y["small"]), np.asarray(exact["small"]))
    ungated = jax.vmap(lambda t: ej.echo_psum(t, "tp", config=cfg.replace(min_bytes=0)),
                       axis_name="tp")(tree)
    np.testing.assert_array_equal(np.asarray(y["big"]), np.asarray(ungated["big"]))
    assert not np.array_equal(np.asarray(y["big"]), np.asarray(exact["big"]))


def test_size_gate_under_jit_grad_scan_and_typed_shard_map():
    cfg = ej.EchoConfig(bits=4, transport="xla", min_bytes=1 << 20)

    def stack(x, reduce):
        def site(carry, w):
            h, s = carry
            y, s = reduce(jnp.tanh(h * w), s)
            return (h + y / 4, s), jnp.linalg.norm(y)
        (h, s), _ = lax.scan(site, (x, ej.init_state(x)), jnp.linspace(0.5, 1.5, 5))
        return jnp.sum(h), s

    echo = lambda v, s: ej.echo_psum(v, "tp", config=cfg, state=s)  # noqa: E731
    exact = lambda v, s: (lax.psum(v, "tp"), s)  # noqa: E731
    x = jax.random.normal(jax.random.key(12), (4, 32))
    grad = lambda r: jax.jit(jax.vmap(jax.grad(lambda v: stack(v, r)[0]),  # noqa: E731
                                      axis_name="tp"))(x)
    np.testing.assert_array_equal(np.asarray(grad(echo)), np.asarray(grad(exact)))
    # Typed shard_map: the gated result is invariant like psum's (out_specs P()).
    mesh = make_mesh((4,), ("tp",))
    f = jax.jit(jax.shard_map(lambda v: ej.echo_psum(v[0], "tp", config=cfg), mesh=mesh,
                              in_specs=P("tp"), out_specs=P()))
    hlo = f.lower(put(x, mesh, P("tp"))).compile().as_text()
    assert "all-to-all" not in hlo and "custom-call" not in hlo
    np.testing.assert_array_equal(np.asarray(f(put(x, mesh, P("tp")))),
                                  np.asarray(_psum_shard_map(x))[0])


def test_outlier_token_error_bound_zero_aware():
    """Massive-activation case: P = 3 contributions [512, 576] of N(0, 1), one channel x20 on every
    rank and +300 at one element of token 0 on rank 0; 4-bit g = 128 asym, transport "xla" (vmap).

    Derived bound, per element k of owner o's segment (NumPy float64, from the data alone):
      push:   b1_k = sum_{i != o} e(x_{i,k})    (the owner's own copy is not quantized)
      reduce: b2_k = e(S_k) with |S_k| <= |y_k| + b1_k, S's range within y's range widened by b1
    where e(v) = min(s/2, |v|) in a group with lo < 0 < hi (zero is a grid point under the
    zero-aware policy, Sec. 4.3) and s/2 otherwise, s <= Eq. 9's scale rounded up to bf16.
    The naive zero-point sends the near-zero values of the outlier's group to about its minimum,
    which breaks the |v| part of the bound (error norm of token 0: ~215 before the fix, ~49 after).
    """
    nr, tokens, dim, g = 3, 512, 576, 128
    rng = np.random.default_rng(0)
    x = rng.standard_normal((nr, tokens, dim)).astype(np.float32)
    x[:, :, 37] *= 20.0
    x[0, 0, 5] += 300.0
    cfg = ej.EchoConfig(bits=4, group_size=g, policy="asym", transport="xla")
    y = np.asarray(run_vmap(jnp.asarray(x), cfg))
    assert all(np.array_equal(y[0], y[r]) for r in range(nr))
    exact = x.astype(np.float64).sum(0)
    err = np.abs(y[0].astype(np.float64) - exact)

    # Wire layout: flattened, P segments of whole groups (no padding here), segment o owned by o.
    seg = tokens * dim // nr
    groups = x.reshape(nr, nr, seg // g, g)                          # [rank, owner, group, g]
    e1 = element_error_bound(groups, 4, "asym")                      # per rank's copy
    own = np.arange(nr)[:, None, None, None] == np.arange(nr)[None, :, None, None]
    b1 = np.where(own, 0.0, e1).sum(0)                               # [owner, group, g]
    ysum = exact.reshape(nr, seg // g, g)
    lo_s, hi_s = (ysum - b1).min(-1), (ysum + b1).max(-1)
    s2 = max_scale(np.stack([lo_s, hi_s], -1), 4, "asym")            # range of S at most this
    surely_straddles = ((ysum + b1).min(-1) < 0) & ((ysum - b1).max(-1) > 0)
    b2 = np.where(surely_straddles[..., None], np.minimum(0.5 * s2[..., None], np.abs(ysum) + b1),
                  0.5 * s2[..., None])
    bound = (b1 + b2 + 1e-5 * (1 + np.abs(ysum))).reshape(tokens, dim)
    assert np.all(err <= bound), float(np.max(err - bound))
    # Token 0 (the outlier's token) against the bound's own norm, and against the median token.
    norm0 = np.linalg.norm(err[0])
    assert norm0 <= np.linalg.norm(bound[0])
    assert norm0 < 80.0, norm0                 # the naive-map behaviour gave ~215
    med = np.median(np.linalg.norm(err, axis=1))
    assert 5.0 < med < 20.0, med
