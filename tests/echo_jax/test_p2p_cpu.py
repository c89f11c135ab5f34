"""The Echo custom call ("p2p" transport) on fake CPU devices: the real C++ protocol, host threads.

Every result is compared bit for bit with the pure-JAX reference (`collective.xla_allreduce`,
`compensator`), on every rank. Runs with XLA_FLAGS=--xla_force_host_platform_device_count=8
(tests/conftest.py sets it).
"""

import functools
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import echo_jax as ej
from conftest import as_varying
from echo_jax import collective
from echo_jax import compensator as comp
from echo_jax import policies, quant, transports
from echo_jax.transports import explicit
from echo_jax.transports import cpu, cuda
from echo_jax.transports.base import TIMEOUT_ENV, build_mismatch, runtime_ffi_api

POLICIES = policies.NAMES  # ("asym", "sym", "asym_naive")
CONFIGS = [(b, p) for b in (4, 8) for p in POLICIES]
SIZES = (1, 127, 1000, 4099)
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)

pytestmark = pytest.mark.skipif(
    "cpu" not in cpu.available_platforms(),
    reason="echo_jax._ffi (the compiled custom call) is not built")


def mesh_of(shape, names):
    n = int(np.prod(shape))
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    return Mesh(np.array(jax.devices()[:n]).reshape(shape), names)


def put(x, mesh, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def bits_of(a):
    return np.asarray(a, np.float32).view(np.uint32)


def assert_same_bits(got, want, what=""):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    nan_g, nan_w = np.isnan(got), np.isnan(want)
    np.testing.assert_array_equal(nan_g, nan_w, err_msg=f"{what}: NaN positions differ")
    diff = (bits_of(got) != bits_of(want)) & ~nan_w
    if diff.any():
        idx = np.argwhere(diff)[:5]
        raise AssertionError(f"{what}: {diff.sum()} elements differ, e.g. at {idx.tolist()}: "
                             f"{got[tuple(idx.T)]} vs {want[tuple(idx.T)]}")


def assert_same_on_every_rank(y, what=""):
    """y: [P, ...] per-rank results."""
    y = np.asarray(y, np.float32)
    for r in range(1, y.shape[0]):
        assert_same_bits(y[r], y[0], f"{what}: rank {r} vs rank 0")


def rng_inputs(seed, num_ranks, n, dtype, scale=1.0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((num_ranks, n)) * scale
    x[:, ::7] = np.abs(x[:, ::7]) + 0.5          # one-sided stretches and zero-straddling groups
    return np.asarray(x, np.float32).astype(dtype)


# -------------------------------------------------------------------------------------------
# The shared C++ quantizer (ffi/echo_common.h) against quant.py.
# -------------------------------------------------------------------------------------------

def edge_groups(g):
    rng = np.random.default_rng(1)
    base = [np.zeros(g), np.full(g, 1.5), np.full(g, -2.25), np.full(g, 3e-6),
            np.full(g, 1e5), np.full(g, -7e4), np.linspace(-1, 1, g), np.linspace(1, 2, g),
            np.linspace(-3, -2, g), np.linspace(-0.01, 1, g), np.linspace(-1, 0.02, g),
            np.linspace(0, 1e-6, g), np.linspace(-3e-8, 5e-8, g), np.linspace(6e4, 6.5e4, g),
            np.linspace(-1e9, 1e9, g), np.linspace(1000.0, 1000.001, g),
            np.where(np.arange(g) % 2, 1.0, -0.0),
            # The bf16 scale: ties of a constant group's rounding (to even, and up), ranges up to
            # 2^127, the 2^126 limit (NaN at it, finite below), the 2^-100 floor.
            np.full(g, 1.00390625), np.full(g, -1.01171875), np.linspace(-1e37, 3e37, g),
            np.linspace(-8.5e37, 8.5e37, g), np.full(g, 2.0 ** 126),
            np.where(np.arange(g) == 1, 2.0 ** 126, 1.0), np.linspace(-3e-30, 1e-30, g),
            np.linspace(5e-31, 6e-31, g)]
    # Outlier groups that straddle zero by a fraction of a step (the zero-aware policy's case):
    # one value of +-300, the rest near zero, and the same with zero at an exact grid fraction.
    for sign in (1.0, -1.0):
        out = rng.uniform(-0.5, 0.5, g)
        out[g // 3] = sign * 300.0
        base.append(out)
        base.append(np.where(np.arange(g) == 0, sign * 15.0, -sign * 0.49))
    special = []
    for v in (np.nan, np.inf, -np.inf):
        s = rng.standard_normal(g)
        s[g // 2] = v
        special.append(s)
    rand = [rng.standard_normal(g) * 10.0 ** rng.integers(-6, 4) + rng.standard_normal()
            for _ in range(200)]
    return np.stack(base + special + rand).astype(np.float32)


def signed_zero_and_subnormal_groups(g):
    """Groups whose minimum or maximum is decided between +0 and -0 or among fp32 subnormals
    (flushed to zero by XLA:CPU): XLA's own min/max reductions give a shape-dependent sign of
    zero there, so only the values (not the sign bit of a zero scale) are compared."""
    return np.stack([np.where(np.arange(g) % 2, 0.0, -0.0),
                     np.where(np.arange(g) < g // 2, 0.0, -0.0), np.full(g, 1e-40),
                     np.linspace(-1e-38, 1e-38, g)]).astype(np.float32)


def test_built_against_the_runtime_jaxlib():
    """The custom-call modules were compiled against the XLA FFI headers of the jaxlib they run
    with (CMakeLists.txt takes the installed jaxlib's; reinstall after changing jaxlib)."""
    import jaxlib

    modules = {"echo_jax._ffi": cpu.build_info(), "echo_jax._ffi_cuda": cuda.build_info()}
    for name, info in modules.items():
        if not info:
            continue  # the CUDA handlers are built only where nvcc is found
        assert len(info["xla_ffi_api"]) == 2, (name, info)
        if info["jaxlib"] == "unknown":
            pytest.skip(f"{name} was built without recording its headers' jaxlib (not CMake)")
        assert info["jaxlib"] == jaxlib.__version__, (
            f"{name} was compiled against the FFI headers of jaxlib {info['jaxlib']} but runs "
            f"with jaxlib {jaxlib.__version__}: reinstall (pip install -e .)")
        assert tuple(info["xla_ffi_api"]) == runtime_ffi_api(), (name, info)
        assert build_mismatch(info, name) is None


def test_a_module_the_runtime_refuses_falls_back_with_the_reason(monkeypatch):
    """A module built against a newer jaxlib's FFI headers than the runtime's is refused by XLA
    at registration (seen: a jaxlib 0.12 build under jaxlib 0.11.2). The custom call then counts
    as unavailable: "auto" runs "xla" (the same bits), "p2p" says why and what to do."""
    major, minor = runtime_ffi_api()
    newer = {"jaxlib": "99.0", "xla_ffi_api": (major, minor + 1)}
    assert build_mismatch({"jaxlib": "x", "xla_ffi_api": (major, minor)}, "m") is None
    if minor > 0:  # older headers: XLA accepts them (a jaxlib 0.11.2 build runs under 0.12)
        assert build_mismatch({"jaxlib": "x", "xla_ffi_api": (major, minor - 1)}, "m") is None
    assert build_mismatch({"jaxlib": "x", "xla_ffi_api": (major + 1, 0)}, "m") is not None
    monkeypatch.setattr(cpu, "build_info", lambda: newer)  # the CPU transport's own check
    reason = transports.unavailable_reason("tp")
    assert "jaxlib 99.0" in reason and "pip install --force-reinstall --no-deps -e ." in reason
    with pytest.warns(transports.EchoFallbackWarning, match="rebuilt against its headers"):
        transports.reset_fallback_warnings()
        assert transports.resolve(ej.EchoConfig(transport="auto"), "tp", honor_env=False) == "xla"
    with pytest.raises(ValueError, match="rebuilt against its headers"):
        transports.resolve(ej.EchoConfig(transport="p2p"), "tp", honor_env=False)


@pytest.mark.parametrize("g", [2, 8, 128])
def test_cpp_quantizer_matches_reference(g):
    from echo_jax import _ffi
    exact = edge_groups(g)
    x = np.concatenate([exact, signed_zero_and_subnormal_groups(g)])
    k = len(exact)
    quantize = jax.jit(quant.quantize_groups, static_argnums=(1, 2))
    dequantize = jax.jit(quant.dequantize_groups, static_argnums=(2, 3))
    for bits, policy in CONFIGS:
        code = cpu.POLICY_CODES[policy]
        # XLA:CPU runs with subnormals flushed; so do the handlers (they replay XLA's FP env).
        packed, params = _ffi.quantize_groups(x, bits, code, flush_denormals=True)
        ref_packed, ref_params = quantize(x, bits, policy)
        ref_packed, ref_params = np.asarray(ref_packed), np.asarray(ref_params).view(np.uint16)
        np.testing.assert_array_equal(packed[:k], ref_packed[:k], err_msg=f"{bits} {policy}")
        np.testing.assert_array_equal(params[:k], ref_params[:k], err_msg=f"{bits} {policy}")
        out = _ffi.dequantize_groups(packed, params, g, bits, code, flush_denormals=True)
        ref = np.asarray(dequantize(ref_packed, ref_params, bits, policy))
        assert_same_bits(out[:k], ref[:k], f"dequantize {bits} {policy}")
        np.testing.assert_array_equal(out[k:], ref[k:])  # values only: -0 == +0


def test_cpp_f16_conversion_matches_numpy():
    from echo_jax import _ffi
    rng = np.random.default_rng(2)
    u = np.concatenate([rng.integers(0, 2 ** 32, 2 ** 20, dtype=np.uint64).astype(np.uint32),
                        np.arange(0x33000000 - 8, 0x38800000 + 8, 97, dtype=np.uint32),
                        np.arange(0x477FE000, 0x47800010, dtype=np.uint32)])
    u = np.concatenate([u, u | np.uint32(0x80000000)])
    f = u.view(np.float32)
    got = _ffi.f32_to_f16_bits(u)[0]
    with np.errstate(over="ignore"):
        want = f.astype(np.float16).view(np.uint16)
    finite = np.isfinite(f)
    np.testing.assert_array_equal(got[finite], want[finite])
    assert np.all((got[~finite] & 0x7C00) == 0x7C00)


def conversion_patterns():
    """fp32 bit patterns for the 16-bit stores: random ones, every tie and near-tie around the
    bf16 and fp16 rounding points of a few binades, the overflow edges of both formats, fp32 and
    fp16 subnormals, infinities, and quiet and signalling NaNs of both signs with payloads."""
    rng = np.random.default_rng(3)
    parts = [rng.integers(0, 2 ** 32, 2 ** 18, dtype=np.uint64).astype(np.uint32)]
    for top in (0x3F80, 0x4B00, 0x0080, 0x0001, 0x7F7F, 0x477F, 0x3380, 0x3880):
        parts.append((np.uint32(top) << 16) + np.arange(0, 0x10000, 0x1F, dtype=np.uint32))
        parts.append((np.uint32(top) << 16) + np.array([0x7FFF, 0x8000, 0x8001, 0x17FFF,
                                                         0x18000, 0x18001], np.uint32))
    parts.append(np.arange(0x7F7F0000, 0x7F800001, 0x101, dtype=np.uint32))  # bf16 overflow
    parts.append(np.arange(0x477FE000, 0x47800010, dtype=np.uint32))         # fp16 overflow
    parts.append(np.arange(0, 0x00020000, 0x7, dtype=np.uint32))             # fp32 subnormals
    parts.append(np.arange(0x33000000 - 8, 0x38800000 + 8, 97, dtype=np.uint32))  # fp16 subn.
    parts.append(np.array([0x7F800000, 0x7F800001, 0x7F800100, 0x7FA00000, 0x7FBFFFFF,
                           0x7FC00000, 0x7FC00001, 0x7FC10000, 0x7FE00000, 0x7FFFFFFF,
                           0x7F810000, 0x7F80FFFF, 0x7FFF8000, 0x7FFF0000], np.uint32))
    u = np.concatenate(parts)
    return np.concatenate([u, u | np.uint32(0x80000000)])


@functools.lru_cache(maxsize=None)
def _xla_convert(dtype):
    """XLA:CPU's own convert of fp32 bit patterns to `dtype`, bits in and out (no host casts)."""
    bits16 = lambda v: lax.bitcast_convert_type(  # noqa: E731
        lax.bitcast_convert_type(v, jnp.float32).astype(dtype), jnp.uint16)
    return jax.jit(bits16)


def test_cpp_bf16_conversion_matches_xla_bit_for_bit():
    """The CPU handler's bf16 store (ffi/echo_common.h f32_to_bf16) rounds exactly like XLA's
    convert: every finite value, overflow to inf, subnormals, and the bits of every NaN (the
    tests of the 16-bit all-reduce compare bits, NaNs included)."""
    from echo_jax import _ffi
    u = conversion_patterns()
    got = _ffi.f32_to_bf16_bits(u)[0]
    want = np.asarray(_xla_convert(jnp.bfloat16)(u))
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, [(hex(u[i]), hex(got[i]), hex(want[i])) for i in bad[:8]]
    # The software fp16 store agrees with XLA's convert as well, NaN bits included.
    got16 = _ffi.f32_to_f16_bits(u)[0]
    want16 = np.asarray(_xla_convert(jnp.float16)(u))
    bad = np.flatnonzero(got16 != want16)
    assert bad.size == 0, [(hex(u[i]), hex(got16[i]), hex(want16[i])) for i in bad[:8]]


# -------------------------------------------------------------------------------------------
# The all-reduce against xla_allreduce.
# -------------------------------------------------------------------------------------------

def run_both(num_ranks, configs, inputs):
    """Runs p2p_allreduce (one jitted shard_map over num_ranks devices) and the pure-JAX
    reference xla_allreduce (one jitted vmap: P simulated ranks on one device, which
    test_collective checks to equal its shard_map form bit for bit) on the same fp32 inputs.

    configs[i] reduces inputs[i] ([P, ...] in any float dtype, flattened and cast to fp32 inside).
    Returns two lists of [P, n] per-rank results.
    """
    mesh = mesh_of((num_ranks,), ("tp",))

    def body(*xs):
        outs = []
        for i, (cfg, x) in enumerate(zip(configs, xs)):
            flat = jnp.ravel(x[0]).astype(jnp.float32)
            got = explicit.p2p_allreduce(flat, "tp", num_ranks, cfg)
            if i == 0:  # typed like the reference (trace only: the value is not used)
                want = collective.xla_allreduce(flat, "tp", num_ranks, cfg)
                assert jax.typeof(got).mat == jax.typeof(want).mat
            outs.append(as_varying(got, ("tp",))[None])
        return tuple(outs)

    def ref(*xs):
        return tuple(collective.xla_allreduce(jnp.ravel(x).astype(jnp.float32), "tp", num_ranks,
                                              cfg) for cfg, x in zip(configs, xs))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"),) * len(configs),
                              out_specs=(P("tp"),) * len(configs)))
    got = f(*[put(x, mesh, P("tp")) for x in inputs])
    want = jax.jit(jax.vmap(ref, axis_name="tp"))(*[jnp.asarray(x) for x in inputs])
    return [np.asarray(v) for v in got], [np.asarray(v) for v in want]


@pytest.mark.grid("3", "8")
@pytest.mark.parametrize("num_ranks", [2, 3, 4, 8])
def test_allreduce_matches_xla_bit_for_bit(num_ranks):
    """Every (bits, policy) and every odd size per P; the size and the input dtype rotate with P
    so that every (config, size) pair runs once across the four values of P."""
    shift = {2: 0, 3: 1, 4: 2, 8: 3}[num_ranks]
    cases = [(bits, policy, SIZES[(ci + shift) % len(SIZES)], DTYPES[(ci + 2 * shift) % 3])
             for ci, (bits, policy) in enumerate(CONFIGS)]
    assert {c[2] for c in cases} == set(SIZES) and {c[3] for c in cases} == set(DTYPES)
    inputs = [rng_inputs(100 * i + num_ranks, num_ranks, n, dt) for i, (_, _, n, dt)
              in enumerate(cases)]
    configs = [ej.EchoConfig(bits=bits, policy=policy, transport="p2p")
               for bits, policy, _, _ in cases]
    got, want = run_both(num_ranks, configs, inputs)
    for i, (bits, policy, n, dt) in enumerate(cases):
        what = f"P={num_ranks} bits={bits} {policy} n={n} {jnp.dtype(dt).name}"
        assert got[i].shape == (num_ranks, n)
        assert_same_on_every_rank(got[i], what)
        assert_same_bits(got[i], want[i], what)
        exact = np.asarray(inputs[i], np.float32).sum(0)
        bound = 0.25 * num_ranks * np.abs(exact).max() + 1e-6
        assert np.all(np.abs(got[i][0] - exact) <= bound), what


def test_other_group_sizes():
    num_ranks = 3
    cases = [(2, 4, "asym"), (2, 8, "sym"), (30, 4, "sym"), (30, 8, "asym_naive"),
             (64, 4, "asym_naive"), (64, 8, "asym")]
    x = rng_inputs(7, num_ranks, 301, np.float32)
    configs = [ej.EchoConfig(bits=bits, policy=policy, group_size=g) for g, bits, policy in cases]
    got, want = run_both(num_ranks, configs, [x] * len(cases))
    for i, (g, bits, policy) in enumerate(cases):
        assert_same_on_every_rank(got[i], f"g={g} {bits} {policy}")
        assert_same_bits(got[i], want[i], f"g={g} {bits} {policy}")


def test_non_finite_and_range_limit_match_reference():
    num_ranks = 4
    n = 1500
    x = rng_inputs(3, num_ranks, n, np.float32)
    x[0, 5] = np.nan                  # group 0 of segment 0
    x[1, 400] = np.inf                # a group of segment 1 (its owner sums inf)
    x[2, 401] = -np.inf               # same group: inf - inf = NaN in the sum
    x[3, 900] = np.inf
    x[3, 1100:1110] = 3e9             # far beyond fp16's range: finite (bf16 scales)
    x[2, 1200:1210] = 1e-30           # tiny values at the 2^-100 scale floor: finite
    x[1, 1300:1310] = 1e38            # past the 2^126 limit: NaN, never finite garbage
    x[0, 1410:1420] = 1e-40           # fp32 subnormal inputs
    configs = [ej.EchoConfig(bits=bits, policy=policy) for bits, policy in CONFIGS]
    got, want = run_both(num_ranks, configs, [x] * len(configs))
    for i, (bits, policy) in enumerate(CONFIGS):
        assert_same_on_every_rank(got[i], f"{bits} {policy}")
        assert_same_bits(got[i], want[i], f"non-finite {bits} {policy}")
        assert np.isnan(got[i][0, 0:128]).all()          # the NaN poisons its whole group
        assert np.isnan(got[i][0, 384:512]).all()        # inf + (-inf)
        assert np.isnan(got[i][0, 1280:1408]).all()      # the group past the range limit
        assert np.isfinite(got[i][0, 128:384]).all()     # untouched groups stay finite
        assert np.isfinite(got[i][0, 1024:1280]).all()   # 3e9 and the tiny values


# -------------------------------------------------------------------------------------------
# Compensated call against apply_correction + xla_allreduce + update_state.
# -------------------------------------------------------------------------------------------

@pytest.mark.grid("3")
@pytest.mark.parametrize("num_ranks", [2, 3, 4])
def test_compensated_matches_reference(num_ranks):
    mesh = mesh_of((num_ranks,), ("tp",))
    n = 1000
    rng = np.random.default_rng(num_ranks)
    x = rng_inputs(11, num_ranks, n, np.float32)
    m1 = (rng.standard_normal((num_ranks, n)) * 0.05).astype(np.float32)
    m2 = (rng.standard_normal((num_ranks, n)) * 0.05).astype(np.float32)
    # Every (bits, policy) for two of the three P, and non-default coefficients.
    shift = {2: 0, 3: 2, 4: 4}[num_ranks]
    configs = [ej.EchoConfig(bits=b, policy=p)
               for b, p in (CONFIGS + CONFIGS)[shift:shift + 4]]
    configs.append(ej.EchoConfig(bits=4, eta=0.5, blend=0.8, beta1=0.9, beta2=0.1))

    def body(x, m1, m2):
        x, m1, m2 = x[0], m1[0], m2[0]
        outs = []
        for cfg in configs:
            y, n1, n2 = explicit.p2p_allreduce_compensated(x, m1, m2, "tp", num_ranks, cfg)
            k = comp.Coefficients.from_config(cfg)
            state = comp.CompensatorState(m1, m2)
            xp = comp.apply_correction(x, state, k)
            ry = collective.xla_allreduce(xp, "tp", num_ranks, cfg)
            rs = comp.update_state(xp, ry, num_ranks, state, k)
            for a, b in ((y, ry), (n1, rs.m1), (n2, rs.m2)):
                assert jax.typeof(a).mat == jax.typeof(b).mat
                outs += [as_varying(a, ("tp",))[None], as_varying(b, ("tp",))[None]]
        return tuple(outs)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"),) * 3,
                              out_specs=(P("tp"),) * (6 * len(configs))))
    res = f(*[put(a, mesh, P("tp")) for a in (x, m1, m2)])
    for i, cfg in enumerate(configs):
        what = f"P={num_ranks} {cfg.bits} {cfg.policy} eta={cfg.eta}"
        assert_same_on_every_rank(res[6 * i], what + " y")
        for j, name in enumerate(("y", "m1", "m2")):
            assert_same_bits(res[6 * i + 2 * j], res[6 * i + 2 * j + 1], f"{what} {name}")


def test_compensated_state_updated_in_place_under_donation():
    """Aliased state buffers: donate m1/m2 into a jitted loop of compensated calls."""
    num_ranks = 2
    mesh = mesh_of((num_ranks,), ("tp",))
    n = 513
    x = rng_inputs(5, num_ranks, n, np.float32)
    cfg = ej.EchoConfig(bits=4)

    def run(fn):
        def body(x, m1, m2):
            def step(_, c):
                y, a, b = fn(x[0], c[0], c[1])
                return (a, b, as_varying(y, ("tp",)))
            z = jnp.zeros((n,), jnp.float32)
            a, b, y = lax.fori_loop(0, 5, step, (m1[0], m2[0], z * x[0]))
            return tuple(as_varying(v, ("tp",))[None] for v in (a, b, y))
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"),) * 3,
                                     out_specs=(P("tp"),) * 3), donate_argnums=(1, 2))

    def ref(x, m1, m2):
        k = comp.Coefficients.from_config(cfg)
        s = comp.CompensatorState(m1, m2)
        xp = comp.apply_correction(x, s, k)
        y = collective.xla_allreduce(xp, "tp", num_ranks, cfg)
        s = comp.update_state(xp, y, num_ranks, s, k)
        return y, s.m1, s.m2

    zeros = lambda: put(np.zeros((num_ranks, n), np.float32), mesh, P("tp"))  # noqa: E731
    xs = put(x, mesh, P("tp"))
    got = run(lambda x, a, b: explicit.p2p_allreduce_compensated(x, a, b, "tp", num_ranks, cfg))(
        xs, zeros(), zeros())
    want = run(ref)(xs, zeros(), zeros())
    for a, b, name in zip(got, want, ("m1", "m2", "y")):
        assert_same_bits(a, b, name)


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16", "int8"])
def test_compensated_sites_in_a_scan_update_the_state_without_copies(state_dtype):
    """A model's pass: a scan over compensated sites, the state as the carry, an N-D
    contribution. The compiled loop runs the fused call once a site and no copy of the state: the
    call updates m1, m2 in place in the carry's buffers. (With the state reshaped to a flat array
    around the call, XLA copied m1 and m2 before and after every call: four copies a site, more
    memory traffic than the fused update itself.) The sums and the states equal the xla
    transport's (the int8 state: its codes and scales, in their own call)."""
    num_ranks, sites, shape = 4, 5, (6, 256)
    mesh = mesh_of((num_ranks,), ("tp",))
    xs = put(jax.random.normal(jax.random.key(11), (num_ranks, sites) + shape), mesh, P("tp"))

    def program(transport):
        cfg = ej.EchoConfig(bits=4, transport=transport, state_dtype=state_dtype)

        def per_rank(x):
            s0 = ej.init_state(x[0, 0], cfg)
            s0 = jax.tree.map(lambda m: as_varying(m, ("tp",)), s0)

            def site(s, xk):
                y, s = ej.echo_psum(xk, "tp", config=cfg, state=s, rescale=False)
                return s, as_varying(y, ("tp",))
            s, ys = lax.scan(site, s0, x[0])
            return ys[None], *(jax.tree.map(lambda a: a[None], m) for m in s)
        return jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=P("tp"),
                                     out_specs=(P("tp"),) * 3))

    compiled = program("p2p").lower(xs).compile()
    text = compiled.as_text()
    name = cpu.TARGET_COMPENSATED_Q8 if state_dtype == "int8" else cpu.TARGET_COMPENSATED
    target = f'custom_call_target="{name}"'
    loop = [c for c in re.split(r"\n(?=\S)", text) if target in c]
    assert len(loop) == 1, "the fused call is not in exactly one computation (the loop body)"
    body = loop[0]
    assert body.count(target) == 1
    state_type = {"float32": "f32", "bfloat16": "bf16", "int8": "(?:s8|f32)"}[state_dtype]
    copies = [ln.strip() for ln in body.splitlines()
              if re.search(rf"= {state_type}\[[\d,]*\][^=]*\bcopy\(", ln)
              or re.search(r"= \S+ fusion\(.*calls=%\S*copy", ln)]
    assert not copies, f"the state is copied in the loop body: {copies}"
    # Copies hide in fusions too: no fused computation called from the body may be a copy.
    called = set(re.findall(r"calls=(%[\w.\-]+)", body))
    for comp_text in re.split(r"\n(?=\S)", text):
        name = comp_text.split(" ", 1)[0]
        if name in called:
            assert not re.search(r"ROOT \S+ = \S+ copy\(", comp_text), \
                f"{name}, called from the loop body, is a copy: {comp_text[:300]}"
    got, want = compiled(xs), program("xla")(xs)
    names = ("y", "m1", "m2") if state_dtype != "int8" else ("y", "m1 codes", "m1 scales",
                                                             "m2 codes", "m2 scales")
    for a, b, what in zip(jax.tree.leaves(got), jax.tree.leaves(want), names, strict=True):
        assert_same_bits(a, b, what)


# -------------------------------------------------------------------------------------------
# 16-bit contributions: bfloat16 / float16 enter and leave the custom call in their own dtype.
# -------------------------------------------------------------------------------------------

HALF_DTYPES = (jnp.bfloat16, jnp.float16)


def bits16(a):
    """uint16 view of a bfloat16 / float16 array: NaN bits count in a comparison."""
    a = np.asarray(a)
    assert a.dtype.itemsize == 2, a.dtype
    return a.view(np.uint16)


def assert_same_bits16(got, want, what=""):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype,
                                                                 got.shape, want.shape)
    g, w = bits16(got), bits16(want)
    bad = np.argwhere(g != w)
    if bad.size:
        idx = tuple(bad[:5].T)
        raise AssertionError(f"{what}: {len(bad)} elements differ, e.g. at {bad[:5].tolist()}: "
                             f"{[hex(v) for v in g[idx]]} vs {[hex(v) for v in w[idx]]}")


def half_inputs(seed, num_ranks, n, dtype):
    """[P, n] contributions in `dtype` with, for n >= 1000, a NaN, +-inf in one group (its sum is
    NaN), values at the ends of the range (fp16: each rank's 6e4 sums past 65504 to inf on the
    way back; bf16: 3e38 is past the wire format's 2^126 limit, so its group is NaN), tiny values
    whose sum is a float16 subnormal, and bf16 / fp16 subnormal inputs."""
    x = rng_inputs(seed, num_ranks, n, np.float32)
    if n >= 1000:
        x[0, 5] = np.nan
        x[1 % num_ranks, 300] = np.inf
        x[2 % num_ranks, 301] = -np.inf
        if dtype == jnp.float16:
            x[:, 520:530] = 6e4
            x[:, 640:768] *= 3e-7                 # a whole group around fp16's subnormals
            x[num_ranks - 1, 800:810] = 3e-6      # fp16 subnormal inputs
        else:
            x[num_ranks - 1, 520:530] = 3e38
            x[:, 640:768] *= 1e-30
            x[num_ranks - 1, 800:810] = 3e-39     # bf16 (and fp32) subnormal inputs
    with np.errstate(over="ignore"):
        return np.asarray(jnp.asarray(x).astype(dtype))


@pytest.mark.grid("3")
@pytest.mark.parametrize("num_ranks", [2, 3, 4, 8])
def test_16bit_contributions_enter_the_call_and_match_xla_bit_for_bit(num_ranks):
    """p2p_allreduce / p2p_allreduce_compensated take a bfloat16 or float16 x as it is and return
    the sum in x's dtype with the bits of the reference x.astype(f32) -> protocol in fp32 ->
    y32.astype(dtype) (the state updated with y32), NaN bits included, on every rank; odd sizes
    (no multiple of g or P*g), special values, every (bits, policy) across the four P."""
    mesh = mesh_of((num_ranks,), ("tp",))
    shift = {2: 0, 3: 1, 4: 2, 8: 3}[num_ranks]
    sizes = (1001, 127, 4099, 1)                 # every case runs each size once across P
    cases = []                                   # (dtype, n, compensated, config)
    for i, (dt, compensated) in enumerate((d, c) for d in HALF_DTYPES for c in (False, True)):
        bits, policy = CONFIGS[(i + 2 * shift) % len(CONFIGS)]
        n = sizes[(i + shift) % len(sizes)]
        cases.append((dt, n, compensated, ej.EchoConfig(bits=bits, policy=policy)))
    inputs = [half_inputs(10 * i + num_ranks, num_ranks, n, dt)
              for i, (dt, n, _, _) in enumerate(cases)]
    rng = np.random.default_rng(num_ranks)
    states = [(rng.standard_normal((num_ranks, n)) * 0.05).astype(np.float32)
              for _, n, _, _ in cases for _ in range(2)]

    def body(*args):
        xs, ms = args[:len(cases)], args[len(cases):]
        outs = []
        for i, ((dt, n, compensated, cfg), x) in enumerate(zip(cases, xs)):
            x = x[0]
            assert x.dtype == dt
            if not compensated:
                got = explicit.p2p_allreduce(x, "tp", num_ranks, cfg)
                want = collective.xla_allreduce(x.astype(jnp.float32), "tp", num_ranks,
                                                cfg).astype(dt)
                pairs = [(got, want)]
            else:
                m1, m2 = ms[2 * i][0], ms[2 * i + 1][0]
                got, n1, n2 = explicit.p2p_allreduce_compensated(x, m1, m2, "tp", num_ranks, cfg)
                k = comp.Coefficients.from_config(cfg)
                state = comp.CompensatorState(m1, m2)
                xp = comp.apply_correction(x.astype(jnp.float32), state, k)
                y32 = collective.xla_allreduce(xp, "tp", num_ranks, cfg)
                new = comp.update_state(xp, y32, num_ranks, state, k)
                pairs = [(got, y32.astype(dt)), (n1, new.m1), (n2, new.m2)]
            assert got.dtype == dt, (got.dtype, dt)
            for a, b in pairs:
                assert jax.typeof(a).mat == jax.typeof(b).mat
                outs += [as_varying(a, ("tp",))[None], as_varying(b, ("tp",))[None]]
        return tuple(outs)

    n_out = sum(6 if c else 2 for _, _, c, _ in cases)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"),) * (len(cases) + len(states)),
                              out_specs=(P("tp"),) * n_out))
    res = iter(f(*[put(a, mesh, P("tp")) for a in inputs + states]))
    for dt, n, compensated, cfg in cases:
        what = (f"P={num_ranks} {jnp.dtype(dt).name} n={n} bits={cfg.bits} {cfg.policy}"
                f"{' compensated' if compensated else ''}")
        got, want = np.asarray(next(res)), np.asarray(next(res))
        assert got.dtype == jnp.dtype(dt) and got.shape == (num_ranks, n), (what, got.dtype)
        assert_same_bits16(got, want, what)
        for r in range(1, num_ranks):
            assert_same_bits16(got[r], got[0], f"{what}: rank {r} vs rank 0")
        if n >= 1000:  # the special values reached the output
            y = got[0].astype(np.float32)
            assert np.isnan(y[0:128]).all() and np.isnan(y[256:384]).all(), what
            if dt == jnp.float16:
                assert np.isinf(y[520:530]).all(), what          # overflowed on the way back
                if not compensated:                              # (the state shifts x')
                    assert (np.abs(y[640:768]) < 2.0 ** -14).any(), what  # fp16 subnormals
            else:
                assert np.isnan(y[512:640]).all(), what
        if compensated:
            for name in ("m1", "m2"):
                assert_same_bits(next(res), next(res), f"{what} {name}")


def _echo_psum_16bit(mesh, num_ranks, transport, compensated, x, m1, m2, cfg_kw,
                     rescale="auto"):
    """echo_psum over 'tp' (and its gradient); returns the jitted function and its args."""
    cfg = ej.EchoConfig(transport=transport, **cfg_kw)

    def body(v, a, b):
        if compensated:
            y, s = ej.echo_psum(v[0], "tp", config=cfg, state=ej.CompensatorState(a[0], b[0]),
                                rescale=rescale)
            return (as_varying(y, ("tp",))[None], as_varying(s.m1, ("tp",))[None],
                    as_varying(s.m2, ("tp",))[None])
        y = ej.echo_psum(v[0], "tp", config=cfg, rescale=rescale)
        return as_varying(y, ("tp",))[None], a, b

    def loss(v, a, b):
        y = jax.shard_map(body, mesh=mesh, in_specs=(P("tp"),) * 3,
                          out_specs=(P("tp"),) * 3)(v, a, b)[0]
        return jnp.sum(jnp.sin(y.astype(jnp.float32)) * jnp.arange(y.shape[-1]))

    fwd = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"),) * 3,
                                out_specs=(P("tp"),) * 3))
    return fwd, jax.jit(jax.grad(loss))


@pytest.mark.grid("bfloat16-compensated", "float16-plain")
@pytest.mark.parametrize("compensated", [False, True], ids=["plain", "compensated"])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=["bfloat16", "float16"])
def test_echo_psum_16bit_custom_call_takes_and_returns_x_dtype(dtype, compensated):
    """Through echo_psum: the compiled HLO's custom call takes x and returns the sum in x's
    16-bit dtype, with no convert of x to f32 in front of it and none of the sum after it (the
    TransformerEngine style: assert on the compiled HLO); transport "p2p" equals "xla" bit for
    bit (uint16 view, NaN bits included), in the state and in the straight-through gradient."""
    num_ranks, n = 3, 2 * 333
    mesh = mesh_of((num_ranks,), ("tp",))
    x = half_inputs(90, num_ranks, 1001, dtype)[:, 331:331 + n].reshape(num_ranks, 2, 333)
    rng = np.random.default_rng(9)
    m1, m2 = ((rng.standard_normal(x.shape) * 0.05).astype(np.float32) for _ in range(2))
    args = [put(a, mesh, P("tp")) for a in (x, m1, m2)]
    kw = dict(bits=4, policy="asym")
    f_p2p, g_p2p = _echo_psum_16bit(mesh, num_ranks, "p2p", compensated, x, m1, m2, kw)
    f_xla, g_xla = _echo_psum_16bit(mesh, num_ranks, "xla", compensated, x, m1, m2, kw)

    # rescale=False: the module holds nothing but the call. (The default, rescale="auto", is
    # rescale=False; its program is checked below as well.)
    f_plain, _ = _echo_psum_16bit(mesh, num_ranks, "p2p", compensated, x, m1, m2, kw,
                                  rescale=False)
    hlo = f_plain.lower(*args).compile().as_text()
    target = cpu.TARGET_COMPENSATED if compensated else cpu.TARGET
    calls = [ln for ln in hlo.splitlines() if f'custom_call_target="{target}"' in ln]
    assert len(calls) == 1, calls
    t = {jnp.bfloat16: "bf16", jnp.float16: "f16"}[dtype]
    call = calls[0]
    # The result (the sum; for the compensated call the first of the tuple) is x's dtype.
    assert re.search(rf"= \(?{t}\[{n}\]\S* ", call), call
    if compensated:
        # The state keeps x's shape (2, 333) through the call (no reshape around the buffers
        # the call updates in place).
        assert f"({t}[{n}]{{0}}, f32[2,333]{{1,0}}, f32[2,333]{{1,0}}) custom-call(" in call, call
    # The operand x (the first) is x's dtype: the compiled text names the operands and lists
    # their shapes in operand_layout_constraints.
    assert re.search(rf"operand_layout_constraints={{{t}\[{n}\]", call), call
    # No convert between x's dtype and f32 anywhere in the module (fusions included): nothing
    # widens x in front of the call or rounds the sum after it.
    types = dict(re.findall(r"^\s*(?:ROOT )?(%\S+) = \(?([a-z0-9]+)\[", hlo, re.M))
    converts = [(dst, types.get(src), ln.strip()[:120]) for ln in hlo.splitlines()
                for dst, src in re.findall(r"= ([a-z0-9]+)\[[0-9,]*\]\S* convert\((%[^,)]+)\)",
                                           ln)]
    assert converts or "convert" not in hlo, "no convert parsed: the HLO format changed"
    assert not [c for c in converts if {c[0], c[1]} == {t, "f32"}], converts
    first = re.search(r"custom-call\((%[^,)]+)", call).group(1)
    assert types[first] == t, (first, types[first])
    assert "all-to-all" not in hlo and "all-gather" not in hlo
    hlo_auto = f_p2p.lower(*args).compile().as_text()
    call = [ln for ln in hlo_auto.splitlines() if f'custom_call_target="{target}"' in ln]
    assert len(call) == 1 and re.search(rf"operand_layout_constraints={{{t}\[{n}\]", call[0])
    assert re.search(rf"= \(?{t}\[{n}\]\S* ", call[0]), call

    got, want = f_p2p(*args), f_xla(*args)
    assert np.asarray(got[0]).dtype == jnp.dtype(dtype)
    assert_same_bits16(got[0], want[0], "y")
    # Special values in the slice: fp16's sums past 65504 come back inf; bf16's 3e38 (past the
    # 2^126 limit) makes its group NaN.
    y = np.asarray(got[0], np.float32)
    assert (np.isinf(y).any() and not np.isnan(y).any() if dtype == jnp.float16
            else np.isnan(y).any() and not np.isinf(y).any())
    if compensated:
        assert_same_bits(got[1], want[1], "m1")
        assert_same_bits(got[2], want[2], "m2")
    gx_p2p, gx_xla = g_p2p(*args), g_xla(*args)
    assert np.asarray(gx_p2p).dtype == jnp.dtype(dtype)
    assert_same_bits16(gx_p2p, gx_xla, "gradient")


# -------------------------------------------------------------------------------------------
# Meshes with several axes, typing, repeated calls.
# -------------------------------------------------------------------------------------------

def test_dp_tp_mesh_concurrent_groups():
    """2x4 mesh: two tp groups of 4 and four dp groups of 2 in one program, both typed ways."""
    mesh = mesh_of((2, 4), ("dp", "tp"))
    x = rng_inputs(21, 8, 777, np.float32).reshape(2, 4, 777)
    cfg = ej.EchoConfig(bits=4, policy="asym")
    cfg8 = ej.EchoConfig(bits=8, policy="sym")

    def body(x):
        flat = x[0, 0]
        t_got = explicit.p2p_allreduce(flat, "tp", 4, cfg)
        t_want = collective.xla_allreduce(flat, "tp", 4, cfg)
        d_got = explicit.p2p_allreduce(flat * 2.0, "dp", 2, cfg8)
        d_want = collective.xla_allreduce(flat * 2.0, "dp", 2, cfg8)
        assert jax.typeof(t_got).mat == jax.typeof(t_want).mat
        assert jax.typeof(d_got).mat == jax.typeof(d_want).mat
        both = ("dp", "tp")
        return tuple(as_varying(v, both)[None, None] for v in (t_got, t_want, d_got, d_want))

    spec = P("dp", "tp")
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=(spec,) * 4))
    t_got, t_want, d_got, d_want = (np.asarray(v) for v in f(put(x, mesh, spec)))
    assert_same_bits(t_got, t_want, "tp")
    assert_same_bits(d_got, d_want, "dp")
    for d in range(2):
        assert_same_on_every_rank(t_got[d], f"tp group {d}")
    for t in range(4):
        assert_same_on_every_rank(d_got[:, t], f"dp group {t}")
    assert not np.array_equal(t_got[0, 0], t_got[1, 0])  # the two tp groups differ

    # check_vma=False shard_maps (no types) run the same protocol.
    def untyped(x):
        flat = x[0, 0]
        return (explicit.p2p_allreduce(flat, "tp", 4, cfg)[None, None],
                collective.xla_allreduce(flat, "tp", 4, cfg)[None, None])

    g = jax.jit(jax.shard_map(untyped, mesh=mesh, in_specs=spec, out_specs=(spec,) * 2,
                              check_vma=False))
    a, b = g(put(x, mesh, spec))
    assert_same_bits(a, b, "tp, check_vma=False")


@pytest.mark.slow   # 1000 calls of the paths that the bit-for-bit tests above run once each
def test_repeated_calls_stay_correct():
    """>= 1000 calls: a jitted loop of 2 x 500 calls on two shapes, plus separate executions."""
    num_ranks = 4
    mesh = mesh_of((num_ranks,), ("tp",))
    cfg_a = ej.EchoConfig(bits=4, policy="asym")
    cfg_b = ej.EchoConfig(bits=8, policy="sym")
    xa = rng_inputs(31, num_ranks, 1000, np.float32)
    xb = rng_inputs(32, num_ranks, 4099, np.float32)
    steps = 500

    def loop(reduce):
        def body(a0, b0):
            a0, b0 = a0[0], b0[0]

            def step(c, _):
                a, b = c
                ya, yb = reduce(a, cfg_a), reduce(b, cfg_b)
                # y * 2^-3 is exact, so XLA's fusion choices cannot change the carry's bits.
                a = ya * jnp.float32(0.125) + a0
                b = yb * jnp.float32(0.125) + b0
                return (a, b), (as_varying(ya, ("tp",)), as_varying(yb, ("tp",)))
            _, (ya, yb) = lax.scan(step, (a0, b0), None, length=steps)
            return ya[None], yb[None]
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"),) * 2,
                                     out_specs=(P("tp"),) * 2))

    args = (put(xa, mesh, P("tp")), put(xb, mesh, P("tp")))
    t0 = time.perf_counter()
    got = loop(lambda v, c: explicit.p2p_allreduce(v, "tp", num_ranks, c))(*args)
    want = loop(lambda v, c: collective.xla_allreduce(v, "tp", num_ranks, c))(*args)
    # Every call's result on every rank, not only the final carry: the carry contracts by 8 per
    # step, so an error at any call but the last few would vanish from it.
    assert got[0].shape == (num_ranks, steps, 1000)
    assert_same_bits(got[0], want[0], "loop a, every call")
    assert_same_bits(got[1], want[1], "loop b, every call")

    # Separate executions of two compiled programs, alternating shapes: the workspaces persist
    # and their epochs keep rising across executions.
    def single(cfg, both):
        def body(x):
            y = explicit.p2p_allreduce(x[0], "tp", num_ranks, cfg) if both != "xla" else \
                collective.xla_allreduce(x[0], "tp", num_ranks, cfg)
            return as_varying(y, ("tp",))[None]
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))

    fa, fb = single(cfg_a, "p2p"), single(cfg_b, "p2p")
    ra = np.asarray(single(cfg_a, "xla")(args[0]))
    rb = np.asarray(single(cfg_b, "xla")(args[1]))
    pending = []
    for i in range(30):
        pending.append((fa(args[0]), ra) if i % 2 == 0 else (fb(args[1]), rb))
    for y, ref in pending:
        assert_same_bits(y, ref, "separate call")
    assert time.perf_counter() - t0 < 60
    stats = cpu.registry_stats()
    assert stats["pending_joins"] == 0


def test_echo_psum_transport_p2p_equals_xla():
    """Through the public API: echo_psum(transport='p2p') == echo_psum(transport='xla')."""
    num_ranks = 4
    mesh = mesh_of((num_ranks,), ("tp",))
    x = rng_inputs(41, num_ranks, 3 * 50, jnp.bfloat16).reshape(num_ranks, 3, 50)

    def body(x, transport):
        cfg = ej.EchoConfig(bits=4, transport=transport)
        y = ej.echo_psum(x[0], "tp", config=cfg)
        return as_varying(y, ("tp",))[None]

    def run(transport):
        f = jax.jit(jax.shard_map(lambda x: body(x, transport), mesh=mesh, in_specs=P("tp"),
                                  out_specs=P("tp")))
        return np.asarray(f(put(x, mesh, P("tp"))).astype(jnp.float32))

    assert collective.resolve_transport(ej.EchoConfig(transport="xla")) == "xla"
    assert_same_bits(run("p2p"), run("xla"), "echo_psum")


# -------------------------------------------------------------------------------------------
# Choosing the transport, validation, failure.
# -------------------------------------------------------------------------------------------

def test_choose_and_vmap_fallback():
    cfg_auto, cfg_p2p = ej.EchoConfig(), ej.EchoConfig(transport="p2p")
    assert transports.resolve(ej.EchoConfig(transport="xla"), honor_env=False) == "xla"
    assert transports.resolve(cfg_auto, honor_env=False) == "xla"      # outside shard_map
    with pytest.raises(ValueError, match="not called inside jax.shard_map"):
        transports.resolve(cfg_p2p, honor_env=False)

    x = jnp.asarray(rng_inputs(51, 4, 300, np.float32))
    seen = {}

    def f(v):
        seen["choice"] = transports.resolve(cfg_auto, "i", honor_env=False)
        y = explicit.p2p_allreduce(v, "i", 4, cfg_auto)              # falls back to xla_allreduce
        return y, collective.xla_allreduce(v, "i", 4, cfg_auto)

    got, want = jax.jit(jax.vmap(f, axis_name="i"))(x)
    assert seen["choice"] == "xla"
    assert_same_bits(got, want, "vmap fallback")
    with pytest.raises(ValueError, match="vmap"):
        jax.vmap(lambda v: explicit.p2p_allreduce(v, "i", 4, cfg_p2p), axis_name="i")(x)

    # Inside shard_map the custom call is chosen.
    mesh = mesh_of((2,), ("tp",))

    def g(v):
        seen["inside"] = transports.resolve(cfg_auto, "tp", honor_env=False)
        return v
    jax.jit(jax.shard_map(g, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))(
        put(np.zeros(4, np.float32), mesh, P("tp")))
    assert seen["inside"] == "p2p"


def test_validation_messages():
    mesh = mesh_of((2,), ("tp",))
    cfg = ej.EchoConfig()

    def trace(fn, x=np.zeros((2, 8), np.float32)):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"),
                                     check_vma=False))(put(x, mesh, P("tp")))

    with pytest.raises(ValueError, match="flat float32, bfloat16 or float16 array, got int32"):
        trace(lambda x: explicit.p2p_allreduce(x[0].astype(jnp.int32), "tp", 2, cfg)[None])
    with pytest.raises(ValueError, match=r"flat float32, bfloat16 or float16 array, got "
                                         r"bfloat16\[2, 4\]"):
        trace(lambda x: explicit.p2p_allreduce(x[0].astype(jnp.bfloat16).reshape(2, 4), "tp", 2,
                                          cfg)[None])
    with pytest.raises(ValueError, match="num_ranks=3 but axis 'tp' has size 2"):
        trace(lambda x: explicit.p2p_allreduce(x[0], "tp", 3, cfg)[None])
    with pytest.raises(ValueError, match="m1_flat must be float32"):
        trace(lambda x: explicit.p2p_allreduce_compensated(x[0], x[0, :4], x[0], "tp", 2, cfg)[0][None])
    with pytest.raises(ValueError, match="config must be an EchoConfig"):
        trace(lambda x: explicit.p2p_allreduce(x[0], "tp", 2, {"bits": 4})[None])


def test_missing_peer_times_out_with_clear_error(monkeypatch):
    num_ranks = 2
    mesh = mesh_of((num_ranks,), ("tp",))
    cfg = ej.EchoConfig(bits=4)
    x = put(rng_inputs(61, num_ranks, 256, np.float32), mesh, P("tp"))
    monkeypatch.setenv(TIMEOUT_ENV, "0.3")

    def make():
        return jax.jit(jax.shard_map(
            lambda v: as_varying(explicit.p2p_allreduce(v[0], "tp", num_ranks, cfg), ("tp",))[None],
            mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))

    with cpu.debug_absent_rank(1):
        broken = make()
        t0 = time.perf_counter()
        with pytest.raises(jax.errors.JaxRuntimeError) as info:
            np.asarray(broken(x))
        elapsed = time.perf_counter() - t0
    msg = str(info.value)
    assert "timed out after 0.3 s" in msg and "stage 'reduce'" in msg, msg
    assert "rank 0 of group 0" in msg and "waited for rank 1" in msg, msg
    assert elapsed < 10, elapsed

    # The group recovers: a fresh workspace, consistent epochs.
    monkeypatch.delenv(TIMEOUT_ENV)
    ok = make()
    ref = jax.jit(jax.shard_map(
        lambda v: as_varying(collective.xla_allreduce(v[0], "tp", num_ranks, cfg), ("tp",))[None],
        mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))(x)
    for _ in range(3):
        assert_same_bits(ok(x), ref, "after timeout")
    assert cpu.registry_stats()["pending_joins"] == 0


def test_bad_timeout_env(monkeypatch):
    monkeypatch.setenv(TIMEOUT_ENV, "soon")
    mesh = mesh_of((2,), ("tp",))
    with pytest.raises(ValueError, match="ECHO_JAX_TIMEOUT_S"):
        jax.jit(jax.shard_map(lambda v: explicit.p2p_allreduce(v[0], "tp", 2, ej.EchoConfig())[None],
                              mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False))(
            put(np.zeros((2, 4), np.float32), mesh, P("tp")))


def test_concurrent_executions_on_disjoint_devices():
    """One traced program (one call site) on two disjoint 4-device meshes, dispatched back to
    back without waiting: the ranks join by execution and device, never across the meshes."""
    devices = jax.devices()
    if len(devices) < 8:
        pytest.skip("needs 8 devices")
    meshes = [Mesh(np.array(devices[:4]), ("tp",)), Mesh(np.array(devices[4:8]), ("tp",))]
    cfg = ej.EchoConfig(bits=4)

    def body(x):
        return as_varying(explicit.p2p_allreduce(x[0], "tp", 4, cfg), ("tp",))[None]

    def ref(x):
        return as_varying(collective.xla_allreduce(x[0], "tp", 4, cfg), ("tp",))[None]

    f = jax.jit(jax.shard_map(body, in_specs=P("tp"), out_specs=P("tp")))
    g = jax.jit(jax.shard_map(ref, in_specs=P("tp"), out_specs=P("tp")))
    xs = [put(rng_inputs(70 + i, 4, 999, np.float32), m, P("tp")) for i, m in enumerate(meshes)]
    outs = []
    for i in range(12):
        with jax.set_mesh(meshes[i % 2]):
            outs.append(f(xs[i % 2]))
    refs = []
    for m, x in zip(meshes, xs):
        with jax.set_mesh(m):
            refs.append(g(x))
    for i, y in enumerate(outs):
        assert_same_bits(y, refs[i % 2], f"execution {i}")
    assert not np.array_equal(np.asarray(refs[0]), np.asarray(refs[1]))
