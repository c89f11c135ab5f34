"""The compensator (Algorithm 1, Eqs. 4, 10, 11) and the source bound of Theorem 1."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import echo_jax as ej
from np_reference import coefficients, element_error_bound


def vmapped(cfg):
    return jax.jit(jax.vmap(lambda v, s: ej.echo_psum(v, "tp", config=cfg, state=s),
                            axis_name="tp"))


def nonzero_state(x, seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return ej.CompensatorState(0.05 * jax.random.normal(k1, x.shape),
                               0.05 * jax.random.normal(k2, x.shape))


@pytest.mark.parametrize("nranks", [3, 4])
def test_state_update_is_eq_11_exactly(nranks):
    # The coefficients come from the config's fields (np_reference), not from the code's
    # Coefficients: a wrong beta there would otherwise be its own reference.
    cfg = ej.EchoConfig(bits=4, transport="xla")
    x = jax.random.normal(jax.random.key(1), (nranks, 777))
    st = nonzero_state(x)
    y, new = vmapped(cfg)(x, st)
    ea, eb, b1, c1, b2, c2 = coefficients(cfg)
    f32 = np.float32
    xn, m1, m2, yn = (np.asarray(a, f32) for a in (x, st.m1, st.m2, y))
    xp = xn + ((ea * m1).astype(f32) + (eb * m2).astype(f32))              # Eq. 10
    u = xp - (yn * f32(1.0 / nranks)).astype(f32)                        # residual, Sec. 3.3
    np.testing.assert_array_equal(np.asarray(new.m1), (b1 * m1).astype(f32) + (c1 * u).astype(f32))
    np.testing.assert_array_equal(np.asarray(new.m2), (b2 * m2).astype(f32) + (c2 * u).astype(f32))


def test_residuals_sum_to_minus_delta():
    """Eq. 4 on the residuals the code stored: u_i is recovered from the returned state
    (m_new = beta m + (1 - beta) u, solved for u in float64 with the config's betas), so a state
    built from anything but x'_i - y / P fails, whatever y is."""
    cfg = ej.EchoConfig(bits=4, transport="xla")
    nranks = 4
    x = jax.random.normal(jax.random.key(2), (nranks, 2048))
    st = nonzero_state(x, 1)
    y, new = vmapped(cfg)(x, st)
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    e, a, b1, b2 = cfg.eta, cfg.blend, cfg.beta1, cfg.beta2
    xp = f64(x) + e * (a * f64(st.m1) + (1 - a) * f64(st.m2))              # Eq. 10, float64
    delta = f64(y[0]) - xp.sum(0)                                         # Eq. 1
    u1 = (f64(new.m1) - b1 * f64(st.m1)) / (1 - b1)                       # Eq. 11 solved for u
    u2 = (f64(new.m2) - b2 * f64(st.m2)) / (1 - b2)
    # fp32 rounding of x' (Eq. 10 in fp32) and of the two products of Eq. 11: a few 1e-7.
    np.testing.assert_allclose(u1.sum(0), -delta, rtol=0, atol=1e-5)     # Eq. 4
    np.testing.assert_allclose(u2.sum(0), -delta, rtol=0, atol=1e-5)
    np.testing.assert_allclose(u1, xp - f64(y) / nranks, rtol=0, atol=3e-6)
    assert np.abs(delta).max() > 1e-2  # the check is not vacuous


@pytest.mark.parametrize("rescale", [False, True])
def test_local_residuals_are_each_ranks_rounding_errors(rescale):
    """EchoConfig.residual="local": the residual recovered from the returned state (Eq. 11 solved
    for u in float64) is, per rank, its own rounding error, and over the ranks it sums to the
    same -delta as the Echo paper's residuals (Eq. 4). Checked from NumPy alone: the segments a
    rank sends err by at most half a step of the group's own scale (np_reference), its owned
    segment by the sum's half step, and every residual is far below the data (the "output"
    residuals x' - y / P are data-scale)."""
    nranks, n, g = 4, 1000, 128   # n: the last group short, one group of padding
    cfg = ej.EchoConfig(bits=4, transport="xla", residual="local")
    scales = np.asarray([[0.5], [1.0], [2.0], [4.0]], np.float32)
    x = jax.random.normal(jax.random.key(5), (nranks, n)) * scales
    st = nonzero_state(x, 2)
    fn = jax.jit(jax.vmap(lambda v, s: ej.echo_psum(v, "tp", config=cfg, state=s,
                                                    rescale=rescale), axis_name="tp"))
    y, new = fn(x, st)
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    e, a, b1, b2 = cfg.eta, cfg.blend, cfg.beta1, cfg.beta2
    xp = f64(x) + e * (a * f64(st.m1) + (1 - a) * f64(st.m2))              # Eq. 10
    delta = f64(y[0]) - xp.sum(0)                                         # Eq. 1
    u1 = (f64(new.m1) - b1 * f64(st.m1)) / (1 - b1)                       # Eq. 11 solved for u
    u2 = (f64(new.m2) - b2 * f64(st.m2)) / (1 - b2)
    np.testing.assert_allclose(u1.sum(0), -delta, rtol=0, atol=2e-5)     # Eq. 4
    np.testing.assert_allclose(u2.sum(0), -delta, rtol=0, atol=2e-5)
    # Per rank and segment: the layout of P segments of whole groups (transports.base).
    per_seg = -(-(-(-n // g)) // nranks)
    padded = np.zeros((nranks, nranks * per_seg * g))
    padded[:, :n] = xp
    groups = padded.reshape(nranks, nranks * per_seg, g)
    sent_bound = element_error_bound(groups, 4, "asym").reshape(nranks, -1)[:, :n]
    seg_of = np.arange(n) // (per_seg * g)
    # The owner's sum: its own x' plus what its peers sent (x' less their push errors).
    owner = seg_of[None, :] == np.arange(nranks)[:, None]
    ysum = np.zeros(nranks * per_seg * g)
    ysum[:n] = xp.sum(0) - np.where(owner, 0.0, u1).sum(0)
    sum_bound = element_error_bound(ysum.reshape(-1, g), 4, "asym").reshape(-1)[:n]
    for r in range(nranks):
        own = seg_of == r
        slack = 1e-5 + 1e-3 * np.abs(xp[r])   # fp32 x' and the update's products
        assert np.all(np.abs(u1[r, ~own]) <= sent_bound[r, ~own] + slack[~own]), r
        assert np.all(np.abs(u1[r, own]) <= sum_bound[own] + 1e-5 * nranks + slack[own]), r
    assert np.abs(u1).max() < 0.25 * np.abs(xp).max()   # error-scale, not data-scale
    assert np.abs(delta).max() > 1e-2                   # not vacuous


def test_eta_zero_equals_uncompensated():
    cfg = ej.EchoConfig(bits=4, eta=0.0, transport="xla")
    x = jax.random.normal(jax.random.key(3), (4, 500))
    y, _ = vmapped(cfg)(x, nonzero_state(x))
    y0 = jax.vmap(lambda v: ej.echo_psum(v, "tp", config=cfg), axis_name="tp")(x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y0))


def mu_w(cfg):
    r = np.arange(2000)
    w = (cfg.blend * (1 - cfg.beta1) * cfg.beta1 ** r
         + (1 - cfg.blend) * (1 - cfg.beta2) * cfg.beta2 ** r)
    return float((r * w).sum())


def chain(cfg, compensated, sites=56, nranks=4, width=4096, seed=0):
    """A 56-site chain of random contributions; returns (||delta_k||, ||rho_k||, ||S_t||)."""
    xs = jax.random.normal(jax.random.key(seed), (sites, nranks, width)) * 0.5 + 0.1

    def site(state, x):
        ea, eb = coefficients(cfg)[:2]    # Eq. 10 from the config's fields
        xp = x + (ea * state.m1 + eb * state.m2) if compensated else x
        if compensated:
            y, state = ej.echo_psum(x, "tp", config=cfg, state=state)
        else:
            y = ej.echo_psum(x, "tp", config=cfg)
        delta = y - lax.psum(xp, "tp")        # error injected by this all-reduce (Eq. 1)
        rho = y - lax.psum(x, "tp")           # net error entering the residual stream (Eq. 5)
        return state, (delta, rho)

    def run(x):
        return lax.scan(site, ej.init_state(x[0]), x)[1]

    delta, rho = jax.jit(jax.vmap(run, in_axes=1, axis_name="tp"))(xs)
    delta, rho = np.asarray(delta[0], np.float64), np.asarray(rho[0], np.float64)
    partial = np.cumsum(rho, axis=0)          # S_t of Eq. 6
    n = lambda a: np.linalg.norm(a, axis=-1)  # noqa: E731
    return n(delta), n(rho), n(partial)


def test_theorem_1_source_bound_at_eta_one():
    cfg = ej.EchoConfig(bits=4, eta=1.0, transport="xla")
    d, _, s = chain(cfg, True)
    bound = (1 + mu_w(cfg)) * d.max()
    assert s.max() <= bound * (1 + 1e-4), (s.max(), bound)


def test_compensation_suppresses_accumulation_at_default_eta():
    cfg = ej.EchoConfig(bits=4, transport="xla")
    _, _, s_comp = chain(cfg, True)
    d_none, _, s_none = chain(cfg, False)
    # Uncompensated partial sums grow with depth (~sqrt(N) for independent errors, up to N);
    # compensated ones stay at a few single-site errors.
    assert s_none[-1] > 3 * d_none.mean()
    assert s_comp.max() < 0.5 * s_none.max(), (s_comp.max(), s_none.max())


def test_state_shape_dtype_and_reset():
    x = jnp.ones((3, 5), jnp.bfloat16)
    st = ej.init_state(x)
    assert st.m1.shape == (3, 5) and st.m1.dtype == jnp.float32
    assert not np.any(np.asarray(st.m1)) and not np.any(np.asarray(st.m2))
    assert isinstance(st, tuple) and st._fields == ("m1", "m2")
    assert jax.tree.leaves(st)[0].shape == (3, 5)
