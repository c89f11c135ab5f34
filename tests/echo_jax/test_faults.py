"""Bad input, transforms and faults: what echo_psum does when things go wrong (docs/design.md,
"Failure behaviour"). Each test here failed on the code before its fix, or pins a behaviour a
sweep of bad configs, inputs and transforms found correct and that no other test held."""

import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import echo_jax as ej
from echo_jax import transports
from echo_jax.transports import explicit
from echo_jax.transports import cpu
from echo_jax.transports.base import TIMEOUT_ENV
from conftest import make_mesh

TRANSPORTS = ("xla", "p2p")


def shard_map_call(fn, nranks=4, out_specs=P()):
    mesh = make_mesh((nranks,), ("tp",))
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("tp"), out_specs=out_specs))


# ---------------------------------------------------------------------------------- transforms

@pytest.mark.grid("none-xla", "hadamard-p2p")
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("rotation", ["none", "hadamard"])
def test_grad_and_jvp_with_rescale(transport, rotation):
    # rescale=True takes its power of two from a pmax, which has no differentiation rule: the
    # factor must be a constant of the derivative. The derivative is psum's (straight-through),
    # so the reference is jax.grad of the same loss with lax.psum.
    nranks = 4
    cfg = ej.EchoConfig(transport=transport, rotation=rotation)

    def loss(v):
        return jnp.sum(ej.echo_psum(v, "tp", config=cfg, rescale=True) * jnp.arange(512.0))

    def exact_loss(v):
        return jnp.sum(jax.lax.psum(v, "tp") * jnp.arange(512.0))

    x = jnp.ones((nranks * 512,), jnp.float32)
    g = shard_map_call(jax.grad(loss), nranks, out_specs=P("tp"))(x)
    ref = shard_map_call(jax.grad(exact_loss), nranks, out_specs=P("tp"))(x)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(ref))
    assert np.any(np.asarray(ref) != 0)

    def fwd(v):
        return jax.jvp(lambda u: ej.echo_psum(u, "tp", config=cfg, rescale=True), (v,),
                       (jnp.full_like(v, 0.5),))[1]

    t = shard_map_call(fwd, nranks)(x)
    np.testing.assert_array_equal(np.asarray(t), np.full((512,), 0.5 * nranks, np.float32))


@pytest.mark.grid("False-none-xla", "True-hadamard-p2p")
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("rotation", ["none", "hadamard"])
@pytest.mark.parametrize("rescale", [False, True])
def test_state_carries_no_derivative_on_every_path(transport, rotation, rescale):
    # The returned state is feedback for the next call, not a function of x to differentiate:
    # d sum(new_state.m1) / dx is 0 whether the update runs fused in the custom call (p2p,
    # unrotated, no rescale) or in JAX around the transport (every other path). Before, the xla
    # path gave 1 - beta1 = 0.3 per element and the fused call 0.
    nranks = 4
    cfg = ej.EchoConfig(transport=transport, rotation=rotation)

    def state_loss(v):
        _, s = ej.echo_psum(v, "tp", config=cfg, state=ej.init_state(v), rescale=rescale)
        return jnp.sum(s.m1) + jnp.sum(s.m2)

    def out_loss(v):
        y, _ = ej.echo_psum(v, "tp", config=cfg, state=ej.init_state(v), rescale=rescale)
        return jnp.sum(y)

    x = jax.random.normal(jax.random.key(0), (nranks * 256,))
    gs = shard_map_call(jax.grad(state_loss), nranks, out_specs=P("tp"))(x)
    np.testing.assert_array_equal(np.asarray(gs), 0.0)
    gy = shard_map_call(jax.grad(out_loss), nranks, out_specs=P("tp"))(x)
    ref = shard_map_call(jax.grad(lambda v: jnp.sum(jax.lax.psum(v, "tp"))), nranks,
                         out_specs=P("tp"))(x)
    np.testing.assert_array_equal(np.asarray(gy), np.asarray(ref))


# --------------------------------------------------------------------------- transport choice

@pytest.mark.parametrize("cfg, n", [
    (ej.EchoConfig(group_size=1 << 17, transport="auto"), 1 << 18),   # group above 65536
])
def test_auto_falls_back_where_the_custom_call_cannot_run(cfg, n):
    # "auto" checks every limit the custom call enforces before choosing it
    # (transports.limit_reason), so whatever "xla" runs, "auto" runs too, with the same bits.
    nranks = 4
    x = jax.random.normal(jax.random.key(1), (nranks * n,))
    auto = shard_map_call(lambda v: ej.echo_psum(v, "tp", config=cfg), nranks)(x)
    xla = shard_map_call(lambda v: ej.echo_psum(v, "tp", config=cfg.replace(transport="xla")),
                         nranks)(x)
    np.testing.assert_array_equal(np.asarray(auto), np.asarray(xla))
    with pytest.raises(ValueError, match="group_size=131072 exceeds"):
        shard_map_call(lambda v: ej.echo_psum(v, "tp", config=cfg.replace(transport="p2p")),
                       nranks)(x)


def test_limit_reason_is_the_one_list_of_limits():
    cfg = ej.EchoConfig()
    assert transports.limit_reason(cfg, 1000, 4) is None
    assert "group_size" in transports.limit_reason(cfg.replace(group_size=1 << 17), 1000, 4)
    assert "ranks" in transports.limit_reason(cfg, 1000, cpu.MAX_RANKS + 1)
    assert "2^31-1" in transports.limit_reason(cfg, 2 ** 33, 2)


# -------------------------------------------------------------------------------- validation

@pytest.mark.parametrize("field, value, stored", [
    ("bits", 4.0, 4), ("bits", np.int64(8), 8), ("group_size", 128.0, 128),
    ("group_size", np.int64(64), 64), ("group_size", np.int32(32), 32),
    ("eta", np.float32(0.5), 0.5), ("eta", 1, 1.0), ("blend", np.float64(0.25), 0.25),
    ("beta1", np.float32(0.5), 0.5), ("min_bytes", np.int64(4096), 4096), ("min_bytes", 0.0, 0),
])
def test_numpy_and_integral_scalars_are_accepted(field, value, stored):
    cfg = ej.EchoConfig(**{field: value})
    got = getattr(cfg, field)
    assert got == stored and type(got) is type(stored)  # stored as the Python number
    assert cfg == ej.EchoConfig(**{field: stored}) and hash(cfg) == hash(ej.EchoConfig(**{field: stored}))


@pytest.mark.parametrize("field, value", [
    ("bits", 4.5), ("bits", True), ("bits", "4"), ("group_size", 128.5), ("group_size", "128"),
    ("group_size", np.bool_(True)), ("group_size", float("inf")), ("eta", "0.5"),
    ("eta", float("nan")), ("eta", True), ("min_bytes", 1.5), ("beta2", None),
])
def test_bad_scalars_are_rejected_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"EchoConfig.{field} must be"):
        ej.EchoConfig(**{field: value})


@pytest.mark.parametrize("axis_name", [0, np.int64(1), ["tp", "dp"]])
def test_axis_name_must_be_a_name(axis_name):
    f = jax.vmap(lambda v: ej.echo_psum(v, axis_name), axis_name="tp")
    with pytest.raises(ValueError, match="echo_psum: "):
        f(jnp.ones((2, 4)))


# ------------------------------------------------------------------------- non-finite values

@pytest.mark.parametrize("transport", TRANSPORTS)
def test_nan_in_compensated_state_stays_in_its_group_until_reset(transport):
    nranks, g = 4, 128
    cfg = ej.EchoConfig(group_size=g, transport=transport)
    x = jax.random.normal(jax.random.key(2), (nranks, 8 * g))
    m1 = jnp.zeros_like(x).at[1, 3 * g + 5].set(jnp.nan)   # rank 1's state, group 3 of 8

    def step(v, m):
        y, s = ej.echo_psum(v[0], "tp", config=cfg, state=ej.CompensatorState(m[0], m[0] * 0))
        return y, s.m1[None]

    mesh = make_mesh((nranks,), ("tp",))
    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("tp"), P("tp")),
                              out_specs=(P(), P("tp"))))
    y, m = f(x[:, None], m1[:, None])
    y = np.asarray(y).reshape(8, g)
    # The sum is segmented over ranks by groups: only group 3 of the sum sees the NaN.
    assert np.all(np.isnan(y[3])) and np.all(np.isfinite(np.delete(y, 3, axis=0)))
    # The state keeps it in that group (every rank's u = x' - y/P is NaN there) ...
    m = np.asarray(m).reshape(nranks, 8, g)
    assert np.all(np.isnan(m[:, 3])) and np.all(np.isfinite(np.delete(m, 3, axis=1)))
    # ... and a reset (zeros, the start of the next pass) clears it.
    y2, _ = f(x[:, None], jnp.zeros_like(m1)[:, None])
    assert np.all(np.isfinite(np.asarray(y2)))


# ----------------------------------------------------------------------------- a failing rank

def _rank_outcomes(y, mesh):
    """Per rank (device order of the mesh): the error text its shard of y raises, or None."""
    rank_of = {d: r for r, d in enumerate(mesh.devices.flat)}
    outcomes = [None] * len(rank_of)
    for shard in y.addressable_shards:
        try:
            np.asarray(shard.data)
        except jax.errors.JaxRuntimeError as err:
            outcomes[rank_of[shard.device]] = str(err)
    return outcomes


def _p2p_program(mesh, nranks, compensated, calls=3):
    """`calls` all-reduces of one call site in a loop (one execution runs them all)."""
    cfg = ej.EchoConfig(bits=4, transport="p2p")

    def body(v):
        def step(c, _):
            if compensated:
                y, _, _ = explicit.p2p_allreduce_compensated(v + c, v * 0, v * 0, "tp", nranks, cfg)
            else:
                y = explicit.p2p_allreduce(v + c, "tp", nranks, cfg)
            return c + jnp.float32(1), y
        _, ys = jax.lax.scan(step, jnp.float32(0), None, length=calls)
        return jax.lax.pcast(ys[-1], ("tp",), to="varying")

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))


@pytest.mark.parametrize("stage, compensated", [
    ("validate", False), ("push", False), ("tail", False), ("validate", True), ("push", True)])
def test_failing_rank_poisons_its_group(monkeypatch, stage, compensated):
    # Rank 2 fails for a reason it knows (in its validation, before joining its group; in push;
    # after its tail, so that the peers fail at the loop's next call): it tells its peers through
    # the group's join or workspace, and they fail at once naming rank 2 and the cause, not after
    # ECHO_JAX_TIMEOUT_S (30 s here) as for a peer that never arrives.
    nranks, cause = 4, f"deliberate failure in {stage}"
    mesh = make_mesh((nranks,), ("tp",))
    x = jax.device_put(jax.random.normal(jax.random.key(3), (nranks * 1000,)),
                       jax.sharding.NamedSharding(mesh, P("tp")))
    monkeypatch.setenv(TIMEOUT_ENV, "30")
    other = _p2p_program(mesh, nranks, compensated).lower(x).compile()  # another call site
    want = np.asarray(other(x))
    with cpu.debug_failing_rank(2, cause, stage=stage):
        failing = _p2p_program(mesh, nranks, compensated).lower(x).compile()

    for attempt in range(2):  # the next call on the same group fails the same way, at once
        t0 = time.perf_counter()
        outcomes = _rank_outcomes(failing(x), mesh)
        elapsed = time.perf_counter() - t0
        assert elapsed < 1.0, (attempt, elapsed, outcomes)
        assert all(o is not None for o in outcomes), outcomes
        assert cause in outcomes[2], outcomes[2]                  # its own error names the cause
        for r in (0, 1, 3):
            assert re.search(rf"rank 2 of the group failed.*: {cause}", outcomes[r]), outcomes[r]

    # Other call sites of the same devices keep working, and so does a fresh one.
    np.testing.assert_array_equal(np.asarray(other(x)), want)
    fresh = _p2p_program(mesh, nranks, compensated)
    np.testing.assert_array_equal(np.asarray(fresh(x)), want)
    assert cpu.registry_stats()["pending_joins"] == 0


# ---------------------------------------------------------------------------- underflow (item 4)

def _psum_each(x, transport, rescale, compensated, dtype=jnp.float32, **kw):
    """echo_psum over 4 ranks of x [4, n]: (every rank's sum [4, n], m1 [4, n] or None)."""
    cfg = ej.EchoConfig(transport=transport)
    extra = {} if rescale is None else {"rescale": rescale}
    if compensated:
        def body(v):
            y, s = ej.echo_psum(v[0], "tp", config=cfg, state=ej.init_state(v[0]), **extra)
            return y[None], s.m1[None]
        y, m1 = shard_map_call(body, out_specs=(P("tp"), P("tp")))(x.astype(dtype))
        return np.asarray(y), np.asarray(m1)
    y = shard_map_call(lambda v: ej.echo_psum(v[0], "tp", config=cfg, **extra)[None],
                       out_specs=P("tp"))(x.astype(dtype))
    return np.asarray(y), None


def _bits(a):
    a = np.asarray(a)
    return a.view(f"u{a.dtype.itemsize}")


@pytest.mark.grid("float32-False-xla", "bfloat16-True-p2p")
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("compensated", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_default_loses_nothing_to_the_fp16_scale_range(transport, compensated, dtype):
    # Before: rescale=False was the default, and N(0, sigma^2) contributions lost everything at
    # sigma = 1e-30 (exact zeros) and most at 1e-8 (relative error ~1), silently. The default
    # ("auto") now scales up below max |x| = 2^-6: the sum of x * 2^k is the sum of x times 2^k,
    # bit for bit, from 2^-100 up, and the relative error against a float64 sum stays the 4-bit
    # one at any small magnitude (the p2p transport with a state is the fused call, with the
    # factor as its operand). Large magnitudes are scaled down (from auto_rescale_above(P));
    # without the rescaling their groups overflow loudly (NaN).
    x = jax.random.normal(jax.random.key(3), (4, 1000), jnp.float32)
    y1, m1 = _psum_each(x, transport, None, compensated, dtype)
    for k in (-100, -27, -10, 8):
        yk, mk = _psum_each(x * 2.0 ** k, transport, None, compensated, dtype)
        np.testing.assert_array_equal(_bits(yk), _bits((y1.astype(np.float64) * 2.0 ** k)
                                                       .astype(y1.dtype)), err_msg=f"2^{k}")
        if compensated:
            np.testing.assert_array_equal(mk, m1 * np.float32(2.0 ** k), err_msg=f"m1 2^{k}")
    for scale in (1e-30, 1e-8, 1e-4, 1.0, 1e3, 1e7):
        xs = (np.asarray(x, np.float64) * scale).astype(np.float32)
        y, _ = _psum_each(jnp.asarray(xs), transport, None, compensated, dtype)
        exact = np.asarray(jnp.asarray(xs).astype(dtype), np.float64).sum(0)
        rel = np.linalg.norm(y[0].astype(np.float64) - exact) / np.linalg.norm(exact)
        assert rel < 0.16, (scale, rel)  # 4-bit asym, g = 128, P = 4: 0.138 at scale 1
    y, _ = _psum_each(x * 1e7, transport, False, compensated, dtype)
    assert np.isnan(y).all()  # every group's fp16 scale overflows: NaN, never finite garbage


@pytest.mark.grid("p2p")
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_auto_rescale_is_the_unscaled_call_from_its_threshold_up(transport):
    # From AUTO_RESCALE_BELOW up to auto_rescale_above(P) the factor is 1: the default gives
    # rescale=False's bits (the threshold itself included; just below it the call is rescaled).
    # A huge value scales the whole contribution down: its group is finite, where rescale=False
    # makes it NaN.
    lo = ej.collective.AUTO_RESCALE_BELOW
    x = np.asarray(jax.random.normal(jax.random.key(4), (4, 512)), np.float32)
    x = x / np.abs(x).max()
    outlier = x.copy()
    outlier[1, 7] = 3e38
    hi = ej.collective.auto_rescale_above(4)
    for xs in [x * np.float32(a) for a in (lo, 1.0, 300.0, 0.99 * hi)]:
        xs = jnp.asarray(xs)
        for compensated in (False, True):
            a, _ = _psum_each(xs, transport, None, compensated)
            b, _ = _psum_each(xs, transport, False, compensated)
            np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=f"max {np.abs(xs).max()}")
    a, _ = _psum_each(jnp.asarray(outlier), transport, None, False)
    b, _ = _psum_each(jnp.asarray(outlier), transport, False, False)
    assert np.isfinite(a).all()
    assert np.isnan(b[:, :128]).all() and np.isfinite(b[:, 128:]).all()
    # Just below the range: rescaled (different bits from the unscaled call, more accurate).
    xs = jnp.asarray(x * np.float32(lo * 0.75) * np.float32(2.0 ** -24))
    a, _ = _psum_each(xs, transport, None, False)
    b, _ = _psum_each(xs, transport, False, False)
    exact = np.asarray(xs, np.float64).sum(0)
    err = [np.linalg.norm(v[0].astype(np.float64) - exact) for v in (a, b)]
    assert err[0] < 0.5 * err[1], err


def test_rescaled_compensated_call_stays_fused():
    # The factor is an operand of the fused call: rescale does not unfuse the compensator.
    cfg = ej.EchoConfig(transport="p2p")
    for rescale in (True, "auto"):
        f = shard_map_call(lambda v: ej.echo_psum(v[0], "tp", config=cfg,
                                                  state=ej.init_state(v[0]),
                                                  rescale=rescale)[0][None],
                           out_specs=P("tp"))
        hlo = f.lower(jnp.ones((4, 1024))).compile().as_text()
        assert cpu.TARGET_COMPENSATED in hlo, rescale
        assert re.search(r"all-reduce\(", hlo), "the factor's scalar pmax"


@pytest.mark.parametrize("rescale", ["yes", 1, None, "AUTO"])
def test_bad_rescale_is_rejected_naming_it(rescale):
    f = shard_map_call(lambda v: ej.echo_psum(v[0], "tp", rescale=rescale)[None],
                       out_specs=P("tp"))
    with pytest.raises(ValueError, match=re.escape(f"rescale must be True, False or 'auto', "
                                                   f"got {rescale!r}")):
        f(jnp.ones((4, 256)))
