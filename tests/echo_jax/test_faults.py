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
from np_reference import allreduce_error_bound

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


# ------------------------------------------------------------------- magnitudes and rescaling

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


def _scaled_bound(x):
    """Eq. 1's bound (np_reference.allreduce_error_bound, 4-bit asym, g = 128) on |sum - exact|
    for contributions x [P, n] of any magnitude: computed on x times the power of two that puts
    max |x| in [256, 512) (exact) and scaled back, so that the bound's absolute slack is meant
    for values of that size. Valid while no group's step meets the wire format's 2^-100 floor
    (the format is scale invariant above it)."""
    x = np.asarray(x, np.float32)
    f = 2.0 ** (9 - np.frexp(np.abs(x.astype(np.float64)).max())[1])
    return allreduce_error_bound(x * np.float32(f), 4, 128, "asym") / f


@pytest.mark.grid("float32-False-xla", "bfloat16-True-p2p")
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("compensated", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_default_keeps_tiny_and_huge_contributions(transport, compensated, dtype):
    # echo_psum's default (rescale="auto": no rescaling) sends every finite contribution as it
    # is: the group scales are bf16 (fp32's exponent range). N(0, 1) contributions times 1e-28
    # (steps near 2^-94, above the 2^-100 floor) up to 1e30, and with each rank's max |x| just
    # below 2^126 / P (one element 0.9 * 2^124 on every rank: a sum of 0.9 * 2^126, just below
    # the 2^126 limit), come back finite, with rescale=False's bits, within Eq. 1's bound of
    # the float64 sum (a zero state adds nothing) and at the 4-bit relative error. The sum of
    # x * 2^k is the sum of x times 2^k, bit for bit, and so is the state: the unscaled call
    # is power-of-two equivariant (bf16 rounding is scale invariant), so no rescaling is needed.
    x = np.asarray(jax.random.normal(jax.random.key(3), (4, 1000)), np.float32)
    y1, m1 = _psum_each(jnp.asarray(x), transport, None, compensated, dtype)
    for k in (-60, 60):
        yk, mk = _psum_each(jnp.asarray(x * np.float32(2.0 ** k)), transport, None, compensated,
                            dtype)
        np.testing.assert_array_equal(_bits(yk), _bits((y1.astype(np.float64) * 2.0 ** k)
                                                       .astype(y1.dtype)), err_msg=f"2^{k}")
        if compensated:
            np.testing.assert_array_equal(mk, m1 * np.float32(2.0 ** k), err_msg=f"m1 2^{k}")
    top = x / np.abs(x).max() * np.float32(0.9 * 2.0 ** 124)
    top[:, 3] = np.float32(0.9 * 2.0 ** 124)
    cases = [(x * np.float32(scale)).astype(np.float32) for scale in (1e-28, 1e-8, 1.0, 1e30)]
    for xs in cases + [top]:
        xs = np.asarray(jnp.asarray(xs).astype(dtype), np.float32)     # what the ranks send
        y, _ = _psum_each(jnp.asarray(xs), transport, None, compensated, dtype)
        y_false, _ = _psum_each(jnp.asarray(xs), transport, False, compensated, dtype)
        what = f"max |x| {np.abs(xs).max():.3g}"
        np.testing.assert_array_equal(_bits(y), _bits(y_false), err_msg=what)
        y = y.astype(np.float64)
        assert np.isfinite(y).all(), what
        exact = xs.astype(np.float64).sum(0)
        # A bfloat16 sum is the fp32 sum rounded: half an ulp more, 2^-8 |y| at most.
        slack = np.abs(y[0]) * 2.0 ** -8 if dtype == jnp.bfloat16 else 0.0
        err = np.abs(y[0] - exact)
        assert np.all(err <= _scaled_bound(xs) + slack), (what, float(err.max()))
        rel = np.linalg.norm(y[0] - exact) / np.linalg.norm(exact)
        assert rel < 0.16, (what, rel)  # 4-bit asym, g = 128, P = 4: 0.138 at scale 1
    assert np.abs(top.astype(np.float64).sum(0)).max() > 0.89 * 2.0 ** 126


@pytest.mark.grid("p2p")
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_rescale_modes_differ_only_at_the_format_limits(transport):
    # rescale="auto" is rescale=False, bit for bit. rescale=True multiplies by a power of two
    # (max |x| into [256, 512)) and divides after; that commutes with the quantizer, so it gives
    # rescale=False's bits for ordinary data (max |x| from 2^-80 to 2^100, plain and
    # compensated). The modes differ where a group meets the wire format's limits:
    # - a sum reaching 2^126 (every rank sends 1.5 * 2^124 at one element, in range: a sum of
    #   1.5 * 2^126): unscaled, its group of g values is NaN on every rank (never finite
    #   garbage) and every other group is finite; True brings it into range: finite, within
    #   Eq. 1's bound;
    # - values below the 2^-100 scale floor (max |x| = 2^-105): unscaled, each of the P
    #   quantizations a value meets (P - 1 pushed copies, the sum) keeps it within 2^-101 of
    #   itself, so within P * 2^-101 of the float64 sum, their precision lost; True keeps it,
    #   within Eq. 1's bound.
    x = np.asarray(jax.random.normal(jax.random.key(4), (4, 512)), np.float32)
    x = x / np.abs(x).max()
    for a in (2.0 ** -80, 2.0 ** 100):
        xs = jnp.asarray(x * np.float32(a))
        for compensated in (False, True):
            auto, _ = _psum_each(xs, transport, "auto", compensated)
            off, m_off = _psum_each(xs, transport, False, compensated)
            on, m_on = _psum_each(xs, transport, True, compensated)
            np.testing.assert_array_equal(_bits(auto), _bits(off), err_msg=f"auto, max {a}")
            np.testing.assert_array_equal(_bits(on), _bits(off), err_msg=f"True, max {a}")
            if compensated:
                np.testing.assert_array_equal(_bits(m_on), _bits(m_off), err_msg=f"m1 {a}")
    huge = x * np.float32(2.0 ** 120)
    huge[:, 7] = np.float32(1.5 * 2.0 ** 124)                      # group 0 of the sum
    for rescale in ("auto", False):
        y, _ = _psum_each(jnp.asarray(huge), transport, rescale, False)
        assert np.isnan(y[:, :128]).all() and np.isfinite(y[:, 128:]).all(), rescale
    y, _ = _psum_each(jnp.asarray(huge), transport, True, False)
    exact = huge.astype(np.float64).sum(0)
    assert np.isfinite(y).all() and exact[7] >= 2.0 ** 126
    assert np.all(np.abs(y[0] - exact) <= _scaled_bound(huge))
    tiny = x * np.float32(2.0 ** -105)
    exact = tiny.astype(np.float64).sum(0)
    off, _ = _psum_each(jnp.asarray(tiny), transport, False, False)
    on, _ = _psum_each(jnp.asarray(tiny), transport, True, False)
    err_off, err_on = (np.abs(v[0].astype(np.float64) - exact) for v in (off, on))
    assert np.all(err_off <= 4 * 2.0 ** -101)
    assert np.all(err_on <= _scaled_bound(tiny))
    assert np.linalg.norm(err_on) < 0.2 * np.linalg.norm(err_off), (err_on.max(), err_off.max())


@pytest.mark.grid("True", "auto")
@pytest.mark.parametrize("rescale", [True, "auto", False])
def test_compensated_call_stays_fused_with_every_rescale(rescale):
    # rescale=True's factor is an operand of the fused call: the rescaling does not unfuse the
    # compensator; its max |x| is one scalar pmax (an all-reduce of f32[]). "auto" and False
    # take no factor: no all-reduce and no max in the program, only the fused call.
    cfg = ej.EchoConfig(transport="p2p")
    f = shard_map_call(lambda v: ej.echo_psum(v[0], "tp", config=cfg, state=ej.init_state(v[0]),
                                              rescale=rescale)[0][None],
                       out_specs=P("tp"))
    hlo = f.lower(jnp.ones((4, 1024))).compile().as_text()
    assert cpu.TARGET_COMPENSATED in hlo
    reduces = [ln for ln in hlo.splitlines() if re.search(r"all-reduce\(", ln)]
    if rescale is True:
        assert len(reduces) == 1 and "f32[] " in reduces[0], reduces
        assert "maximum(" in hlo
    else:
        assert not reduces and "maximum(" not in hlo, reduces


@pytest.mark.parametrize("rescale", ["yes", 1, None, "AUTO"])
def test_bad_rescale_is_rejected_naming_it(rescale):
    f = shard_map_call(lambda v: ej.echo_psum(v[0], "tp", rescale=rescale)[None],
                       out_specs=P("tp"))
    with pytest.raises(ValueError, match=re.escape(f"rescale must be True, False or 'auto', "
                                                   f"got {rescale!r}")):
        f(jnp.ones((4, 256)))
