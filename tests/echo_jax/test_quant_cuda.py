"""The standalone CUDA quantize / dequantize kernels (ffi/quant_cuda.cu) against the references,
bit for bit: the pure-JAX `echo_jax.quant.quantize_groups` / `dequantize_groups` (on the GPU, as
the other transports compare) and the C++ quantizer of ffi/echo_common.h on the host.

Covers the fast kernels (every g in FAST_G, 4 / 8 bits, the three policies, fp32 / bf16 / fp16
in) and the generic fallback (other g), on adversarial groups: NaN, +-inf, mixes of +0 and -0,
constant groups, scales at the 2^-100 floor, fp32 subnormals, max |x| at the 2^126 limit, zero a fraction
of a step inside the range with a +-300 outlier, 1000.0 .. 1000.001, arbitrary bit patterns.
Marked `gpu`: skipped without an NVIDIA GPU. `ECHO_JAX_GENERIC_QUANT=1` makes the handlers use the
generic kernels throughout; test_generic_kernels_in_a_subprocess runs a subset that way."""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import echo_jax as ej
from echo_jax import quant
from conftest import cuda_handlers

pytestmark = pytest.mark.gpu
POLICIES = ("asym", "sym", "asym_naive")
FAST_G = (32, 64, 128, 256, 512, 1024)
FALLBACK_G = (6, 96)
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
POLICY_CODES = {"asym": 0, "sym": 1, "asym_naive": 2}


@pytest.fixture(scope="module")
def cuda():
    # Skips without a GPU; fails (does not skip) on a GPU machine without the CUDA handlers.
    return cuda_handlers()


def _bits_view(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(f"u{a.dtype.itemsize}")


def same_bits(a, b, what, nan_equal=False):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, a.dtype, b.shape, b.dtype)
    ua, ub = _bits_view(a).reshape(-1), _bits_view(b).reshape(-1)
    differ = ua != ub
    if nan_equal:  # the host's NaN payloads differ from the GPU's canonical NaN
        differ &= ~(np.isnan(a.reshape(-1)) & np.isnan(b.reshape(-1)))
    bad = np.flatnonzero(differ)
    assert bad.size == 0, (f"{what}: {bad.size} of {a.size} differ, first at {bad[:5]}: "
                           f"{a.reshape(-1)[bad[:3]]} vs {b.reshape(-1)[bad[:3]]}")


N_KINDS = 24


def adversarial(g: int, groups: int, seed: int) -> np.ndarray:
    """fp32 [groups, g]: group i is of kind i % N_KINDS (the edge cases of the wire format)."""
    rng = np.random.default_rng(seed)
    x = np.empty((groups, g), np.float32)
    with np.errstate(all="ignore"):
        for i in range(groups):
            x[i] = _group(rng, g, i % N_KINDS)
    return x


def _group(rng, g, kind):
    scale = np.float32(10.0 ** rng.uniform(-8, 5))
    v = (rng.standard_normal(g) * scale).astype(np.float32)
    if kind == 1:
        v[:] = 0.0
    elif kind == 2:
        v[:] = -0.0
    elif kind == 3:  # +0 / -0 mix: lo = -0, hi = +0, a constant group
        v = np.where(rng.integers(0, 2, g) == 1, np.float32(0.0), np.float32(-0.0))
    elif kind == 4:
        v[:] = v[0]
    elif kind == 5:
        v[rng.integers(g)] = np.nan
    elif kind == 6:
        v[rng.integers(g)] = np.inf if rng.integers(2) else -np.inf
    elif kind == 7:  # tiny values: the 2^-100 scale floor
        v = (rng.standard_normal(g) * 10.0 ** rng.uniform(-33, -27)).astype(np.float32)
    elif kind == 8:  # fp32 subnormals
        v = (rng.standard_normal(g) * 1e-40).astype(np.float32)
    elif kind == 9:  # huge values: finite up to 2^126, a NaN group on the wire from it
        v = (rng.standard_normal(g) * 10.0 ** rng.uniform(36, 38)).astype(np.float32)
    elif kind == 10:  # zero a fraction of a step inside the range, one outlier
        v = (v * np.float32(1e-3 / scale)).astype(np.float32)
        v[rng.integers(g)] = 300.0 if rng.integers(2) else -300.0
    elif kind == 11:
        v = (1000.0 + 0.001 * rng.uniform(size=g)).astype(np.float32)
    elif kind == 12:  # arbitrary bit patterns (NaNs, infs, subnormals, huge values)
        v = rng.integers(0, 2 ** 32, g, dtype=np.uint64).astype(np.uint32).view(np.float32)
    elif kind == 13:  # hi - lo overflows fp32
        v = np.where(rng.integers(0, 2, g) == 1, np.float32(3e38), np.float32(-3e38))
    elif kind == 14:  # two values
        v = np.where(rng.integers(0, 2, g) == 1, v[0], v[1]).astype(np.float32)
    elif kind == 15:  # max |x| at the 2^126 limit (some groups just below it, some at it)
        v = (2.0 ** 126 * (1 - 0.01 * np.abs(rng.standard_normal(g)))).astype(np.float32)
        if rng.integers(2):
            v[rng.integers(g)] = np.float32(2.0 ** 126)
    elif kind == 16:  # zeros of both signs and the smallest subnormals
        v = rng.choice(np.array([0.0, -0.0, 1e-45, 3e-45, -1e-45], np.float32), g)
    elif kind == 17:  # half-step points of a bf16 grid (rounding ties)
        s = np.float32(jnp.bfloat16(scale))
        v = ((rng.integers(0, 31, g) - 15) * 0.5 * s).astype(np.float32)
    elif kind == 18:  # non-negative with a -0: lo = -0
        v = np.abs(v)
        v[rng.integers(g)] = -0.0
    elif kind == 19:  # non-positive with a +0: hi = +0
        v = -np.abs(v)
        v[rng.integers(g)] = 0.0
    elif kind == 20:  # NaNs of both signs
        v[rng.integers(g)] = np.nan
        v[rng.integers(g)] = -np.nan
    elif kind == 21:  # a range tiny next to the magnitude: the amax * 2^-10 floor sets s
        v = (1.0 + 1e-4 * rng.standard_normal(g)).astype(np.float32)
    elif kind == 22:  # constant groups: a bf16 rounding tie, or below fp32's normal range
        v[:] = np.float32(1.00390625 * 2.0 ** 90) if rng.integers(2) else np.float32(3e-39)
    return v


@functools.lru_cache(maxsize=None)
def _fns(g, bits, policy):
    """Jitted (kernel quantize, kernel dequantize, reference quantize, reference dequantize)."""
    from echo_jax.transports import cuda
    cfg = ej.EchoConfig(bits=bits, group_size=g, policy=policy)
    return (jax.jit(lambda v: cuda.quantize(v, cfg)),
            jax.jit(lambda p, q: cuda.dequantize(p, q, cfg)),
            jax.jit(lambda v: quant.quantize_groups(v.reshape(-1, g), bits, policy)),
            jax.jit(lambda p, q: quant.dequantize_groups(p, q, bits, policy).reshape(-1)))


def _references(x_dtype, g, bits, policy):
    """(packed, params, y) of the JAX reference on the GPU for the already-cast values."""
    _, _, ref_quantize, ref_dequantize = _fns(g, bits, policy)
    packed, params = ref_quantize(x_dtype)
    return packed, params, ref_dequantize(packed, params)


def zero_sign_ambiguous(x32):
    """Finite groups [G, g] whose minimum or maximum is a zero and that hold zeros of both signs.

    XLA's min / max reductions give a shape-dependent sign of zero there (seen on XLA:CPU; see
    tests/echo_jax/test_p2p_cpu.py), while the kernels and the C++ quantizer always take -0 < +0. For these
    groups the JAX comparison is of values (-0 == +0, NaN == NaN) and of the codes' bits; the C++
    comparison stays bit for bit."""
    finite = np.isfinite(x32).all(-1)
    with np.errstate(invalid="ignore"):
        lo, hi = x32.min(-1), x32.max(-1)
    zero = x32 == 0
    both = (zero & np.signbit(x32)).any(-1) & (zero & ~np.signbit(x32)).any(-1)
    return finite & ((lo == 0) | (hi == 0)) & both


def param_values(params):
    """uint16 wire parameters [G, 1|2] -> fp32 values (the bf16 scale, the fp16 zero-point)."""
    p = np.asarray(params).astype(np.uint32)
    out = (p << 16).view(np.float32).copy()
    if p.shape[-1] == 2:
        out[..., 1] = p[..., 1].astype(np.uint16).view(np.float16).astype(np.float32)
    return out


def same_values(a, b, what):
    a, b = np.asarray(a, np.float32).reshape(-1), np.asarray(b, np.float32).reshape(-1)
    bad = np.flatnonzero(~((a == b) | (np.isnan(a) & np.isnan(b))))
    assert bad.size == 0, f"{what}: {bad.size} values differ, first at {bad[:5]}"


def compare_with_jax(packed, params, y, ref, x32, g, what):
    """Kernel outputs against the JAX reference's (ref = packed, params, y), bit for bit except
    the sign of zero of the parameters / outputs of zero_sign_ambiguous groups."""
    ref_packed, ref_params, ref_y = (np.asarray(r) for r in ref)
    packed, params, y = np.asarray(packed), np.asarray(params), np.asarray(y).reshape(-1, g)
    amb = zero_sign_ambiguous(x32)
    same_bits(packed, ref_packed, f"{what}: packed vs JAX")
    same_bits(params[~amb], ref_params[~amb], f"{what}: params vs JAX")
    same_bits(y[~amb], ref_y.reshape(-1, g)[~amb], f"{what}: dequantized vs JAX")
    same_values(param_values(params[amb]), param_values(ref_params[amb]),
                f"{what}: params vs JAX (+-0 groups)")
    same_values(y[amb], ref_y.reshape(-1, g)[amb], f"{what}: dequantized vs JAX (+-0 groups)")


def compare_with_cpp(packed, params, y, x32, g, bits, policy, what, flush_denormals=False):
    """Kernel outputs against the C++ quantizer of echo_common.h on the host, bit for bit (NaN
    outputs only as NaN: the host keeps NaN payloads, the GPU returns its canonical NaN)."""
    from echo_jax import _ffi
    code = POLICY_CODES[policy]
    params16 = np.asarray(params).view(np.uint16)
    h_packed, h_params = _ffi.quantize_groups(x32, bits, code, flush_denormals=flush_denormals)
    same_bits(np.asarray(packed), h_packed, f"{what}: packed vs C++")
    same_bits(params16, h_params, f"{what}: params vs C++")
    h_y = _ffi.dequantize_groups(np.asarray(packed), params16, g, bits, code,
                                 flush_denormals=flush_denormals)
    same_bits(np.asarray(y).reshape(-1), h_y.reshape(-1), f"{what}: dequantized vs C++",
              nan_equal=True)


def _check(cuda, x, g, bits, policy, what):
    quantize, dequantize, _, _ = _fns(g, bits, policy)
    packed, params = quantize(x)
    y = dequantize(packed, params)
    x32 = np.asarray(jnp.asarray(x).astype(jnp.float32)).reshape(-1, g)  # exact widening
    compare_with_jax(packed, params, y, _references(x, g, bits, policy), x32, g, what)
    compare_with_cpp(packed, params, y, x32, g, bits, policy, what)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("g", FAST_G + FALLBACK_G, ids=lambda g: f"g{g}")
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_kernels_match_references_on_adversarial_groups(cuda, bits, policy, g, dtype):
    if bits == 4 and g % 2:
        pytest.skip("4-bit needs an even group size")
    # An odd number of groups: the last warp of the fast kernel is partly past the end.
    groups = max(N_KINDS * 3, (1 << 15) // g) | 1
    x = jnp.asarray(adversarial(g, groups, seed=g * 10 + bits)).astype(DTYPES[dtype])
    _check(cuda, x, g, bits, policy, f"{dtype} g={g} {bits}-bit {policy}")


@pytest.mark.parametrize("groups", [1, 3, 17, 33])
@pytest.mark.parametrize("g", [32, 1024], ids=lambda g: f"g{g}")
def test_few_groups(cuda, groups, g):
    x = jnp.asarray(adversarial(g, groups, seed=groups))
    for bits, policy in ((4, "asym"), (8, "sym")):
        _check(cuda, x.astype(jnp.bfloat16), g, bits, policy, f"bf16 {groups} groups g={g}")
        _check(cuda, x, g, bits, policy, f"f32 {groups} groups g={g}")


def test_offset_slice_input(cuda):
    # x starts 1 element into a buffer: if XLA hands the custom call that view, it is not
    # 16-byte aligned and the generic kernel runs (scalar loads); if XLA copies the slice first,
    # the fast one does. Either way the bits must be the reference's.
    g = 128
    base = jnp.asarray(adversarial(g, 257, seed=7).reshape(-1))
    for dtype in (jnp.float32, jnp.bfloat16):
        full = jnp.concatenate([jnp.ones((1,), jnp.float32), base]).astype(dtype)
        for bits, policy in ((4, "asym"), (8, "asym_naive"), (4, "sym")):
            cfg = ej.EchoConfig(bits=bits, group_size=g, policy=policy)
            packed, params = jax.jit(lambda v: cuda.quantize(v[1:], cfg))(full)
            y = _fns(g, bits, policy)[1](packed, params)
            what = f"offset {jnp.dtype(dtype).name} {bits}-bit {policy}"
            x32 = np.asarray(full[1:].astype(jnp.float32)).reshape(-1, g)
            compare_with_jax(packed, params, y, _references(full[1:], g, bits, policy), x32, g,
                             what)
            compare_with_cpp(packed, params, y, x32, g, bits, policy, what)


@pytest.mark.parametrize("dtype,g", [("f32", 128), ("bf16", 32), ("f16", 256)])
def test_grid_stride_over_40m_values(cuda, dtype, g):
    # More groups than one pass of the capped grid covers (132 SMs x 64 blocks x 8 warps, each
    # warp 2 groups of 128 fp32, 16 groups of 32 bf16, 2 groups of 256 fp16, 512 dequantized
    # values a pass).
    n = 40 * (1 << 20)
    key = jax.random.key(g)
    x = (jax.random.normal(key, (n // g, g)) *
         10.0 ** jax.random.uniform(key, (n // g, 1), minval=-4, maxval=3)).reshape(-1)
    x = x.at[5 * g + 1].set(jnp.nan).at[(n // g - 1) * g].set(-jnp.inf).astype(DTYPES[dtype])
    _check(cuda, x, g, 4, "asym", f"{dtype} {n} values g={g}")


@pytest.mark.skipif(os.environ.get("ECHO_JAX_GENERIC_QUANT", "") not in ("", "0"),
                    reason="already running the generic kernels")
def test_generic_kernels_in_a_subprocess(cuda):
    # The handlers read ECHO_JAX_GENERIC_QUANT once per process: run a subset of this file in a
    # fresh one with it set, so the generic kernels are checked at the fast kernels' g too.
    # This process holds most of the GPU's memory (JAX preallocates): the child allocates on use.
    env = dict(os.environ, ECHO_JAX_GENERIC_QUANT="1", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:xdist", "-p", "no:cacheprovider",
         __file__,
         "-k", "adversarial and (g32 or g1024) and (f32 or bf16) and not generic"],
        env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
