"""The Hadamard rotation fused into the CPU custom call (attribute rotate = 1).

`echo_psum` with rotation="hadamard" and transport="p2p" rotates inside the CPU handler (and
keeps a compensated call fused), rescaled or not; the reference is the pure-JAX rotation around
the "xla" transport. Checked: the same bits (result and compensator state after several steps)
over ranks, bits, policies, dtypes, group sizes, lengths and awkward inputs; the compiled program
holds the call with rotate = 1 and nothing of the JAX rotation; a rescaled call stays in the
call (the factor from x, before the rotation); the decision functions; the handler's attribute
checks; the explicit `echo_jax.p2p` functions (a factor, the vmap fallback); closeness to the
exact sum.
"""

import collections
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import echo_jax as ej
from echo_jax import collective, transports
from echo_jax.transports import explicit
from echo_jax.transports import cpu, xla
from conftest import make_mesh, put

HAVE_CPU_CALL = "cpu" in cpu.available_platforms()
needs_call = pytest.mark.skipif(not HAVE_CPU_CALL, reason="the CPU custom call is not built")

STEPS = 3  # compensated steps, the state threaded from one to the next


def as_varying(y, axis="tp"):
    mat = getattr(jax.typeof(y), "mat", None)
    return y if mat is not None and axis in mat.varying else lax.pcast(y, axis, to="varying")


def uint_view(a):
    a = np.asarray(a)
    return a.view({4: np.uint32, 2: np.uint16}[a.dtype.itemsize])


def assert_same_bits(got, want, what=""):
    """Bit for bit, except that a NaN only has to be a NaN where the reference has one (its
    sign and payload are not part of the contract)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype)
    nan_got = np.isnan(got.astype(np.float32))
    nan_want = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(nan_got, nan_want, err_msg=f"{what}: NaN positions")
    np.testing.assert_array_equal(np.where(nan_got, 0, uint_view(got)),
                                  np.where(nan_want, 0, uint_view(want)), err_msg=what)


def program(cfg, nranks, rescale=False):
    """jit(shard_map) of one uncompensated call and STEPS compensated calls.

    In: x [P, STEPS, n] (the uncompensated call sums step 0). Out: y [P, n] and, per step,
    y_t [P, STEPS, n], then the final m1, m2 [P, n] (fp32)."""
    mesh = make_mesh((nranks,), ("tp",))

    def body(xr):
        x = xr[0]
        y = ej.echo_psum(x[0], "tp", config=cfg, rescale=rescale)
        state = ej.init_state(x[0], cfg)
        ys = []
        for t in range(STEPS):
            yt, state = ej.echo_psum(x[t], "tp", config=cfg, state=state, rescale=rescale)
            ys.append(as_varying(yt))
        return as_varying(y)[None], jnp.stack(ys)[None], state.m1[None], state.m2[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=(P("tp"),) * 4))
    return f, mesh


def run(cfg, x, rescale=False):
    """(outputs, compiled HLO text) of `program` on x [P, STEPS, n]."""
    f, mesh = program(cfg, x.shape[0], rescale)
    xs = put(x, mesh, P("tp"))
    compiled = f.lower(xs).compile()
    return [np.asarray(o) for o in compiled(xs)], compiled.as_text()


def make_inputs(nranks, n, g, dtype, kind, seed):
    """x [P, STEPS, n] in dtype: Gaussian with one outlier channel (x100) on every step, plus

    * "nonfinite": +inf, -inf and NaN in one group of step 0 (`nonfinite_group`), on different
      ranks where P > 2,
    * "zeros": the first group (the first half of a shorter x) zero on every rank and step, and
      rank 0's whole contribution zero at step 1.
    """
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((nranks, STEPS, n)).astype(np.float32)
    x[:, :, (7 * n) // 11] *= 100.0  # the outlier channel
    if kind == "nonfinite":
        k0 = nonfinite_group(n, g) * g
        x[0, 0, k0] = np.inf
        x[1 % nranks, 0, min(k0 + 1, n - 1)] = -np.inf
        x[-1, 0, k0] = np.nan
    elif kind == "zeros":
        x[:, :, :min(g, max(n // 2, 1))] = 0.0
        x[0, 1] = 0.0
    return jnp.asarray(x).astype(dtype)


def nonfinite_group(n, g):
    """The group that holds the inf / NaN of "nonfinite" inputs: the second, or the first."""
    return 1 if n >= 2 * g else 0


def custom_calls(hlo):
    return [ln for ln in hlo.splitlines() if "custom-call(" in ln]


# (P, bits, policy, dtype, g, n, kind): every P, bits, policy, dtype and g appears several times;
# n below one group, n not a multiple of g, n = 1, segments of pure padding (small n, large P).
CASES = [
    (2, 4, "asym", jnp.float32, 128, 1000, "plain"),
    (3, 4, "sym", jnp.bfloat16, 32, 45, "nonfinite"),
    (4, 8, "asym_naive", jnp.float16, 128, 100, "plain"),
    (8, 4, "asym", jnp.bfloat16, 1024, 3000, "zeros"),
    (8, 8, "sym", jnp.float32, 2, 7, "nonfinite"),
    (3, 8, "asym", jnp.float16, 1024, 700, "zeros"),
    (2, 4, "asym_naive", jnp.float32, 32, 1, "plain"),
    (4, 4, "sym", jnp.float16, 2, 1, "plain"),
    (4, 8, "asym", jnp.bfloat16, 32, 333, "nonfinite"),
    (2, 8, "asym_naive", jnp.bfloat16, 128, 5000, "zeros"),
    (3, 4, "asym", jnp.float32, 1024, 2049, "nonfinite"),
    (8, 4, "asym_naive", jnp.float16, 32, 250, "zeros"),
    # Long 8-bit vectors: a rounding-order slip in the rotation flips some codes (measured: stages
    # in reverse order change ~4000 of these 65541 sums), which short or 4-bit inputs rarely show.
    (4, 8, "sym", jnp.float32, 1024, 65541, "plain"),
    (2, 8, "asym", jnp.bfloat16, 128, 131149, "nonfinite"),
]


@pytest.mark.grid("P3-4b-sym-bfloat16-g32-n45-nonfinite", "P8-4b-asym-bfloat16-g1024-n3000-zeros",
                  "P4-8b-asym_naive-float16-g128-n100-plain")
@needs_call
@pytest.mark.parametrize("nranks,bits,policy,dtype,g,n,kind", CASES, ids=[
    f"P{c[0]}-{c[1]}b-{c[2]}-{jnp.dtype(c[3]).name}-g{c[4]}-n{c[5]}-{c[6]}" for c in CASES])
def test_fused_rotation_equals_xla_bit_for_bit(nranks, bits, policy, dtype, g, n, kind):
    cfg = ej.EchoConfig(bits=bits, group_size=g, policy=policy, rotation="hadamard",
                        transport="p2p")
    x = make_inputs(nranks, n, g, dtype, kind, seed=nranks * 1000 + n)
    got, hlo = run(cfg, x)
    want, ref_hlo = run(cfg.replace(transport="xla"), x)
    # The custom calls ran and rotated themselves (the compensated one fused): 1 + STEPS calls,
    # each with rotate = 1; the reference has none.
    calls = custom_calls(hlo)
    assert len(calls) == 1 + STEPS and all("rotate = 1 : i64" in c for c in calls), calls
    assert sum(cpu.TARGET_COMPENSATED in c for c in calls) == STEPS, calls
    assert not custom_calls(ref_hlo)
    names = ["y", "y_t", "m1", "m2"]
    for name, a, b in zip(names, got, want):
        assert_same_bits(a, b, name)
    y, ys, m1, m2 = got
    assert y.dtype == jnp.dtype(dtype) and ys.dtype == jnp.dtype(dtype)
    assert m1.dtype == np.float32 and m1.shape == (nranks, n)
    for r in range(1, nranks):  # every rank returns the same bits
        assert_same_bits(y[r], y[0], f"rank {r}")
        assert_same_bits(ys[r], ys[0], f"compensated, rank {r}")
    # The group with inf / NaN is NaN in the sum (all of it: the rotation spreads it), in every
    # later step (through the state) and nowhere else.
    bad = np.zeros(n, bool)
    if kind == "nonfinite":
        k = nonfinite_group(n, g) * g
        bad[k:k + g] = True
    for a in (y[0], *ys[0], m1[0], m2[0]):
        a = a.astype(np.float32)
        assert np.isnan(a[bad]).all() and np.isfinite(a[~bad]).all()
    assert np.any(m1[0][~bad] != 0)  # the compensated path ran


def opcodes(hlo):
    """The multiset of HLO opcodes of a compiled module (every computation)."""
    count = collections.Counter()
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = .*? ([a-z][\w\-]*)\(", line)
        if m:
            count[m.group(1)] += 1
    return count


@needs_call
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_compiled_program_holds_only_the_call(dtype):
    """rescale=False: the program of the rotated call is that of the unrotated one, op for op
    (no butterfly add/subtract, reshape, pad or sign constant around the call), the call
    carrying rotate = 1; the compensated call stays the fused one."""
    nranks, g, n = 4, 128, 1000
    cfg = ej.EchoConfig(rotation="hadamard", transport="p2p", group_size=g)
    x = make_inputs(nranks, n, g, dtype, "plain", seed=1)
    _, hlo = run(cfg, x)
    _, plain = run(cfg.replace(rotation="none"), x)
    assert opcodes(hlo) == opcodes(plain), (opcodes(hlo) - opcodes(plain),
                                            opcodes(plain) - opcodes(hlo))
    calls = custom_calls(hlo)
    assert len(calls) == 1 + STEPS
    assert sum(cpu.TARGET_COMPENSATED in c for c in calls) == STEPS
    assert all("rotate = 1 : i64" in c for c in calls)
    assert all("rotate = 0 : i64" in c for c in custom_calls(plain))
    # x enters the call in its own dtype (no fp32 copy around it), as without the rotation.
    dt = {jnp.float32: "f32", jnp.bfloat16: "bf16"}[dtype]
    assert all(re.search(rf"= \(?{dt}\[{n}\]", c) for c in calls), calls
    for op in ("all-to-all(", "all-gather(", "all-reduce("):
        assert op not in hlo


@pytest.mark.grid("bfloat16-4")
@needs_call
@pytest.mark.parametrize("dtype,bits", [(jnp.float32, 8), (jnp.bfloat16, 4), (jnp.float16, 4)])
def test_rescaled_rotation_stays_in_the_call(dtype, bits):
    """A rescaled rotated call keeps the rotation (and the compensator) in the call: the factor
    comes from x (aiming sqrt(g) lower) and multiplies x before the rotation, in the call as in
    the xla transport's JAX rotation, with the same bits."""
    nranks, g, n = 4, 64, 300
    cfg = ej.EchoConfig(rotation="hadamard", transport="p2p", group_size=g, bits=bits)
    # Small magnitudes, so that the factor is not 1. (Where the factor multiplies, before
    # or after the rotation, shows in the bits only for fp32 subnormals: XLA's CPU runtime
    # flushes them to zero, so no CPU test can tell the two orders apart.)
    x = (make_inputs(nranks, n, g, jnp.float32, "plain", seed=2) * 1e-4).astype(dtype)
    got, hlo = run(cfg, x, rescale=True)
    want, _ = run(cfg.replace(transport="xla"), x, rescale=True)
    calls = custom_calls(hlo)
    assert len(calls) == 1 + STEPS
    assert sum(cpu.TARGET_COMPENSATED in c for c in calls) == STEPS
    assert all("rotate = 1 : i64" in c for c in calls), calls
    for name, a, b in zip(["y", "y_t", "m1", "m2"], got, want):
        assert_same_bits(a, b, name)


def test_rotation_headroom_of_the_factor():
    # ceil(log2(g) / 2): a rotated value is at most sqrt(g) max |x|.
    heads = {g: collective.rotation_headroom_log2(ej.EchoConfig(group_size=g,
                                                                rotation="hadamard"))
             for g in (2, 4, 32, 64, 128, 1024)}
    assert heads == {2: 1, 4: 1, 32: 3, 64: 3, 128: 4, 1024: 5}
    assert collective.rotation_headroom_log2(ej.EchoConfig(group_size=128)) == 0
    f = jax.vmap(lambda v: collective.rescale_factor(v, "tp", True, 4), axis_name="tp")(
        jnp.full((2, 8), 3.0))
    assert float(f[0]) == 2.0 ** (9 - 2 - 4)  # max 3 = 0.75 * 2^2 lands in [16, 32)


class _Bare(transports.base.Transport):
    """A transport with the interface alone: no fused call, no rotation of its own."""

    name = "bare"

    def unavailable(self, axis_name=None, platform=None, devices=None):
        return None

    def limit_reason(self, config, num_elements, num_ranks):
        return None

    def allreduce(self, x_flat, axis, num_ranks, config, factor=None):
        raise AssertionError("not called")


def test_decisions():
    rot = ej.EchoConfig(rotation="hadamard")
    plain = ej.EchoConfig()
    bare = _Bare()
    CPU, XLA = transports.CPU, transports.XLA
    # The transports' own answers.
    assert cpu.fused_rotation(rot) and not xla.fused_rotation(rot)
    assert transports.has_fused_rotation(CPU, rot)
    assert not transports.has_fused_rotation(XLA, rot)
    assert not transports.has_fused_rotation(bare, rot)  # the interface's default: False
    # The one decision of echo_psum's plan (the rescaling does not enter it).
    modes = transports.call_modes
    assert modes(CPU, rot) == ("call", "none", ())
    assert modes(XLA, rot) == ("jax", "none", ())
    assert modes(bare, rot) == ("jax", "none", ())
    assert modes(CPU, plain) == ("none", "none", ())
    # Compensation stays fused with a fused rotation, with an fp32 state or a bfloat16 one (the
    # CPU call takes both); a transport without a fused call runs it in JAX.
    assert modes(CPU, rot, "float32")[:2] == ("call", "fused")
    assert modes(CPU, rot.replace(state_dtype="bfloat16"), "bfloat16")[:2] == ("call", "fused")
    assert modes(bare, rot, "float32")[:2] == ("jax", "jax")
    assert modes(bare, plain, "float32")[:2] == ("none", "jax")
    # A custom call that rotates in JAX (CUDA beyond its largest rotated group) says why, and
    # its compensator leaves the call.
    big = ej.EchoConfig(rotation="hadamard", group_size=2048)
    rotation, compensation, reasons = modes(transports.CUDA, big, "float32")
    assert (rotation, compensation) == ("jax", "jax")
    assert any("groups of 2048" in r for r in reasons)
    assert any("compensation in JAX" in r for r in reasons)


def _raw_call(nranks, n, cfg, **override):
    """The CPU custom call with the attributes of `cpu._check_call`, some replaced."""
    mesh = make_mesh((nranks,), ("tp",))

    def body(v):
        x = v[0]
        attrs = cpu._check_call("test", x, "tp", nranks, cfg)
        attrs.update(override)
        cpu._register("cpu")
        call = jax.ffi.ffi_call(cpu.TARGET, jax.ShapeDtypeStruct((n,), x.dtype),
                                vmap_method="sequential")
        coords = cpu._coords("tp")
        return call(x, coords, cpu.factor_operand(None, coords), **attrs)[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"),
                              check_vma=False))
    return f(put(jnp.ones((nranks, n)), mesh, P("tp")))


@needs_call
def test_handler_checks_the_rotate_attribute(monkeypatch):
    monkeypatch.setenv("ECHO_JAX_TIMEOUT_S", "5")
    cfg = ej.EchoConfig(bits=8, group_size=64, rotation="hadamard")
    np.testing.assert_allclose(np.asarray(_raw_call(2, 100, cfg, rotate=0)), 2.0, rtol=0.02)
    with pytest.raises(Exception, match=r"attribute 'rotate' .* must be in \[0, 1\], got 2"):
        np.asarray(_raw_call(2, 100, cfg, rotate=2))
    with pytest.raises(Exception, match="'rotate' is 1 but group_size=96 is not a power of two"):
        np.asarray(_raw_call(2, 100, cfg.replace(rotation="none", group_size=96), rotate=1))


@needs_call
@pytest.mark.parametrize("rescaled", [False, True])
def test_explicit_p2p_functions_with_rotation(rescaled):
    """`explicit.p2p_allreduce(_compensated)` with the rotation: the CPU call rotates itself (the
    compensated one fused), with or without a factor, with the bits of the vmap fallback (the
    xla transport's rotation, the factor on x before the rotation)."""
    nranks, g, n = 3, 32, 200
    cfg = ej.EchoConfig(bits=4, group_size=g, rotation="hadamard", transport="auto")
    mesh = make_mesh((nranks,), ("tp",))
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((nranks, n)) * 1e-3, jnp.float32)
    m = jnp.asarray(rng.standard_normal((2, nranks, n)) * 1e-4, jnp.float32)
    factor = jnp.float32(2.0 ** 12) if rescaled else None

    def entry_points(v, m1, m2):
        y = explicit.p2p_allreduce(v, "tp", nranks, cfg, factor=factor)
        yc, n1, n2 = explicit.p2p_allreduce_compensated(v, m1, m2, "tp", nranks, cfg, factor=factor)
        return y, yc, n1, n2

    def body(v, m1, m2):
        return tuple(as_varying(o)[None] for o in entry_points(v[0], m1[0], m2[0]))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"),) * 3,
                              out_specs=(P("tp"),) * 4))
    args = [put(a, mesh, P("tp")) for a in (x, m[0], m[1])]
    calls = custom_calls(f.lower(*args).compile().as_text())
    assert len(calls) == 2, calls
    assert all("rotate = 1 : i64" in c for c in calls)
    assert sum(cpu.TARGET_COMPENSATED in c for c in calls) == 1
    got = f(*args)
    want = jax.jit(jax.vmap(entry_points, axis_name="tp"))(x, m[0], m[1])  # the xla fallback
    for name, a, b in zip(["y", "y_c", "m1", "m2"], got, want):
        assert_same_bits(a, b, name)
    ref = jax.jit(jax.vmap(lambda v: xla.allreduce(v, "tp", nranks, cfg, factor=factor),
                           axis_name="tp"))(x)
    assert_same_bits(got[0], ref, "xla.allreduce")
    exact = np.asarray(x, np.float64).sum(0)
    assert np.abs(np.asarray(got[0])[0] - exact).max() < 0.2 * np.abs(exact).max()


@needs_call
def test_cpu_call_rotates_with_a_factor():
    """The transport's own function with rotate = 1 and a factor: the factor multiplies x
    before the rotation and divides the sum after the inverse rotation, the bits of
    `xla.allreduce` with the same arguments. The values (near 2^-110) lie below the wire
    format's 2^-100 scale floor unless multiplied by the factor (2^110), so the factor shows in
    the bits, and only the scaled sum is near the float64 one."""
    nranks, g, n = 2, 64, 300
    cfg = ej.EchoConfig(bits=8, group_size=g, rotation="hadamard")
    mesh = make_mesh((nranks,), ("tp",))
    x = jnp.asarray(np.random.default_rng(6).standard_normal((nranks, n)) * 2.0 ** -110,
                    jnp.bfloat16)
    factor = jnp.float32(2.0 ** 110)

    def body(v):
        return as_varying(cpu.allreduce(v[0], "tp", nranks, cfg, factor=factor))[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))
    xs = put(x, mesh, P("tp"))
    assert "rotate = 1 : i64" in f.lower(xs).compile().as_text()
    ref = jax.jit(jax.vmap(lambda v: xla.allreduce(v, "tp", nranks, cfg, factor=factor),
                           axis_name="tp"))(x)
    got = f(xs)
    assert_same_bits(got, ref)
    plain = jax.jit(jax.vmap(lambda v: xla.allreduce(v, "tp", nranks, cfg), axis_name="tp"))(x)
    assert not np.array_equal(uint_view(plain), uint_view(ref))
    exact = np.asarray(x, np.float64).sum(0)
    rel = [np.linalg.norm(np.asarray(v, np.float64)[0] - exact) / np.linalg.norm(exact)
           for v in (got, plain)]
    assert rel[0] < 0.02 < 0.5 < rel[1], rel


@needs_call
@pytest.mark.parametrize("bits,tol", [(8, 0.02), (4, 0.2)])
def test_fused_output_is_close_to_the_exact_sum(bits, tol):
    """Sanity, independent of the reference path: the fused rotated sum (with an outlier
    channel) is near the float64 sum, and nearer than the unrotated one at 4 bits."""
    nranks, g, n = 4, 128, 4000
    cfg = ej.EchoConfig(bits=bits, group_size=g, rotation="hadamard", transport="p2p")
    x = make_inputs(nranks, n, g, jnp.float32, "plain", seed=bits)
    exact = np.asarray(x, np.float64).sum(0)
    (y, ys, _, _), _ = run(cfg, x)
    rel = lambda a, b: np.linalg.norm(a - b) / np.linalg.norm(b)  # noqa: E731
    err = rel(y[0].astype(np.float64), exact[0])
    assert err < tol, err
    for t in range(STEPS):  # the compensated calls too
        assert rel(ys[0, t].astype(np.float64), exact[t]) < tol
    (y0, _, _, _), _ = run(cfg.replace(rotation="none"), x)
    err0 = rel(y0[0].astype(np.float64), exact[0])
    assert err0 > 0 and err != err0
    if bits == 4:
        assert err < err0, (err, err0)


@needs_call
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_bfloat16_state_with_the_rotation_in_the_call(dtype):
    """A bfloat16 state runs in the fused call, which rotates itself (rotate = 1): apply,
    rotate, protocol, unrotate and update inside it, with the xla transport's bits (y and
    state)."""
    nranks, g, n = 3, 64, 500
    cfg = ej.EchoConfig(rotation="hadamard", transport="p2p", group_size=g,
                        state_dtype="bfloat16")
    x = make_inputs(nranks, n, g, dtype, "plain", seed=9)
    got, hlo = run(cfg, x)
    want, _ = run(cfg.replace(transport="xla"), x)
    calls = custom_calls(hlo)
    assert len(calls) == 1 + STEPS and all("rotate = 1 : i64" in c for c in calls), calls
    assert sum(f'custom_call_target="{cpu.TARGET_COMPENSATED}"' in c for c in calls) == STEPS
    assert got[2].dtype == np.dtype(jnp.bfloat16)
    for name, a, b in zip(["y", "y_t", "m1", "m2"], got, want):
        assert_same_bits(a, b, name)
