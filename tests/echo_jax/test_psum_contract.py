"""echo_psum against lax.psum's contract, one test per row of docs/design.md's "psum contract".

Each test runs `lax.psum` on the same inputs and compares: the result type (`jax.typeof`: shape,
dtype, weak type, varying mesh axes), exact equality where psum's sum is exact (bool, integer
leaves), and for float leaves the Echo error bound of Eq. 1 (`np_reference.allreduce_error_bound`,
from the data alone). Fake CPU devices (tests/conftest.py); one case per code path.
"""

import jax
import jax.numpy as jnp
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

def test_no_group_turns_nan_below_fp32_max():
    """rescale="auto" scales a contribution down from auto_rescale_above(P) up, so no finite
    value makes a group NaN: the sum of x * 2^j is the sum of x times 2^j, bit for bit, for any
    magnitude from there to fp32's largest value, within Eq. 1's bound, on both transports."""
    mesh = make_mesh((4,), ("tp",))
    x = np.asarray(jax.random.normal(jax.random.key(4), (4, 1000)), np.float32)
    x = x / np.abs(x).max() * np.float32(2.0 ** 14)          # max |x| = 2^14 > 8192 = above(4)
    assert collective.auto_rescale_above(4) == 8192.0
    runs = {t: shard_mapped(lambda v, c=ej.EchoConfig(transport=t): ej.echo_psum(
        v[0], "tp", config=c)[None], mesh) for t in ("xla", "p2p")}
    base = np.asarray(runs["xla"](put(x, mesh, P("tp"))))
    within_bound(base[0], x)
    for j in (0, 40, 111):                                  # up to max |x| = 2^125 (P * 2^125 <
        xs = x * np.float32(2.0 ** j)                       # fp32's largest value)
        for transport, f in runs.items():
            y = np.asarray(f(put(xs, mesh, P("tp"))))
            assert np.isfinite(y).all(), (j, transport)
            np.testing.assert_array_equal(bits(y), bits(base * np.float32(2.0 ** j)))
    # Without the rescaling the groups overflow fp16's scale range: NaN (documented).
    f = shard_mapped(lambda v: ej.echo_psum(v[0], "tp", config=XLA, rescale=False)[None], mesh)
    assert np.isnan(np.asarray(f(put(x * np.float32(2.0 ** 20), mesh, P("tp"))))).all()


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
