"""echo_psum against lax.psum's contract, one test per row of docs/design.md's "psum contract".

Each test runs `lax.psum` on the same inputs and compares: the result type (`jax.typeof`: shape,
dtype, weak type, varying mesh axes), exact equality where psum's sum is exact (bool, integer
leaves), and for float leaves the Echo error bound of Eq. 1 (`np_reference.allreduce_error_bound`,
from the data alone). Fake CPU devices (tests/conftest.py); one case per code path.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import echo_jax as ej
from echo_jax import _compat, collective
from conftest import make_mesh, put
from np_reference import allreduce_error_bound

XLA = ej.EchoConfig(transport="xla")


def bits(a):
    a = np.asarray(a)
    return a.view(f"u{a.dtype.itemsize}")


def type_of(a):
    """What psum's result type fixes: shape, dtype, weak type and varying mesh axes."""
    t = jax.typeof(a)
    return t.shape, t.dtype, t.weak_type, _compat.varying_axes(a)


def assert_same_type(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert type_of(g) == type_of(w), (jax.typeof(g), jax.typeof(w))


def within_bound(y, x, cfg=XLA):
    """y: a rank's Echo sum of x [P, ...] (per-rank contributions)."""
    x = np.asarray(x, np.float32)
    err = np.abs(np.asarray(y, np.float64) - x.astype(np.float64).sum(0))
    bound = allreduce_error_bound(x, cfg.bits, cfg.group_size, cfg.policy)
    assert (err <= bound).all(), (err.max(), bound.min())


def shard_mapped(body, mesh, nargs=1, out=P("tp"), check_vma=True):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(mesh.axis_names),) * nargs,
                                 out_specs=out, check_vma=check_vma))


# --- several axis names ---------------------------------------------------------------------

def test_tuple_of_axes_is_one_group_with_one_call():
    """psum(x, ("x", "y")) sums over the product group. Echo runs one all-reduce over it, ranks
    in lax.axis_index(("x", "y")) order: the bits of the one-axis call over the same 8 ranks, in
    that order, on the pure-JAX transport and on the CPU custom call alike (so every element is
    quantized at most twice, and both transports agree where both run)."""
    x = jax.random.normal(jax.random.key(0), (8, 1000))
    mesh2 = make_mesh((2, 4), ("x", "y"))
    types = {}

    def body(v):
        y = ej.echo_psum(v[0], ("x", "y"), config=ej.EchoConfig())   # "auto"
        want = lax.psum(v[0], ("x", "y"))
        types["echo"], types["psum"] = jax.typeof(y), jax.typeof(want)
        return y[None], lax.axis_index(("x", "y"))[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh2, in_specs=P(("x", "y")),
                              out_specs=P(("x", "y"))))
    y, order = f(put(x, mesh2, P(("x", "y"))))
    assert types["echo"] == types["psum"]
    np.testing.assert_array_equal(np.asarray(order), np.arange(8))
    within_bound(np.asarray(y)[0], x)
    mesh1 = make_mesh((8,), ("tp",))
    for transport in ("xla", "p2p"):
        cfg = ej.EchoConfig(transport=transport)   # "p2p" raises where the call cannot run
        one = shard_mapped(lambda v, c=cfg: ej.echo_psum(v[0], "tp", config=c)[None], mesh1)
        np.testing.assert_array_equal(bits(one(put(x, mesh1, P("tp")))), bits(y), transport)
    # Nested vmaps over the two names give the same bits (the xla transport's all-gather runs
    # one name at a time there).
    nested = jax.jit(jax.vmap(jax.vmap(lambda v: ej.echo_psum(v, ("x", "y"), config=XLA),
                                       axis_name="y"), axis_name="x"))
    np.testing.assert_array_equal(bits(nested(x.reshape(2, 4, 1000)).reshape(8, 1000)), bits(y))


def test_tuple_of_axes_transport_choice():
    """The custom call reduces over one mesh axis: "auto" runs "xla" over a tuple, and "p2p" is
    an error that names the axes and the fix."""
    mesh2 = make_mesh((2, 2), ("x", "y"))
    seen = {}

    def body(v):
        seen["auto"] = collective.resolve_transport(ej.EchoConfig(), ("x", "y"), 100)
        seen["one"] = collective.resolve_transport(ej.EchoConfig(), ("y",), 100)
        with pytest.raises(ValueError, match=r"\('x', 'y'\).*transport='auto' or 'xla'"):
            collective.resolve_transport(ej.EchoConfig(transport="p2p"), ("x", "y"))
        with pytest.raises(ValueError, match=r"one mesh axis.*\('x', 'y'\)"):
            ej.echo_psum(v, ("x", "y"), config=ej.EchoConfig(transport="p2p"))
        with pytest.raises(ValueError, match="names an axis twice"):
            ej.echo_psum(v, ("x", "x"))
        return v

    jax.jit(jax.shard_map(body, mesh=mesh2, in_specs=P(("x", "y")),
                          out_specs=P(("x", "y"))))(jnp.ones((4, 100)))
    assert seen == {"auto": "xla", "one": "p2p"}


# --- bool and integer leaves ----------------------------------------------------------------

def test_integer_and_bool_leaves_are_summed_exactly():
    """psum(1, axis) (the axis-size idiom), psum(axis_index), counts, bools (-> int32) and a
    pytree mixing int and float leaves: the int leaves exactly psum's, typed like psum's, under
    shard_map and vmap; the float leaf through Echo. A state mirrors x with None at int leaves."""
    x = jax.random.normal(jax.random.key(1), (4, 300))
    counts = jnp.arange(4 * 3, dtype=jnp.int32).reshape(4, 3)

    def both(reduce):
        def body(v, c):
            i = lax.axis_index("tp")
            return (reduce(1), reduce(i), reduce(c), reduce(c > 4), reduce(v > 0),
                    reduce({"f": v, "n": c, "b": c > 4}))
        return body

    echo = both(lambda t: ej.echo_psum(t, "tp", config=XLA))
    psum = both(lambda t: lax.psum(t, "tp"))
    mesh = make_mesh((4,), ("tp",))
    for name, run in (("vmap", lambda b: jax.jit(jax.vmap(b, axis_name="tp"))(x, counts)),
                      ("shard_map", lambda b: jax.jit(jax.shard_map(
                          lambda v, c: jax.tree.map(lambda a: jnp.asarray(a)[None],
                                                    b(v[0], c[0])),
                          mesh=mesh, in_specs=(P("tp"), P("tp")), out_specs=P("tp")))(
                              put(x, mesh, P("tp")), put(counts, mesh, P("tp"))))):
        got, want = run(echo), run(psum)
        assert_same_type(got, want)
        *ints, tree = got
        for g, w in zip(ints + [tree["n"], tree["b"]], list(want[:-1]) + [want[-1]["n"],
                                                                          want[-1]["b"]]):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), name)
        assert np.asarray(got[0]).ravel()[0] == 4 and jnp.result_type(got[3]) == jnp.int32
        within_bound(np.asarray(tree["f"])[0], x)

    def compensated(v, c):
        tree = {"f": v, "n": c}
        state = ej.init_state(tree)
        assert state["n"] is None and isinstance(state["f"], ej.CompensatorState)
        y, new = ej.echo_psum(tree, "tp", config=XLA, state=state)
        assert new["n"] is None
        return y["n"], new["f"].m1

    n, m1 = jax.jit(jax.vmap(compensated, axis_name="tp"))(x, counts)
    np.testing.assert_array_equal(np.asarray(n[0]), np.asarray(counts).sum(0))
    assert np.abs(np.asarray(m1)).max() > 0
    with pytest.raises(ValueError, match="int32 leaf is summed exactly and takes no"):
        jax.vmap(lambda c: ej.echo_psum(c, "tp", state=ej.init_state(jnp.ones(3))),
                 axis_name="tp")(counts)


# --- unbatched values under vmap, Python scalars, weak types ---------------------------------

def test_unbatched_values_under_vmap_count_once_per_rank():
    """psum of a value not batched along the vmap axis (in_axes=None, a closed-over constant,
    a Python scalar) is P * x: Echo's sum of P equal contributions, typed like psum's."""
    x = jax.random.normal(jax.random.key(2), (4, 200))
    const = jax.random.normal(jax.random.key(3), (200,))

    def body(reduce):
        return lambda v, u: (reduce(u), reduce(const), reduce(0.5), reduce(v))

    echo = jax.jit(jax.vmap(body(lambda t: ej.echo_psum(t, "tp", config=XLA)),
                            in_axes=(0, None), axis_name="tp"))(x, const)
    want = jax.jit(jax.vmap(body(lambda t: lax.psum(t, "tp")), in_axes=(0, None),
                            axis_name="tp"))(x, const)
    assert_same_type(echo, want)
    same = np.broadcast_to(np.asarray(const), (4, 200))
    for y in echo[:2]:
        assert np.asarray(y).shape == (4, 200)
        within_bound(np.asarray(y)[0], same)
    np.testing.assert_allclose(np.asarray(echo[2]), 2.0, rtol=2 ** -8)
    within_bound(np.asarray(echo[3])[0], x)
    # Compensated, with an unbatched contribution and state.
    y, s = jax.jit(jax.vmap(lambda u: ej.echo_psum(u, "tp", config=XLA,
                                                  state=ej.init_state(u)),
                            in_axes=None, axis_size=4, axis_name="tp"))(const)
    np.testing.assert_array_equal(bits(y), bits(echo[0]))
    assert s.m1.shape == (4, 200)


def test_python_float_keeps_its_weak_type():
    """lax.psum(1.0, axis) is weakly typed, so is echo_psum's, inside shard_map and vmap; it
    then adds to a bfloat16 value without promoting it."""
    mesh = make_mesh((4,), ("tp",))
    types = {}

    def body(v):
        types["echo"] = type_of(ej.echo_psum(2.5, "tp", config=XLA))
        types["psum"] = type_of(lax.psum(2.5, "tp"))
        return (v + ej.echo_psum(2.5, "tp", config=XLA))[None]

    out = jax.jit(jax.shard_map(lambda v: body(v[0]), mesh=mesh, in_specs=P("tp"),
                                out_specs=P("tp")))(put(jnp.ones((4, 3), jnp.bfloat16), mesh,
                                                        P("tp")))
    assert types["echo"] == types["psum"] and types["echo"][2]
    assert out.dtype == jnp.bfloat16
    y = jax.vmap(lambda v: ej.echo_psum(2.5, "tp", config=XLA), axis_name="tp")(jnp.ones(4))
    assert jax.typeof(y).weak_type and np.allclose(np.asarray(y), 10.0, rtol=2 ** -8)


def test_no_axes_returns_x_as_psum_does():
    """psum over an empty tuple of axes is the identity: so is echo_psum's, for every leaf."""
    x = {"f": jnp.linspace(-1.0, 1.0, 7, dtype=jnp.float32), "i": jnp.arange(3)}
    got = jax.jit(lambda t: ej.echo_psum(t, ()))(x)
    want = jax.jit(lambda t: lax.psum(t, ()))(x)
    assert_same_type(got, want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(bits(g), bits(w))


# --- refused: axis_index_groups, complex, unreduced / reduced --------------------------------

def test_axis_index_groups_and_complex_are_refused_with_the_fix():
    f = jax.vmap(lambda v: ej.echo_psum(v, "tp", axis_index_groups=[[0, 1], [2, 3]]),
                 axis_name="tp")
    with pytest.raises(ValueError, match="axis_index_groups.*one axis per group.*lax.psum"):
        f(jnp.ones((4, 8)))
    y = jax.vmap(lambda v: ej.echo_psum(v, "tp", config=XLA, axis_index_groups=None),
                 axis_name="tp")(jnp.ones((4, 8)))
    assert y.shape == (4, 8)
    g = jax.vmap(lambda v: ej.echo_psum(v, "tp"), axis_name="tp")
    with pytest.raises(ValueError, match=r"complex64 is not supported.*lax\.psum.*x\.real"):
        g(jnp.ones((4, 8), jnp.complex64))
    with pytest.raises(ValueError, match="complex64"):
        ej.init_state(jnp.ones(3, jnp.complex64))


@pytest.mark.skipif(not hasattr(jax.sharding, "AxisType"), reason="no explicit sharding")
def test_unreduced_and_reduced_inputs_are_refused_naming_the_type_and_fix():
    """psum sums an input typed unreduced over its axis (the deferred sum of an explicit
    sharding); Echo quantizes per-rank contributions, which must be varying, and JAX has no
    cast from unreduced to varying: the error names the type ({U:x}) and the fix. A value typed
    reduced over another axis works after the cast the message names."""
    explicit = (jax.sharding.AxisType.Explicit,) * 2
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y"),
                             axis_types=explicit)
    errors = {}

    def body(v):
        u = lax.pcast(v, "x", to="unreduced")
        want = lax.psum(u, "x")
        with pytest.raises(ValueError, match=r"unreduced over the reduced axes \['x'\].*\{U:x\}"
                                             r".*varying.*lax\.psum") as err:
            ej.echo_psum(u, "x", config=XLA)
        errors["unreduced"] = str(err.value)
        r = lax.pcast(v, "y", to="reduced")
        with pytest.raises(ValueError, match=r"reduced over mesh axes \[.y.\].*R:y.*pcast"):
            ej.echo_psum(r, "x", config=XLA)
        y = ej.echo_psum(lax.pcast(r, ("y",), to="varying"), "x", config=XLA)  # the fix
        return want, y

    x = jax.device_put(jnp.ones((4, 8)), jax.sharding.NamedSharding(mesh, P("x")))
    with jax.set_mesh(mesh):
        want, y = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"),
                                        out_specs=(P(), P(None, "y"))))(x)
    assert "unreduced" in errors
    np.testing.assert_allclose(np.asarray(y), 2.0, rtol=2 ** -6)


# --- non-finite and huge values --------------------------------------------------------------

def test_no_group_turns_nan_below_the_range_limit():
    """The default (rescale="auto": no rescaling) sends any finite contribution as it is (bf16
    group scales: fp32's exponent range): the sum of x * 2^j is the sum of x times 2^j, bit for
    bit (the format is power-of-two equivariant above its 2^-100 scale floor), finite and
    within Eq. 1's bound, for max |x| from 2^-76 to 2^123 (every sum below P * 2^123 = 2^125),
    on both transports. A sum that reaches the 2^126 limit (each rank sends 1.5 * 2^124 at one
    element) comes back NaN in its group of g values on every rank, never finite garbage or
    inf; the other groups stay finite."""
    mesh = make_mesh((4,), ("tp",))
    x = np.asarray(jax.random.normal(jax.random.key(4), (4, 1000)), np.float32)
    x = x / np.abs(x).max() * np.float32(2.0 ** 14)
    runs = {t: shard_mapped(lambda v, c=ej.EchoConfig(transport=t): ej.echo_psum(
        v[0], "tp", config=c)[None], mesh) for t in ("xla", "p2p")}
    base = np.asarray(runs["xla"](put(x, mesh, P("tp"))))
    within_bound(base[0], x)
    for j in (-90, 0, 40, 109):
        xs = x * np.float32(2.0 ** j)
        for transport, f in runs.items():
            y = np.asarray(f(put(xs, mesh, P("tp"))))
            assert np.isfinite(y).all(), (j, transport)
            np.testing.assert_array_equal(bits(y), bits(base * np.float32(2.0 ** j)))
    xs[:, 300] = np.float32(1.5 * 2.0 ** 124)                  # group 2 sums to 1.5 * 2^126
    for transport, f in runs.items():
        y = np.asarray(f(put(xs, mesh, P("tp"))))
        assert np.isnan(y[:, 256:384]).all(), transport
        assert np.isfinite(np.delete(y, np.s_[256:384], axis=1)).all(), transport


def test_inf_makes_its_group_nan_and_exact_leaves_keep_it():
    """psum gives inf where one rank sends inf; Echo's wire format has no code for it, so that
    group of g values is NaN on every rank and every other group is untouched (and within the
    bound). An overflow check summed as an int leaf is exact."""
    mesh = make_mesh((4,), ("tp",))
    x = np.array(jax.random.normal(jax.random.key(5), (4, 512)), np.float32)
    x[2, 300] = np.inf

    def body(v):
        y = ej.echo_psum(v[0], "tp", config=XLA)
        bad = ej.echo_psum((~jnp.isfinite(v[0])).any().astype(jnp.int32), "tp", config=XLA)
        return y[None], lax.psum(v[0], "tp")[None], bad[None]

    y, want, bad = (np.asarray(a) for a in jax.jit(jax.shard_map(
        body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))(put(x, mesh, P("tp"))))
    assert np.isinf(want[0, 300]) and bad.tolist() == [1] * 4
    assert np.isnan(y[:, 256:384]).all()
    keep = np.r_[0:256, 384:512]
    assert np.isfinite(y[:, keep]).all()
    within_bound(y[0, keep], x[:, keep])


# --- state in shard_map code -----------------------------------------------------------------

@pytest.mark.parametrize("check_vma", [True, False])
def test_state_is_a_scan_and_fori_loop_carry_in_shard_map(check_vma):
    """The README's pattern: compensated sites inside lax.scan inside jax.shard_map, the state
    from init_state(x) as the carry (typed varying over "tp" like the state echo_psum returns),
    under check_vma=True and False; and a fori_loop whose state comes from a replicated value
    with axis_name="tp". The scan gives the bits of the same sites unrolled."""
    cfg = ej.EchoConfig()
    mesh = make_mesh((4,), ("tp",))
    xs = jax.random.normal(jax.random.key(6), (4, 3, 256))

    def body(x):
        x = x[0]
        state = ej.init_state(x[0], cfg)

        def site(state, v):
            y, state = ej.echo_psum(v, "tp", config=cfg, state=state)
            return state, y

        final, ys = lax.scan(site, state, x)
        s = ej.init_state(x[0], cfg)
        for i in range(3):
            y_i, s = ej.echo_psum(x[i], "tp", config=cfg, state=s)
        replicated = ej.init_state(jnp.ones(256), cfg, axis_name="tp")
        loop = lax.fori_loop(0, 3, lambda i, s: ej.echo_psum(x[i], "tp", config=cfg,
                                                             state=s)[1], replicated)
        return ys[None], y_i[None], final.m1[None], s.m1[None], loop.m1[None]

    ys, y_last, m_scan, m_unrolled, m_loop = shard_mapped(body, mesh, check_vma=check_vma)(
        put(xs, mesh, P("tp")))
    np.testing.assert_array_equal(bits(np.asarray(ys)[:, -1]), bits(y_last))
    np.testing.assert_array_equal(bits(m_scan), bits(m_unrolled))
    np.testing.assert_array_equal(bits(m_loop), bits(m_unrolled))
    within_bound(np.asarray(ys)[0, 0], np.asarray(xs)[:, 0], cfg)


def test_init_state_types_and_outside_shard_map():
    """init_state's m1 has the vma the new state has; outside shard_map nothing is typed, and
    the same scan runs under vmap."""
    mesh = make_mesh((2,), ("tp",))
    seen = {}

    def body(v):
        x = v[0]
        seen["inferred"] = jax.typeof(ej.init_state(x).m1)
        seen["replicated"] = jax.typeof(ej.init_state(jnp.ones(4), axis_name="tp").m1)
        seen["sds"] = jax.typeof(ej.init_state(jax.ShapeDtypeStruct((4,), jnp.float32),
                                               axis_name=("tp",)).m1)
        seen["new"] = jax.typeof(ej.echo_psum(x, "tp", config=XLA,
                                              state=ej.init_state(x))[1].m1)
        return v

    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))(
        jnp.ones((2, 4)))
    assert len({str(t) for t in seen.values()}) == 1 and "tp" in str(seen["new"]), seen
    assert jax.typeof(ej.init_state(jnp.ones(4)).m1) == jax.typeof(jnp.zeros(4))

    def scanned(x):
        def site(s, v):
            y, s = ej.echo_psum(v, "tp", config=XLA, state=s)
            return s, y
        return lax.scan(site, ej.init_state(x[0]), x)[1]

    ys = jax.jit(jax.vmap(scanned, axis_name="tp"))(jax.random.normal(jax.random.key(7),
                                                                        (2, 3, 64)))
    assert ys.shape == (2, 3, 64)


def test_return_state_is_one_calling_convention():
    """return_state=True: (y, new_state) with or without a state (None then), so one site serves
    a compensated and an uncompensated configuration; the default keeps psum's shape (y)."""
    x = jax.random.normal(jax.random.key(8), (4, 300))

    def site(v, state):
        return ej.echo_psum(v, "tp", config=XLA, state=state, return_state=True)

    plain = jax.vmap(lambda v: site(v, None), axis_name="tp")(x)
    comp = jax.vmap(lambda v: site(v, ej.init_state(v)), axis_name="tp")(x)
    y = jax.vmap(lambda v: ej.echo_psum(v, "tp", config=XLA), axis_name="tp")(x)
    assert plain[1] is None and isinstance(comp[1], ej.CompensatorState)
    np.testing.assert_array_equal(bits(plain[0]), bits(y))
    np.testing.assert_array_equal(bits(comp[0]), bits(y))   # zero state: the same first call
    with pytest.raises(ValueError, match="return_state=False with a state"):
        jax.vmap(lambda v: ej.echo_psum(v, "tp", state=ej.init_state(v), return_state=False),
                 axis_name="tp")(x)
    assert ej.echo_psum(x, (), config=XLA) is x                   # psum over no axes


# --- pmap and other float dtypes -------------------------------------------------------------

def test_pmap_and_float8():
    """Inside jax.pmap as inside shard_map (pmap's ranks are manual axes: "auto" runs the
    custom call, with the bits of "xla"); an 8-bit float leaf is summed in fp32 and comes back
    in its dtype."""
    x = jax.random.normal(jax.random.key(9), (4, 300))
    pmap = lambda f: jax.pmap(f, axis_name="i", devices=jax.devices()[:4])  # noqa: E731
    y = pmap(lambda v: ej.echo_psum(v, "i", config=XLA))(x)
    want = pmap(lambda v: lax.psum(v, "i"))(x)
    assert y.shape == want.shape and y.dtype == want.dtype
    within_bound(np.asarray(y)[0], x)
    np.testing.assert_array_equal(bits(pmap(lambda v: ej.echo_psum(v, "i"))(x)), bits(y))
    x8 = x.astype(jnp.float8_e4m3fn)
    y8 = jax.vmap(lambda v: ej.echo_psum(v, "tp", config=XLA), axis_name="tp")(x8)
    assert y8.dtype == jnp.float8_e4m3fn
    assert np.abs(np.asarray(y8, np.float32)[0] - np.asarray(x8, np.float32).sum(0)).max() < 2.0


# --- derivatives and tracing: psum's batching, no constants, NameError -----------------------

def test_gradient_has_psum_batching_under_vmap():
    """psum's transpose keeps an unbatched cotangent unbatched: the gradient of -psum(x) under
    vmap is -P on every rank, unbatched, so out_axes=None takes it. echo_psum's derivative is
    psum's (straight-through), batching included, on every path: plain, compensated, a value
    not batched along the axis, and under jit."""
    P_, x = 4, jax.random.normal(jax.random.key(10), (4, 300))
    state = lambda v: ej.init_state(v)  # noqa: E731
    reducers = {"psum": lambda v: lax.psum(v, "i"),
                "echo": lambda v: ej.echo_psum(v, "i", config=XLA),
                "echo+state": lambda v: ej.echo_psum(v, "i", config=XLA, state=state(v))[0]}
    for name, reduce in reducers.items():
        g = jax.vmap(jax.grad(lambda v: -reduce(v).sum()), out_axes=None, axis_name="i")(x)
        np.testing.assert_array_equal(np.asarray(g), np.full(300, -P_, np.float32), name)
        g = jax.jit(jax.vmap(jax.grad(lambda v: -reduce(v).sum()), in_axes=None, axis_size=4,
                             out_axes=None, axis_name="i"))(x[0])
        np.testing.assert_array_equal(np.asarray(g), np.full(300, -P_, np.float32), name)
    # The scalar form of JAX's own test.
    g = jax.vmap(jax.grad(lambda v: -ej.echo_psum(v, "i", config=XLA)), out_axes=None,
                 axis_name="i")(jnp.ones(4))
    assert g.shape == () and float(g) == -4.0


@pytest.mark.parametrize("rule", ["custom_jvp", "custom_vjp"])
def test_initial_style_vmap_with_collective(rule):
    """A custom_jvp / custom_vjp function whose body calls the collective, traced to a jaxpr
    and evaluated with no constants (as JAX's own test does: psum's jaxpr has none) and inside
    lax.map, scan and while_loop, under vmap with axis_name: psum's results there, within
    Eq. 1's bound (2.0 summed over 4 ranks is about 8)."""
    def build(reduce):
        if rule == "custom_jvp":
            f = jax.custom_jvp(lambda x: reduce(x))
            f.defjvp(lambda xs, ts: (reduce(xs[0]), ts[0]))
        else:
            f = jax.custom_vjp(lambda x: reduce(x))
            f.defvjp(lambda x: (reduce(x), None), lambda res, dx: (dx,))
        return f

    def run(reduce):
        f = build(reduce)

        def g(x):
            jaxpr = jax.make_jaxpr(f)(x)
            return jax.core.eval_jaxpr(jaxpr.jaxpr, [], x)[0]

        def loops(x):
            xs = jnp.stack([x, 2 * x])
            mapped = lax.map(f, xs)
            scanned = lax.scan(lambda c, v: (c + f(v), None), jnp.zeros_like(x), xs)[0]
            looped = lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1] + f(x)),
                                    (0, jnp.zeros_like(x)))[1]
            return mapped, scanned, looped

        one = jax.vmap(lambda _, x: g(x), axis_name="foo", in_axes=(0, None))(jnp.arange(4.),
                                                                              2.)
        vec = jax.vmap(lambda v: (g(v), loops(v)), axis_name="foo")(
            jax.random.normal(jax.random.key(11), (4, 256)))
        return one, vec

    want, echo = run(lambda x: lax.psum(x, "foo")), run(
        lambda x: ej.echo_psum(x, "foo", config=XLA))
    assert_same_type(echo, want)
    np.testing.assert_allclose(np.asarray(want[0]), 8.0)
    within_bound(np.asarray(echo[0])[0], np.full((4,), 2.0, np.float32))
    x = np.asarray(jax.random.normal(jax.random.key(11), (4, 256)))
    within_bound(np.asarray(echo[1][0])[0], x)
    mapped, scanned, looped = (np.asarray(a) for a in echo[1][1])
    within_bound(mapped[0, 0], x)
    within_bound(mapped[0, 1], 2 * x)
    np.testing.assert_array_equal(scanned, mapped[:, 0] + mapped[:, 1])   # the same calls
    np.testing.assert_array_equal(looped, mapped[:, 0] + mapped[:, 0])


def test_jaxpr_has_no_constants_on_any_path():
    """psum's jaxpr has no constvars, so code may evaluate one with no constants; so has
    echo_psum's, on the pure-JAX and custom-call transports, with the rotation, a state, a
    16-bit x, and its gradient."""
    cases = {"xla": dict(config=XLA), "rotation": dict(config=XLA.replace(rotation="hadamard")),
             "auto": dict(config=ej.EchoConfig()), "bf16": dict(config=XLA, dtype=jnp.bfloat16),
             "state": dict(config=XLA, state=True),
             "separate": dict(config=XLA.replace(state_update="separate"), state=True)}
    mesh = make_mesh((4,), ("tp",))
    for name, kw in cases.items():
        cfg, dtype, with_state = kw["config"], kw.get("dtype", jnp.float32), kw.get("state")

        def f(v, cfg=cfg, with_state=with_state):
            s = ej.init_state(v) if with_state else None
            return ej.echo_psum(v, "tp", config=cfg, state=s, return_state=True)[0]

        def check(v, f=f, name=name):
            for fn in (f, jax.grad(lambda u: f(u).astype(jnp.float32).sum())):
                jaxpr = jax.make_jaxpr(fn)(v)
                assert not jaxpr.jaxpr.constvars, (name, jaxpr.jaxpr.constvars)
            return v

        x = jnp.ones((4, 512), dtype)
        jax.vmap(check, axis_name="tp")(x)
        jax.jit(jax.shard_map(lambda v: check(v[0])[None], mesh=mesh, in_specs=P("tp"),
                              out_specs=P("tp")))(put(x, mesh, P("tp")))


def test_unbound_axis_raises_name_error_as_psum():
    """psum raises NameError for an axis name that is not bound; so does echo_psum (an
    UnboundAxisError, also a ValueError as before), naming the axis and the fix, under jit,
    inside vmap over another name, and in shard_map over a mesh without that axis."""
    x = jnp.ones(300)
    with pytest.raises(NameError):
        jax.jit(lambda v: lax.psum(v, "i"))(x)
    for where, call in (
            ("jit", lambda f: jax.jit(f)(x)),
            ("vmap", lambda f: jax.vmap(f, axis_name="j")(jnp.ones((2, 300)))),
            ("shard_map", lambda f: jax.jit(jax.shard_map(
                lambda v: f(v[0])[None], mesh=make_mesh((2,), ("tp",)), in_specs=P("tp"),
                out_specs=P("tp")))(jnp.ones((2, 300))))):
        for cfg in (XLA, ej.EchoConfig()):
            with pytest.raises(NameError, match=r"unbound axis name: i .*'i' is not bound.*"
                                                r"axis_name='i'") as err:
                call(lambda v, cfg=cfg: ej.echo_psum(v, "i", config=cfg))
            assert isinstance(err.value, ValueError), where
            assert isinstance(err.value, collective.UnboundAxisError)
    with pytest.raises(NameError, match="'k' is not bound"):
        jax.vmap(lambda v: ej.echo_psum(v, ("j", "k")), axis_name="j")(jnp.ones((2, 300)))


# --- exact integer sums, weak types -----------------------------------------------------------

def _enable_x64():
    return jax.enable_x64(True) if hasattr(jax, "enable_x64") else (
        jax.experimental.enable_x64())


def test_integer_sums_are_exact_where_float32_is_not():
    """psum of integers is exact (and wraps as two's complement, as XLA's integer add does):
    int32 values near 2^30, which float32 cannot hold, sum to NumPy's int64 sum exactly, and a
    sum past 2^31 wraps as psum's; under vmap and shard_map alike."""
    base = np.array([2 ** 29 - 1, 2 ** 29 - 3, -(2 ** 30) + 7, 2 ** 29 + 5], np.int64)
    x = (base[:, None] + np.arange(6)[None, :] * 17).astype(np.int32)   # [4 ranks, 6]
    big = np.full((4, 3), 2 ** 30 + 1, np.int32)                           # sums past 2^31
    want = x.astype(np.int64).sum(0)
    assert (want.astype(np.float32).astype(np.int64) != want).any()        # fp32 cannot
    mesh = make_mesh((4,), ("tp",))

    def body(v, b):
        return ej.echo_psum(v, "tp", config=XLA), ej.echo_psum(b, "tp"), lax.psum(b, "tp")

    for got in (jax.jit(jax.vmap(body, axis_name="tp"))(x, big),
                jax.jit(jax.shard_map(lambda v, b: jax.tree.map(lambda a: a[None],
                                                                body(v[0], b[0])),
                                      mesh=mesh, in_specs=(P("tp"), P("tp")),
                                      out_specs=P("tp")))(put(x, mesh, P("tp")),
                                                          put(big, mesh, P("tp")))):
        y, wrapped, psum_wrapped = (np.asarray(a) for a in got)
        assert y.dtype == np.int32
        np.testing.assert_array_equal(y, np.broadcast_to(want, y.shape))
        np.testing.assert_array_equal(wrapped, psum_wrapped)
        np.testing.assert_array_equal(
            wrapped[0], (big.astype(np.int64).sum(0) + 2 ** 31) % 2 ** 32 - 2 ** 31)


def test_int64_sums_are_exact_with_x64():
    """With jax_enable_x64, an int64 leaf near 2^60 (beyond float32 and float64 both) sums
    exactly as psum's, typed int64; uint8 and int16 keep their dtypes as psum's."""
    with _enable_x64():
        x = (np.int64(2) ** 60 + np.arange(4 * 5, dtype=np.int64) * 12345 + 1).reshape(4, 5)
        small = {"u8": np.arange(4 * 3, dtype=np.uint8).reshape(4, 3),
                 "i16": (np.arange(4 * 3, dtype=np.int16).reshape(4, 3) * 1000)}
        got = jax.jit(jax.vmap(lambda v, s: ej.echo_psum((v, s), "tp", config=XLA),
                               axis_name="tp"))(x, small)
        want = jax.jit(jax.vmap(lambda v, s: lax.psum((v, s), "tp"), axis_name="tp"))(x, small)
        assert_same_type(got, want)
        assert got[0].dtype == jnp.int64
        exact = [int(c) for c in x.astype(object).sum(0)]   # Python integers: no rounding
        assert [int(c) for c in np.asarray(got[0])[2]] == exact
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_weak_types_beyond_python_literals():
    """psum keeps the weak type of any weakly typed input, not only a Python scalar's:
    jnp.asarray(2.5), arithmetic of a weak value with a Python scalar, a weak value varying
    over the axis (a Python float times axis_index, times a bool array), a broadcast weak
    array, a weak int. echo_psum's results are typed like psum's (weak), and add to a bfloat16
    value without promoting it. (Under vmap, psum of an unbatched weak array that is not a
    scalar comes back strongly typed: its batching rule multiplies by a strongly typed axis
    size. echo_psum keeps the weak type there, as psum does in shard_map.)"""
    mesh = make_mesh((4,), ("tp",))
    got, want = {}, {}

    def values(v):
        i = lax.axis_index("tp")
        return {"asarray": jnp.asarray(2.5), "arith": jnp.asarray(1.5) * 3.0 + 1.0,
                "varying": 2.5 * (i + 1), "broadcast": lax.broadcast(jnp.asarray(0.75), (300,)),
                "int": jnp.asarray(3), "int_arith": jnp.asarray(3) * 2 + 1,
                "bool_times": 2.5 * (v > 0)}

    def body(v):
        vals = values(v)
        assert all(jax.typeof(a).weak_type for a in vals.values())
        got.update(ej.echo_psum(vals, "tp", config=XLA))
        want.update(lax.psum(vals, "tp"))
        return (v + ej.echo_psum(vals["varying"], "tp", config=XLA))[None]

    out = jax.jit(jax.shard_map(lambda v: body(v[0]), mesh=mesh, in_specs=P("tp"),
                                out_specs=P("tp")))(put(jnp.ones((4, 3), jnp.bfloat16), mesh,
                                                        P("tp")))
    assert out.dtype == jnp.bfloat16
    assert_same_type(got, want)
    assert all(type_of(a)[2] for a in got.values()), {k: jax.typeof(a) for k, a in got.items()}
    np.testing.assert_allclose(np.asarray(out, np.float32), 1.0 + 2.5 * 10, rtol=2 ** -6)
    vm = jax.vmap(lambda v: (ej.echo_psum(values(v), "tp", config=XLA), lax.psum(values(v),
                                                                               "tp")),
                  axis_name="tp")(jnp.ones((4, 300)))
    assert all(type_of(a)[2] for a in vm[0].values())
    assert_same_type(*({k: a for k, a in t.items() if k != "broadcast"} for t in vm))
    for k in ("int", "int_arith"):
        np.testing.assert_array_equal(np.asarray(vm[0][k]), np.asarray(vm[1][k]))


# --- rescale: the modes and the factor ------------------------------------------------------

def _echo_sums(x, transport="xla", rescale="auto"):
    """Every rank's echo_psum of x [P, n] (rank r contributes x[r]): vmap for "xla", the
    CPU custom call in shard_map for "p2p"."""
    cfg = ej.EchoConfig(transport=transport)
    if transport == "xla":
        return np.asarray(jax.jit(jax.vmap(
            lambda v: ej.echo_psum(v, "tp", config=cfg, rescale=rescale), axis_name="tp"))(x))
    mesh = make_mesh((x.shape[0],), ("tp",))
    return np.asarray(shard_mapped(lambda v: ej.echo_psum(v[0], "tp", config=cfg,
                                                          rescale=rescale)[None], mesh)(
        put(x, mesh, P("tp"))))


def _bf16(v):
    """float64 -> the nearest bf16 value (ties to even), as float64."""
    return np.asarray(np.float32(v)).astype(ml_dtypes.bfloat16).astype(np.float64)


def _constant_groups(c, num_ranks, g=128):
    """Every rank contributes the groups c, -c, c / 2 and 0 (each constant, g values)."""
    row = np.concatenate([np.full(g, c), np.full(g, -c), np.full(g, c / 2), np.zeros(g)])
    return np.broadcast_to(row.astype(np.float32), (num_ranks, 4 * g)).copy()


def _check_constant_groups(values, num_ranks, transport):
    """A constant group is sent as its value rounded to the nearest bf16, b = bf16(c), exactly
    (quant.py's docstring), at any magnitude (below the 2^-100 scale floor too) up to the 2^126
    limit. The owner adds its own c in full precision to the P - 1 copies b (exact in fp32 for
    the values here: at most 16 significant bits), and the sum, a constant group again, comes
    back as bf16(c + (P - 1) b) on every rank; NaN where |c + (P - 1) b| reaches 2^126."""
    for c in values:
        x = _constant_groups(np.float32(c), num_ranks)
        assert x[0, 0] == np.float32(c)
        b = _bf16(x[:, ::128])                                  # [P, 4]: each group's b
        total = x[0, ::128].astype(np.float64) + (num_ranks - 1) * b[0]
        with np.errstate(over="ignore"):                        # a sum past fp32's range
            want = np.where(np.abs(total) >= 2.0 ** 126, np.nan, _bf16(total))
        y = _echo_sums(x, transport)
        np.testing.assert_array_equal(y, np.broadcast_to(np.repeat(want, 128), y.shape)
                                      .astype(np.float32), f"c={c!r} P={num_ranks} {transport}")


def _edge_values(num_ranks):
    """Constants at the format's edges: below the scale floor, bf16 rounding ties (1 + 2^-8 to
    even 1, 1 + 3 * 2^-8 to even 1 + 2^-6), fp16's largest value (not a bf16 value), and
    top = 2^(126 - ceil(log2 P)) and the bf16 value below it (where P is a power of two, the
    sum P * c reaches the 2^126 limit at top and stays below it one bf16 step lower)."""
    top = 2.0 ** (126 - int(np.ceil(np.log2(num_ranks))))
    return [1.5 * 2.0 ** -100, 2.0 ** -6, 1.0, 1.00390625, 1.01171875, 65504.0, 3 * 2.0 ** 100,
            (1 - 2.0 ** -8) * top, top]


def test_constant_groups_are_exact_up_to_the_range_limit():
    """Constant contributions come back as documented (`_check_constant_groups`): exact for a
    bf16 value (P * c at P = 4), rounded to the nearest bf16 otherwise, finite up to a sum just
    below 2^126 ((1 - 2^-8) * 2^124 from each of 4 ranks) and NaN in the groups whose sum
    reaches it (2^124 from each: c and -c NaN, c / 2 and 0 exact), on both transports."""
    values = _edge_values(4)
    assert values[-1] == 2.0 ** 124 and values[-2] == (1 - 2.0 ** -8) * 2.0 ** 124
    _check_constant_groups(values, 4, "xla")
    _check_constant_groups([1.00390625, 65504.0] + values[-2:], 4, "p2p")
    y = _echo_sums(_constant_groups(np.float32(2.0 ** 124), 4))
    assert np.isnan(y[:, :256]).all() and (y[:, 256:384] == 2.0 ** 125).all()


@pytest.mark.slow
@pytest.mark.parametrize("num_ranks", [2, 3, 8])
@pytest.mark.parametrize("transport", ["xla", "p2p"])
def test_constant_groups_grid(num_ranks, transport):
    """As above for P = 2, 3, 8, and constants m * 2^e (m = 1, 1.5, 1.75) across fp32's range,
    from below the scale floor to beyond the range limit (NaN there)."""
    values = _edge_values(num_ranks) + [m * 2.0 ** e for m in (1, 1.5, 1.75)
                                        for e in range(-120, 127, 17)]
    _check_constant_groups(values, num_ranks, transport)


def _with_a_tiny_group(top, num_ranks, seed, tiny=2.0 ** -50):
    """Contributions whose largest |x| over the group is exactly `top` (on rank 0), with one
    group (the last of 4) `tiny` times smaller."""
    x = np.asarray(jax.random.uniform(jax.random.key(seed), (num_ranks, 512), minval=-1,
                                      maxval=1), np.float32) * np.float32(top / 2)
    x[:, 384:] *= np.float32(tiny)
    x[0, 5] = np.float32(top)
    assert np.abs(x).max() == np.float32(top)
    return x


@pytest.mark.parametrize("transport", ["xla", pytest.param("p2p", marks=pytest.mark.slow)])
def test_rescale_modes_are_where_documented(transport):
    """rescale="auto" (the default) gives rescale=False's bits. rescale=True scales the call's
    max |x| into [256, 512) and back, which changes the bits only where a group meets the
    scale's 2^-100 floor: with max |x| = 2^-60 and a group 2^-50 times smaller (values near
    2^-111, below the floor unscaled) True differs from False in that group alone, and is the
    nearer to the float64 sum there; with the same group at max |x| = 1 (values near 2^-51)
    True gives False's bits everywhere."""
    num_ranks = 4
    x = _with_a_tiny_group(2.0 ** -60, num_ranks, 12)
    off, on = _echo_sums(x, transport, False), _echo_sums(x, transport, True)
    np.testing.assert_array_equal(bits(_echo_sums(x, transport, "auto")), bits(off))
    np.testing.assert_array_equal(bits(on[:, :384]), bits(off[:, :384]))
    assert not np.array_equal(bits(on[:, 384:]), bits(off[:, 384:]))
    exact = x.astype(np.float64).sum(0)[384:]
    err_on, err_off = (np.linalg.norm(v[0, 384:] - exact) for v in (on, off))
    assert err_on < 0.2 * err_off, (err_on, err_off)
    x = _with_a_tiny_group(1.0, num_ranks, 13)
    off = _echo_sums(x, transport, False)
    np.testing.assert_array_equal(bits(_echo_sums(x, transport, True)), bits(off))
    np.testing.assert_array_equal(bits(_echo_sums(x, transport, "auto")), bits(off))


def test_rescale_factor_is_the_documented_power_of_two():
    """collective.rescale_factor (rescale=True's factor) against its docstring, under vmap
    for P = 4 and 128: a power of two 2^k that puts the group-wide max |x| (on one rank; NaN
    and +-inf on another left out) in [256, 512) / 2^h (h: the rotation's headroom), or in
    [T / 2, T) with T = rescale_ceiling(P, h) = 2^(15 - ceil(log2 P) - h) where that is lower
    (P > 64); k clipped to [-126, 120] (multiplying by it stays exact); 1 for a max of 0. The
    mode must be True ("auto" takes no factor)."""
    assert collective.rescale_ceiling(4) == 8192.0 and collective.rescale_ceiling(128, 4) == 16.0
    rng = np.random.default_rng(20)
    for num_ranks in (4, 128):
        for h in (0, 4):
            f = jax.jit(jax.vmap(lambda v, h=h: collective.rescale_factor(v, "tp", True, h),
                                 axis_name="tp"))
            aim = min(2.0 ** (9 - h), 2.0 ** (15 - int(np.ceil(np.log2(num_ranks))) - h))
            for e in (-120, -60, -21, 0, 8, 9, 21, 60, 100, 125):
                amax = 1.5 * 2.0 ** e
                x = (rng.uniform(-1, 1, (num_ranks, 16)) * amax).astype(np.float32)
                x[num_ranks - 1, 3] = np.float32(amax)
                x[0, 5], x[1, 6] = np.nan, -np.inf
                got = np.asarray(f(jnp.asarray(x)), np.float64)
                k = int(np.clip(np.log2(aim) - 1 - e, -126, 120))   # amax * 2^k in [aim/2, aim)
                assert (got == 2.0 ** k).all(), (num_ranks, h, e, got[0], k)
            zero = np.zeros((num_ranks, 16), np.float32)
            zero[0, 0] = np.inf
            assert (np.asarray(f(jnp.asarray(zero))) == 1.0).all()
    with pytest.raises(ValueError, match="mode must be True"):
        jax.vmap(lambda v: collective.rescale_factor(v, "tp", "auto"), axis_name="tp")(
            jnp.ones((4, 8)))


# --- return conventions -----------------------------------------------------------------------

def test_return_conventions_in_edge_cases():
    """psum's shape (y) without a state; (y, new_state) with one or with return_state=True;
    the same with no axes (psum over () is the identity: x and the state as they are), at
    axis size 1, below the size gate (the state passes through unchanged), and for pytrees
    with None in them (kept where psum keeps them; None in the state there too)."""
    x = jax.random.normal(jax.random.key(16), (4, 300))
    x0 = x[0]
    s = ej.init_state(x0)
    # No axes: the identity, in every convention.
    assert ej.echo_psum(x, ()) is x and ej.echo_psum(x, [], config=XLA) is x
    y, new = ej.echo_psum(x0, (), state=s)
    assert y is x0 and new is s
    y, new = ej.echo_psum(x, (), return_state=True)
    assert y is x and new is None
    y, new = ej.echo_psum(x0, (), state=s, return_state=True)
    assert y is x0 and new is s
    assert ej.echo_psum(x, (), return_state=False) is x
    for axes in ((), "tp"):
        with pytest.raises(ValueError, match="return_state=False with a state"):
            jax.vmap(lambda v, a=axes: ej.echo_psum(v, a, state=ej.init_state(v),
                                                    return_state=False), axis_name="tp")(x)
    # Pytrees with None, with and without a state.
    tree = lambda v: {"a": v, "b": None, "c": (None, 2 * v)}  # noqa: E731

    def site(v):
        plain = ej.echo_psum(tree(v), "tp", config=XLA)
        pair = ej.echo_psum(tree(v), "tp", config=XLA, return_state=True)
        compd = ej.echo_psum(tree(v), "tp", config=XLA, state=ej.init_state(tree(v)))
        return plain, pair, compd, lax.psum(tree(v), "tp")

    plain, pair, compd, want = jax.vmap(site, axis_name="tp")(x)
    structure = jax.tree.structure(want)
    assert jax.tree.structure(plain) == structure and pair[1] is None
    assert jax.tree.structure(pair[0]) == jax.tree.structure(compd[0]) == structure
    assert compd[1]["b"] is None and compd[1]["c"][0] is None
    assert isinstance(compd[1]["a"], ej.CompensatorState)
    within_bound(np.asarray(plain["a"])[0], x)
    np.testing.assert_array_equal(bits(compd[0]["a"]), bits(plain["a"]))   # zero state
    # Axis size 1: x itself; the state unchanged.
    y1, (y2, s2) = jax.vmap(lambda v: (ej.echo_psum(v, "tp", config=XLA),
                                       ej.echo_psum(v, "tp", config=XLA, state=_ones_state(v))),
                            axis_name="tp")(x[:1])
    np.testing.assert_array_equal(bits(y1), bits(x[:1]))
    np.testing.assert_array_equal(bits(y2), bits(x[:1]))
    np.testing.assert_array_equal(np.asarray(s2.m1), 1.0)
    # Below the size gate: psum's exact sum, the state passed through unchanged.
    gated = XLA.replace(min_bytes=1 << 20)
    y, s3 = jax.vmap(lambda v: ej.echo_psum(v, "tp", config=gated, state=_ones_state(v)),
                     axis_name="tp")(x)
    want = jax.vmap(lambda v: lax.psum(v, "tp"), axis_name="tp")(x)
    np.testing.assert_array_equal(bits(y), bits(want))
    assert isinstance(s3, ej.CompensatorState)
    np.testing.assert_array_equal(np.asarray(s3.m1), 1.0)
    np.testing.assert_array_equal(np.asarray(s3.m2), 1.0)


def _ones_state(v):
    return ej.CompensatorState(jnp.ones_like(v), jnp.ones_like(v))


# --- the gspmd sites' backward: power-of-two equivariance -------------------------------------

def _site_vjp(kind, mesh, cfg):
    from echo_jax import gspmd
    helper = {"row": gspmd.row_parallel_matmul, "column": gspmd.column_parallel_matmul}[kind]

    def pullback(x, w, ct):
        return jax.vjp(lambda a, b: helper(a, b, mesh=mesh, config=cfg), x, w)[1](ct)
    return jax.jit(pullback)


def _check_equivariance(kind, cfg, ks, seed=17):
    mesh = make_mesh((4,), ("tp",))
    keys = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(keys[0], (16, 64))
    w = jax.random.normal(keys[1], (64, 128)) / 8
    ct = jax.random.normal(keys[2], (16, 128))
    f = _site_vjp(kind, mesh, cfg)
    base = [np.asarray(g) for g in f(x, w, ct)]
    for k in ks:
        scale = np.float32(2.0 ** k)
        got = [np.asarray(g) for g in f(x, w, ct * scale)]
        for name, g, b in zip(("x", "w"), got, base):
            assert np.isfinite(g).all() and np.abs(g).max() > 0, (kind, k, name)
            np.testing.assert_array_equal(bits(g), bits(b * scale), f"{kind} k={k} d{name}")


@pytest.mark.parametrize("kind", ["row", "column"])
def test_gspmd_site_backward_is_power_of_two_equivariant(kind):
    """The sites' backward rescales by powers of two (column: Echo's all-reduce of the
    cotangent with rescale=True; row: the identity), and a power of two multiplies exactly: a
    cotangent times 2^k gives input and weight gradients times 2^k, bit for bit, at 2^60 and at
    2^-100 too, where the unscaled all-reduce's contributions would meet the wire format's
    2^-100 scale floor (the rescaling lifts them to [256, 512) first)."""
    _check_equivariance(kind, ej.EchoConfig(), (-100, 60))


@pytest.mark.slow
@pytest.mark.parametrize("bits_", [4, 8])
@pytest.mark.parametrize("kind", ["row", "column"])
def test_gspmd_site_backward_equivariance_grid(kind, bits_):
    _check_equivariance(kind, ej.EchoConfig(bits=bits_), range(-100, 101, 20), seed=18)
