"""CUDA custom call (ffi/p2p_cuda.cu, ffi/quant_cuda.cu) against the pure-JAX reference, bit for
bit. Marked `gpu`: skipped without an NVIDIA GPU; run on the device machine.

* Virtual ranks (`cuda.virtual_allreduce`, P rank pipelines on one GPU): every machine with
  a GPU, including the smallest inputs that reach the kernel and a peer that never arrives.
* One rank per GPU (`cuda.rank_allreduce`, reached through `echo_psum` with transport "p2p"
  inside `jax.shard_map` under `jax.set_mesh`): P = 2 .. 8 as far as the machine has GPUs, and
  meshes with two axes; each test skips, saying how many GPUs it needs, where there are fewer.
"""

import os
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as PS

import echo_jax as ej
from echo_jax import _compat, collective
from echo_jax import policies, transports
from echo_jax import compensator as comp
from echo_jax import quant
from conftest import cuda_handlers, reference_allreduce

pytestmark = pytest.mark.gpu
POLICIES = policies.NAMES  # ("asym", "sym", "asym_naive")


@pytest.fixture(scope="module")
def cuda():
    # Skips without a GPU; fails (does not skip) on a GPU machine without the CUDA handlers.
    return cuda_handlers()


def reference_many(configs, xs, states=None):
    """`reference_allreduce` of every (configs[i], xs[i], states[i]) in one jitted program (one
    compilation for a test's cases): [y_i] or [(y_i, new_state_i)]."""
    states = [None] * len(xs) if states is None else states

    def ranks(vs, ss):
        outs = []
        for cfg, v, s in zip(configs, vs, ss):
            cfg = cfg.replace(transport="xla")
            outs.append(ej.echo_psum(v, "tp", config=cfg) if s is None
                        else ej.echo_psum(v, "tp", config=cfg, state=s))
        return outs

    return jax.jit(jax.vmap(ranks, axis_name="tp"))(list(xs), list(states))


def same_bits(a, b, what=""):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, a.dtype, b.shape, b.dtype)
    ua = a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(f"u{a.dtype.itemsize}")
    ub = b.view(np.uint8) if b.dtype.itemsize == 1 else b.view(f"u{b.dtype.itemsize}")
    bad = np.flatnonzero(ua.reshape(-1) != ub.reshape(-1))
    assert bad.size == 0, (f"{what}: {bad.size} of {a.size} differ, first at {bad[:5]}: "
                           f"{a.reshape(-1)[bad[:3]]} vs {b.reshape(-1)[bad[:3]]}")


def gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


def gpu_mesh(shape, names):
    """A mesh of the first prod(shape) GPUs; skips, saying why, where there are fewer."""
    devices = gpus()
    n = int(np.prod(shape))
    if len(devices) < n:
        pytest.skip(f"needs {n} GPUs for a {'x'.join(map(str, shape))} mesh {names}, this "
                    f"machine has {len(devices)}")
    return Mesh(np.array(devices[:n]).reshape(shape), names)


def test_gpu_is_there():
    assert jax.devices("gpu"), "the gpu marker promised a GPU"


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("g", [128, 64, 32, 6])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_quantize_kernels_match_reference(cuda, bits, policy, g, dtype):
    cfg = ej.EchoConfig(bits=bits, group_size=g, policy=policy)
    key = jax.random.key(bits + g)
    x = jax.random.normal(key, (4096 * g,)) * jnp.repeat(
        10.0 ** jax.random.uniform(key, (4096,), minval=-6, maxval=4), g)
    x = x.at[:g].set(0.0).at[g:2 * g].set(1.5).at[2 * g + 3].set(jnp.nan)
    x = x.at[3 * g:4 * g].add(100.0)
    # Straddling outlier groups, zero a fraction of a step inside (the zero-aware policy's case).
    x = x.at[4 * g:6 * g].multiply(1e-3).at[4 * g + 1].set(300.0).at[5 * g + 2].set(-300.0)
    x = x.astype(dtype)
    packed, params = jax.jit(lambda v: cuda.quantize(v, cfg))(x)
    ref_packed, ref_params = jax.jit(
        lambda v: quant.quantize_groups(v.reshape(-1, g), bits, policy))(x)
    same_bits(packed, ref_packed)
    same_bits(params, ref_params)
    y = jax.jit(lambda p, q: cuda.dequantize(p, q, cfg))(packed, params)
    same_bits(y, jax.jit(lambda p, q: quant.dequantize_groups(p, q, bits, policy).reshape(-1))(
        ref_packed, ref_params))


SHAPES = [(1,), (7,), (127,), (128,), (1000,), (4099,), (3, 333), (65536,), (12345,), (8, 1024),
          (2, 3, 5, 7), (100003,), (1 << 18,), (777, 129), (1 << 20,), (3000017,), (1 << 22,),
          (5, 1 << 20), (1 << 24,), (31, 31, 31)]


@pytest.mark.parametrize("nranks", [2, 4, 8])
def test_virtual_ranks_match_reference_over_20_shapes(cuda, nranks):
    rng = np.random.default_rng(nranks)
    for i, shape in enumerate(SHAPES):
        bits = (4, 8)[i % 2]
        policy = POLICIES[i % 3]
        dtype = (jnp.float32, jnp.bfloat16, jnp.float16)[i % 3]
        cfg = ej.EchoConfig(bits=bits, policy=policy)
        x = jnp.asarray(rng.standard_normal((nranks, *shape), np.float32) + 0.1).astype(dtype)
        y = jax.jit(lambda v: cuda.virtual_allreduce(v, cfg))(x)
        same_bits(y, reference_allreduce(x, cfg))


@pytest.mark.parametrize("nranks", [2, 4, 8])
@pytest.mark.parametrize("bits", [4, 8])
def test_virtual_ranks_compensated_match_reference(cuda, nranks, bits):
    cfg = ej.EchoConfig(bits=bits)
    key = jax.random.key(nranks)
    x = jax.random.normal(key, (nranks, 3, 40001)).astype(jnp.bfloat16)
    st = ej.CompensatorState(0.1 * jax.random.normal(key, x.shape),
                             -0.05 * jax.random.normal(jax.random.key(9), x.shape))
    y, new = jax.jit(lambda v, s: cuda.virtual_allreduce(v, cfg, s))(x, st)
    ry, rnew = reference_allreduce(x, cfg, st)
    same_bits(y, ry)
    same_bits(new.m1, rnew.m1)
    same_bits(new.m2, rnew.m2)


def two_calls(cuda, cfg, x1, x2, state):
    """Two chained compensated virtual calls (the second reads the state the kernels wrote),
    compiled, and the xla transport's two: ((y1, s1, y2, s2), ((ry1, rs1), (ry2, rs2)))."""

    def two(a, b, s):
        y1, s1 = cuda.virtual_allreduce(a, cfg, s)
        y2, s2 = cuda.virtual_allreduce(b, cfg, s1)
        return y1, s1, y2, s2
    r1 = reference_allreduce(x1, cfg, state)
    return jax.jit(two)(x1, x2, state), (r1, reference_allreduce(x2, cfg, r1[1]))


@pytest.mark.parametrize("nranks", [2, 4])
@pytest.mark.parametrize("xdtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("rotation", ["none", "hadamard"])
def test_virtual_ranks_bf16_state_match_reference(cuda, nranks, xdtype, rotation):
    """EchoConfig.state_dtype="bfloat16" inside the kernels: m1, m2 widened on load, the update
    in fp32 rounded to nearest even on store; y, m1, m2 bit for bit with the xla transport's
    (`echo_jax.compensator`). Shapes: aligned rows (fast stages, g = 32 .. 256, 4 and 8 bits) and
    odd rows / g = 96 (generic stages), two chained calls each (the second reads the state the
    kernel wrote)."""
    rng = np.random.default_rng(nranks + 10 * len(xdtype))
    cases = [(4, 128, 65536), (8, 32, 8192), (4, 256, 4096 + 256), (4, 64, 40001),
             (8, 128, 1001)] + ([(4, 96, 5000)] if rotation == "none" else [])
    for bits, g, n in cases:
        cfg = ej.EchoConfig(bits=bits, group_size=g, rotation=rotation, state_dtype="bfloat16")
        x1, x2 = (jnp.asarray(rng.standard_normal((nranks, n)), jnp.float32).astype(xdtype)
                  for _ in range(2))
        st = ej.CompensatorState(
            jnp.asarray(0.1 * rng.standard_normal((nranks, n)), jnp.bfloat16),
            jnp.asarray(-0.05 * rng.standard_normal((nranks, n)), jnp.bfloat16))
        what = f"P={nranks} {xdtype} bits={bits} g={g} n={n} rotation={rotation}"
        got, (r1, r2) = two_calls(cuda, cfg, x1, x2, st)
        for (y, new), (ry, rnew), step in (((got[0], got[1]), r1, 1), ((got[2], got[3]), r2, 2)):
            assert new.m1.dtype == new.m2.dtype == jnp.bfloat16, what
            same_bits(y, ry, f"{what} call {step}: y")
            same_bits(new.m1, rnew.m1, f"{what} call {step}: m1")
            same_bits(new.m2, rnew.m2, f"{what} call {step}: m2")
        # Not vacuous: the state moved, and an fp32 state would have stored other values.
        assert np.any(np.asarray(got[3].m1) != np.asarray(st.m1)), what


def same_bits_or_both_nan(a, b, what=""):
    """same_bits, where a NaN on both sides counts as equal whatever its payload."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype.kind == "f" or a.dtype == jnp.bfloat16:
        nan_a, nan_b = np.isnan(a.astype(np.float32)), np.isnan(b.astype(np.float32))
        np.testing.assert_array_equal(nan_a, nan_b, err_msg=f"{what}: NaN positions differ")
        a, b = np.where(nan_a, 0, a).astype(a.dtype), np.where(nan_b, 0, b).astype(b.dtype)
    same_bits(a, b, what)


@pytest.mark.parametrize("xdtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("rotation", ["none", "hadamard"])
def test_virtual_ranks_int8_state_match_reference(cuda, xdtype, rotation):
    """EchoConfig.state_dtype="int8" in the fast kernels (g = 128: a wire group is a state
    group): codes times scale where x' is formed; where y is produced, a group's new values, its
    scale from their largest |v| across the group's lanes, and its codes. y and every code and
    scale bit for bit with the xla transport's (`echo_jax.compensator`, itself checked against
    NumPy), two chained calls, 4 and 8 bits, P = 2, 3 and 4 (the reduce stage reads its peers
    one ahead, skipping its own rank), a short last group (n = 4096 + 64),
    a contribution with a NaN (its groups' sums and state groups NaN on both), and one whose
    128-value groups span the dtype's range (each group times its own power of two, 2^-100 to
    2^120, fp16 2^-8 to 2^12: state groups below the 2^-100 threshold and near the top of the
    range; the kernels' code conversions rest on exact products there too)."""
    rng = np.random.default_rng(3 + len(xdtype))
    for nranks, bits, n, case in ((4, 4, 65536, ""), (2, 8, 4096 + 64, ""), (3, 4, 4096 + 64, ""),
                                  (4, 4, 4096 + 64, "nan"), (2, 4, 8192, "range")):
        nan = case == "nan"
        cfg = ej.EchoConfig(bits=bits, rotation=rotation, state_dtype="int8")
        x0, x1, x2 = (np.asarray(rng.standard_normal((nranks, n)), np.float32)
                      for _ in range(3))
        if nan:
            x1[1, 4100] = np.nan  # rank 1's last, short group
        if case == "range":  # exponents -100 .. 120 (fp16: -8 .. 12), one a 128-value group
            lo, hi = (-8, 12) if xdtype == "float16" else (-100, 120)
            exps = np.linspace(lo, hi, n // 128).round().astype(np.int32)
            scale = np.repeat(np.ldexp(np.float32(1), exps), 128).astype(np.float32)
            x0, x1, x2 = x0 * scale, x1 * scale, x2 * scale
        x0, x1, x2 = (jnp.asarray(v).astype(xdtype) for v in (x0, x1, x2))
        what = f"P={nranks} {xdtype} bits={bits} n={n} rotation={rotation} case={case!r}"
        zero = jax.vmap(lambda v: ej.init_state(v, cfg))(x0)
        st = reference_allreduce(x0, cfg, zero)[1]  # a live state: codes and scales not zero
        got, (r1, r2) = two_calls(cuda, cfg, x1, x2, st)
        for (y, new), (ry, rnew), step in (((got[0], got[1]), r1, 1), ((got[2], got[3]), r2, 2)):
            assert new.quantized and new.m1.codes.dtype == jnp.int8, what
            same_bits_or_both_nan(y, ry, f"{what} call {step}: y")
            for name, a, b in zip(("m1 codes", "m1 scales", "m2 codes", "m2 scales"),
                                  jax.tree.leaves(new), jax.tree.leaves(rnew), strict=True):
                same_bits_or_both_nan(a, b, f"{what} call {step}: {name}")
        assert np.any(np.asarray(got[3].m1.codes) != np.asarray(st.m1.codes)), what
        if nan:
            assert np.isnan(np.asarray(got[1].m1.scales)).any(), what


@pytest.mark.parametrize("state_dtype", ["int8", "int4"])
@pytest.mark.parametrize("xdtype", ["float32", "bfloat16", "float16"])
def test_virtual_ranks_local_residual_match_reference(cuda, xdtype, state_dtype):
    """EchoConfig.residual="local" with the int8 or int4 state (int4: the same stages with the
    codes packed two a byte, XLA's int4, and codes in [-7, 7]; its virtual rows a multiple of 32
    values, as all of these are): the push updates the state of the values
    it sends from x' - Q(x'), the reduce the own segment's from s - Q(s), the tail stores y
    only. y and every code and scale bit for bit with the xla transport's
    (`xla_allreduce_local`, itself checked against float64 NumPy), two chained calls, 4 and 8
    bits, P = 2, 3 and 4, a short last group, NaNs (their groups NaN on both), the
    rescaling's factor operand (rescale=True: the residual divided by the factor), groups that
    span the dtype's range (as in the int8 state's test), and coefficients at the ends of what
    the kernels fold into the state's scales (0 and 2^-20, EchoConfig's bound)."""
    rng = np.random.default_rng(7 + len(xdtype) + 11 * (state_dtype == "int4"))
    code_dtype = jnp.int4 if state_dtype == "int4" else jnp.int8
    for nranks, bits, n, case in ((4, 4, 65536, ""), (2, 8, 4096 + 64, ""), (3, 4, 4096 + 64, ""),
                                  (3, 8, 4096 + 64, ""), (4, 4, 4096 + 64, "nan"),
                                  (4, 4, 8192, "factor"), (3, 4, 8192, "range"),
                                  (4, 4, 4096 + 64, "coefficients")):
        extremes = dict(eta=1.0, blend=1.0, beta1=0.0, beta2=2.0 ** -20)
        cfg = ej.EchoConfig(bits=bits, state_dtype=state_dtype, residual="local",
                            **(extremes if case == "coefficients" else {}))
        x0, x1, x2 = (np.asarray(rng.standard_normal((nranks, n)), np.float32)
                      for _ in range(3))
        if case == "nan":  # in a whole group set of rank 1's push and in the short last group
            x1[1, 100] = x1[1, 4100] = np.nan
        if case == "range":  # exponents -100 .. 120 (fp16: -8 .. 12), one a 128-value group
            lo, hi = (-8, 12) if xdtype == "float16" else (-100, 120)
            exps = np.linspace(lo, hi, n // 128).round().astype(np.int32)
            scale = np.repeat(np.ldexp(np.float32(1), exps), 128).astype(np.float32)
            x0, x1, x2 = x0 * scale, x1 * scale, x2 * scale
        x0, x1, x2 = (jnp.asarray(v).astype(xdtype) for v in (x0, x1, x2))
        what = f"P={nranks} {xdtype} {state_dtype} state bits={bits} n={n} case={case!r}"
        zero = jax.vmap(lambda v: ej.init_state(v, cfg))(x0)
        st = reference_allreduce(x0, cfg, zero)[1]
        assert st.m1.codes.dtype == code_dtype, what
        if case == "factor":
            def ref(v, s):
                return jax.jit(jax.vmap(lambda a, b: ej.echo_psum(a, "tp", config=cfg, state=b,
                                                                  rescale=True),
                                        axis_name="tp"))(v, s)

            def factor(v):
                return jax.vmap(lambda r: collective.rescale_factor(r, "tp", True),
                                axis_name="tp")(v)[0]

            def two(a, b, s):
                y1, s1 = cuda.virtual_allreduce(a, cfg, s, factor=factor(a))
                y2, s2 = cuda.virtual_allreduce(b, cfg, s1, factor=factor(b))
                return y1, s1, y2, s2
            r1 = ref(x1, st)
            got, (r1, r2) = jax.jit(two)(x1, x2, st), (r1, ref(x2, r1[1]))
        else:
            got, (r1, r2) = two_calls(cuda, cfg, x1, x2, st)
        for (y, new), (ry, rnew), step in (((got[0], got[1]), r1, 1), ((got[2], got[3]), r2, 2)):
            assert new.quantized and new.m1.codes.dtype == code_dtype, what
            assert new.m1.codes.shape == st.m1.codes.shape, what
            same_bits_or_both_nan(y, ry, f"{what} call {step}: y")
            for name, a, b in zip(("m1 codes", "m1 scales", "m2 codes", "m2 scales"),
                                  jax.tree.leaves(new), jax.tree.leaves(rnew), strict=True):
                same_bits_or_both_nan(a, b, f"{what} call {step}: {name}")
        assert np.any(np.asarray(got[3].m1.codes) != np.asarray(st.m1.codes)), what
        if state_dtype == "int4":  # the codes' range: [-7, 7]
            codes = np.asarray(got[3].m1.codes).astype(np.int8)
            assert codes.min() >= -7 and codes.max() <= 7, what


def test_the_int4_state_runs_with_the_local_residual_only(cuda):
    """The int4 state with residual="output": the CUDA call refuses it with the reason (the
    handler, reached directly here), and the plan of echo_psum with transport "p2p" runs the
    compensation in JAX (`CudaTransport.fused_state_reason`) instead of the fused call. Virtual
    rows of the int4 state must be a multiple of 32 values (each row's packed codes 16-byte
    aligned)."""
    from echo_jax.transports import cuda as cuda_transport
    cfg = ej.EchoConfig(state_dtype="int4")
    assert cfg.residual == "output"
    reason = cuda_transport.TRANSPORT.fused_state_reason(cfg, "int4")
    assert reason is not None and "int4 state with residual='local' only" in reason, reason
    local = cfg.replace(residual="local")
    assert cuda_transport.TRANSPORT.fused_state_reason(local, "int4") is None
    assert cuda_transport.TRANSPORT.fused_state_reason(local, "int8") is None
    assert "int4" in cuda_transport.FUSED_STATE_DTYPES
    x = jnp.ones((2, 4096), jnp.float32)
    st = jax.vmap(lambda v: ej.init_state(v, cfg))(x)
    assert st.m1.codes.dtype == jnp.int4
    with pytest.raises(Exception, match=r"int4 state runs with residual='local' only"):
        jax.block_until_ready(cuda.virtual_allreduce(x, cfg, st))
    x = jnp.ones((2, 4096 + 16), jnp.float32)  # int4 rows of 2056 bytes: not 16-byte aligned
    st = jax.vmap(lambda v: ej.init_state(v, local))(x)
    with pytest.raises(Exception, match=r"int4 state needs rows of a multiple of 32"):
        jax.block_until_ready(cuda.virtual_allreduce(x, local, st))


def test_the_local_residual_needs_the_int8_state(cuda):
    """residual="local" with a float state, or with the int8 state on rows the fast stages
    cannot take, refuses with the fix instead of running stages that have no local update."""
    x = jnp.ones((2, 4096), jnp.float32)
    cfg = ej.EchoConfig(residual="local")
    st = jax.vmap(lambda v: ej.init_state(v, cfg))(x)
    with pytest.raises(Exception, match=r"local residual .* int8 or int4 state only"):
        jax.block_until_ready(cuda.virtual_allreduce(x, cfg, st))
    cfg = ej.EchoConfig(residual="local", state_dtype="int8")
    x = jnp.ones((2, 1004), jnp.float32)
    st = jax.vmap(lambda v: ej.init_state(v, cfg))(x)
    with pytest.raises(Exception, match=r"local residual .* int8 or int4 state only"):
        jax.block_until_ready(cuda.virtual_allreduce(x, cfg, st))


def test_the_int8_state_needs_the_fast_stages(cuda):
    """Rows the fast stages cannot take (n not a multiple of 16: unaligned rows) refuse the int8
    state with the fix, instead of running generic stages that do not take it."""
    cfg = ej.EchoConfig(state_dtype="int8")
    x = jnp.ones((2, 1004), jnp.float32)  # a row of 1004 codes: not 16-byte aligned
    st = jax.vmap(lambda v: ej.init_state(v, cfg))(x)
    with pytest.raises(Exception, match=r"int8 state runs in the fast stages only"):
        jax.block_until_ready(cuda.virtual_allreduce(x, cfg, st))


@pytest.mark.parametrize("nranks", [2, 4])
@pytest.mark.parametrize("xdtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rotation", ["none", "hadamard"])
def test_virtual_ranks_applied_call_match_reference(cuda, nranks, xdtype, state_dtype, rotation):
    """EchoConfig.state_update="separate": the applied kernels (the apply step inside, m1 and m2
    only read) and the update after them (`compensator.update_beside`, on a second stream) give
    y, m1, m2 bit for bit with the xla transport's; fast instances (aligned rows, g = 32 .. 256,
    4 / 8 bits) and generic ones (odd rows, g = 96), two chained calls each; the state the call
    read is left unchanged (it is an operand, not updated in place)."""
    rng = np.random.default_rng(nranks + 10 * len(xdtype) + 100 * len(state_dtype))
    cases = [(4, 128, 65536), (8, 32, 8192), (4, 256, 4096 + 256), (4, 64, 40001),
             (8, 128, 1001)] + ([(4, 96, 5000)] if rotation == "none" else [])
    for bits, g, n in cases:
        cfg = ej.EchoConfig(bits=bits, group_size=g, rotation=rotation, state_dtype=state_dtype,
                            state_update="separate")
        x1, x2 = (jnp.asarray(rng.standard_normal((nranks, n)), jnp.float32).astype(xdtype)
                  for _ in range(2))
        st = ej.CompensatorState(
            jnp.asarray(0.1 * rng.standard_normal((nranks, n)), state_dtype),
            jnp.asarray(-0.05 * rng.standard_normal((nranks, n)), state_dtype))
        kept = [np.asarray(m).copy() for m in st]
        what = f"P={nranks} {xdtype} state {state_dtype} bits={bits} g={g} n={n} {rotation}"

        def two(a, b, s):
            y1, s1 = cuda.virtual_allreduce(a, cfg, s)
            y2, s2 = cuda.virtual_allreduce(b, cfg, s1)
            return y1, s1, y2, s2
        got = jax.jit(two)(x1, x2, st)
        r1 = reference_allreduce(x1, cfg, st)
        r2 = reference_allreduce(x2, cfg, r1[1])
        for (y, new), (ry, rnew), step in (((got[0], got[1]), r1, 1), ((got[2], got[3]), r2, 2)):
            same_bits(y, ry, f"{what} call {step}: y")
            same_bits(new.m1, rnew.m1, f"{what} call {step}: m1")
            same_bits(new.m2, rnew.m2, f"{what} call {step}: m2")
        same_bits(st.m1, kept[0], f"{what}: the input m1 was written")
        same_bits(st.m2, kept[1], f"{what}: the input m2 was written")
        assert np.any(np.asarray(got[3].m1) != kept[0]), what


def test_virtual_applied_call_program_runs_the_update_kernel_after_it(cuda):
    """The compiled program of a separate update on the CUDA transport: the applied custom call,
    no compensated one, and the update as the one-pass kernel (`cuda.update_state`, the plan's
    separate_update="kernel"), on XLA's compute stream. The JAX update (`update_beside`, the
    plan's "jax") goes on the stream of ECHO_JAX_UPDATE_STREAM: XLA wraps the annotated
    computation into a call-start on that stream (`--xla_gpu_experimental_stream_annotation`,
    on by default)."""
    cfg = ej.EchoConfig(state_update="separate")
    x = jnp.ones((4, 1 << 16), jnp.bfloat16)
    st = ej.init_state(x)
    text = jax.jit(lambda a, s: cuda.virtual_allreduce(a, cfg, s)).lower(x, st).compile().as_text()
    assert 'custom_call_target="echo_allreduce_virtual_applied_cuda"' in text
    assert "echo_allreduce_virtual_comp_cuda" not in text
    assert 'custom_call_target="echo_state_update_cuda"' in text
    k = comp.Coefficients.from_config(cfg)
    text = jax.jit(lambda a, y, s: comp.update_beside(a, y, 4, s, k, stream=1)).lower(
        x, x, st).compile().as_text()
    starts = [ln for ln in text.splitlines() if "call-start(" in ln]
    assert any('_xla_stream_annotation="1"' in ln for ln in starts), \
        f"no call-start annotated for stream 1 in the compiled program: {starts[:3]}"


def test_virtual_ranks_refuse_a_state_of_another_dtype(cuda):
    x = jnp.ones((2, 1024), jnp.float32)
    with pytest.raises(ValueError, match=r"state\.m1 must be bfloat16"):
        cuda.virtual_allreduce(x, ej.EchoConfig(state_dtype="bfloat16"), ej.init_state(x))
    with pytest.raises(ValueError, match=r"state\.m1 must be float32"):
        cuda.virtual_allreduce(x, ej.EchoConfig(),
                               ej.init_state(x, ej.EchoConfig(state_dtype="bfloat16")))


def test_virtual_ranks_one_gib(cuda):
    # 1 GiB of fp32 per rank at P = 2.
    cfg = ej.EchoConfig(bits=4)
    x = jax.random.normal(jax.random.key(0), (2, 1 << 28))
    y = jax.jit(lambda v: cuda.virtual_allreduce(v, cfg))(x)
    same_bits(y, reference_allreduce(x, cfg))
    del y


def test_repeated_calls_alternating_shapes(cuda):
    cfg = ej.EchoConfig(bits=4)
    xs = [jax.random.normal(jax.random.key(i), (4, n)) for i, n in enumerate((1000, 70001, 4096))]
    refs = [reference_allreduce(x, cfg) for x in xs]
    f = jax.jit(lambda v: cuda.virtual_allreduce(v, cfg))
    for i in range(1200):
        y = f(xs[i % 3])
        if i % 97 == 0 or i > 1190:
            same_bits(y, refs[i % 3])


# -------------------------------------------------------------------------------------------
# The smallest inputs that reach the kernel, and P = 1 (which reaches none).
# -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("policy", POLICIES)
def test_virtual_p2_tiny_inputs_match_reference(cuda, bits, policy):
    """P = 2 is the smallest group that runs the kernel (at P = 1 echo_psum returns x first).
    n = 1 and g - 1 (one partial group: segment 1 is all padding) and g + 1 (one group per
    segment, the second holding a single value); g = 128 (4 values per lane access), 6 (2) and,
    at 8 bits, 5 (1 value per access; 4 bits needs an even g, so 2 instead). The dtype rotates
    over fp32 / bf16 / fp16. Plain, and compensated for n = 1 and g + 1. The calls of one g run
    back to back in one program (and its reference in another)."""
    group_sizes = (128, 6, 5) if bits == 8 else (128, 6, 2)
    rng = np.random.default_rng(10 * bits + POLICIES.index(policy))
    dtypes = (jnp.float32, jnp.bfloat16, jnp.float16)
    case = 0
    for g in group_sizes:
        cfg = ej.EchoConfig(bits=bits, group_size=g, policy=policy)
        xs, sts, whats = [], [], []
        for n in sorted({1, g - 1, g + 1}):
            dtype = dtypes[case % 3]
            case += 1
            whats.append(f"P=2 bits={bits} {policy} g={g} n={n} {jnp.dtype(dtype).name}")
            xs.append(jnp.asarray(rng.standard_normal((2, n)).astype(np.float32) + 0.25)
                      .astype(dtype))
            sts.append(None if n == g - 1 and n != 1 else ej.CompensatorState(
                jnp.asarray(0.1 * rng.standard_normal((2, n)), jnp.float32),
                jnp.asarray(-0.05 * rng.standard_normal((2, n)), jnp.float32)))
        comp = [i for i, s in enumerate(sts) if s is not None]

        def calls(xs, sts):
            plain = [cuda.virtual_allreduce(x, cfg) for x in xs]
            return plain, [cuda.virtual_allreduce(xs[i], cfg, sts[i]) for i in comp]

        got_plain, got_comp = jax.jit(calls)(xs, sts)
        want = reference_many([cfg] * (len(xs) + len(comp)), xs + [xs[i] for i in comp],
                              [None] * len(xs) + [sts[i] for i in comp])
        for i, y in enumerate(got_plain):
            same_bits(y, want[i], whats[i])
            same_bits(y[0], y[1], whats[i] + ": rank 1 vs rank 0")
        for k, i in enumerate(comp):
            (y, new), (ry, rnew) = got_comp[k], want[len(xs) + k]
            same_bits(y, ry, whats[i] + " compensated: y")
            same_bits(new.m1, rnew.m1, whats[i] + " compensated: m1")
            same_bits(new.m2, rnew.m2, whats[i] + " compensated: m2")


def test_p_equals_one_returns_x_without_a_kernel(cuda):
    """What P = 1 promises: echo_psum returns x itself (and a state unchanged) before it chooses a
    transport, so even transport="p2p" gives the very same bits (a NaN, -0.0, values far outside
    fp16's range included) and the compiled program has no Echo custom call and no collective."""
    mesh = gpu_mesh((1,), ("tp",))
    cfg = ej.EchoConfig(bits=4, transport="p2p")
    key = jax.random.key(1)
    x = jax.random.normal(key, (1, 3, 1000)) * 1e6
    x = x.at[0, 0, 0].set(jnp.nan).at[0, 0, 1].set(-0.0).at[0, 1, 5].set(1e-40)
    m1 = jax.random.normal(jax.random.key(2), (1, 3, 1000))
    m2 = jax.random.normal(jax.random.key(3), (1, 3, 1000))
    xb = x.astype(jnp.bfloat16)

    def body(v, vb, a, b):
        y = ej.echo_psum(v[0], "tp", config=cfg)
        yb = ej.echo_psum(vb[0], "tp", config=cfg)
        z, st = ej.echo_psum(v[0], "tp", config=cfg, state=ej.CompensatorState(a[0], b[0]))
        return y[None], yb[None], z[None], st.m1[None], st.m2[None]

    spec = PS("tp")
    args = [jax.device_put(a, NamedSharding(mesh, spec)) for a in (x, xb, m1, m2)]
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec,) * 5))
    with jax.set_mesh(mesh):
        compiled = f.lower(*args).compile()
        y, yb, z, n1, n2 = compiled(*args)
    same_bits(y, x, "fp32")
    same_bits(yb, xb, "bf16")
    same_bits(z, x, "compensated: y")
    same_bits(n1, m1, "compensated: m1")
    same_bits(n2, m2, "compensated: m2")
    text = compiled.as_text()
    assert 'custom_call_target="echo' not in text, "P = 1 ran an Echo custom call"
    for op in ("all-to-all", "all-gather", "all-reduce", "collective-permute"):
        assert op not in text, f"P = 1 compiled a collective ({op})"


# -------------------------------------------------------------------------------------------
# A peer that never arrives.
# -------------------------------------------------------------------------------------------

def test_missing_peer_times_out_with_a_clear_error(cuda, monkeypatch):
    """Virtual rank 4 of 5 never arrives (`absent_rank`, a test hook of the handler). Ranks 0 to
    3 wait ECHO_JAX_TIMEOUT_S (0.3 s here, read when the call is traced), give up and poison
    their outputs with NaN; the call itself returns (a kernel cannot raise without a host
    synchronisation), and the next call of the group raises, from `check_health` in
    ffi/p2p_cuda.cu, the error of `describe_error`: the rank that timed out, the stage and the
    missing peer. The group stays unusable (the same error again); other groups still work.
    P = 5 is a virtual group no other GPU test uses: tests of other files that run later in the
    same process (pytest -m gpu tests/) would otherwise meet the broken group.

    Size: 1024 tiles per segment (16384 values each), more than the blocks of one virtual rank
    that can be resident (at most 8 blocks of 256 threads per SM, shared by 5 ranks), so every
    block of the waiting ranks waits in the reduce stage for rank 4's push: the stage and the
    peer of the message are determined, and every block reaches the poisoning. Which of ranks 0
    to 3 times out first is not, so the message may name any of them."""
    timeout_s = 0.3
    monkeypatch.setenv(cuda.TIMEOUT_ENV, str(timeout_s))
    cfg = ej.EchoConfig(bits=4)           # g = 128: 128 groups of 128 per tile
    ranks, absent = 5, 4                  # P = 5: a virtual group no other test uses
    n = ranks * 1024 * 16384              # 84M fp32 values per rank
    x = jax.random.normal(jax.random.key(2), (ranks, n))
    small = jax.random.normal(jax.random.key(3), (ranks, 1000))
    broken = jax.jit(lambda v: cuda.virtual_allreduce(v, cfg, absent_rank=absent)).lower(
        x).compile()
    after = jax.jit(lambda v: cuda.virtual_allreduce(v, cfg)).lower(small).compile()
    jax.block_until_ready((x, small))

    t0 = time.perf_counter()
    y = broken(x)
    y.block_until_ready()                 # no error yet: the kernels gave up on their own
    waited = time.perf_counter() - t0
    message = (r"rank [0-3] timed out in the reduce stage waiting for rank 4's push "
               + re.escape("(a peer never arrived); the group's workspace is no longer usable"))
    with pytest.raises(jax.errors.JaxRuntimeError, match=message):
        np.asarray(after(small))
    elapsed = time.perf_counter() - t0
    assert waited >= 0.9 * timeout_s, f"the waiting ranks gave up after {waited:.3f} s, before " \
                                      f"the {timeout_s} s timeout"
    assert elapsed < timeout_s + 3.0, f"the error came {elapsed:.2f} s after the call, timeout " \
                                      f"{timeout_s} s"
    finite = np.asarray(jnp.sum(~jnp.isnan(y[:absent]), axis=1))
    assert (finite == 0).all(), f"values that are not NaN in the outputs of ranks 0 to 3 " \
                                f"after the timeout: {finite.tolist()} of {n}"

    # The group stays broken: the same error, again, on every later call.
    with pytest.raises(jax.errors.JaxRuntimeError, match=message):
        np.asarray(after(small))
    # Other groups (another P on the same GPU) are not affected.
    cfg2 = ej.EchoConfig(bits=8)
    x2 = small[:2]
    same_bits(jax.jit(lambda v: cuda.virtual_allreduce(v, cfg2))(x2),
              reference_allreduce(x2, cfg2), "P = 2 after the P = 5 group broke")


# -------------------------------------------------------------------------------------------
# One rank per GPU: rank_allreduce through echo_psum inside jax.shard_map.
# -------------------------------------------------------------------------------------------

RANK_TARGETS = {False: "echo_allreduce_cuda", True: "echo_allreduce_comp_cuda",
                "applied": "echo_allreduce_applied_cuda"}
RANK_SHAPES = [(1,), (127,), (3, 333), (4099,), (70001,), (2, 3, 5, 7)]
BITS_POLICIES = [(b, p) for b in (4, 8) for p in POLICIES]
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


def rank_inputs(rng, lead, shape, dtype, scale=1.0):
    """[*lead, *shape]: rank (i, j, ...) of the mesh contributes x[i, j, ...]."""
    x = rng.standard_normal((*lead, *shape)) * scale
    x[..., ::7] = np.abs(x[..., ::7]) + 0.5     # one-sided stretches and zero-straddling groups
    return np.asarray(x, np.float32).astype(dtype)


def run_on_mesh(mesh, axis, configs, xs, states=None):
    """echo_psum over `axis` of every xs[i] with configs[i], one rank per GPU, in one jitted
    jax.shard_map over every mesh axis (varying-axes types checked, JAX's default), compiled and
    run under `jax.set_mesh(mesh)` (the CUDA custom call reads the groups from it).

    xs[i] (and states[i] = (m1, m2), fp32) are global [*mesh shape, *shape] arrays.
    Returns (outputs, compiled HLO text): outputs[i] is y, or (y, m1, m2) with states, numpy
    arrays laid out like xs[i].
    """
    names = mesh.axis_names
    lead, new = (0,) * len(names), (None,) * len(names)
    spec = PS(*names)
    per = 1 if states is None else 3

    def body(*args):
        outs = []
        for i, cfg in enumerate(configs):
            a = [v[lead] for v in args[per * i:per * (i + 1)]]
            if states is None:
                outs.append(ej.echo_psum(a[0], axis, config=cfg)[new])
            else:
                y, st = ej.echo_psum(a[0], axis, config=cfg,
                                     state=ej.CompensatorState(a[1], a[2]))
                outs += [y[new], st.m1[new], st.m2[new]]
        return tuple(outs)

    flat = []
    for i, x in enumerate(xs):
        flat += [x] if states is None else [x, *states[i]]
    args = [jax.device_put(a, NamedSharding(mesh, spec)) for a in flat]
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * len(args),
                              out_specs=(spec,) * len(args)))
    with jax.set_mesh(mesh):
        compiled = f.lower(*args).compile()
        outs = [np.asarray(o) for o in compiled(*args)]
    if states is not None:
        outs = [tuple(outs[3 * i:3 * i + 3]) for i in range(len(configs))]
    return outs, compiled.as_text()


def reference_on_mesh(mesh_ndim, axis_pos, configs, xs, states=None):
    """The "xla" transport (jax.vmap on one device, `reference_many`) of every xs[i] over mesh
    dimension `axis_pos`, for every index of the other mesh dimension (meshes of one or two
    axes): per case [y] or [y, m1, m2], numpy arrays laid out like xs[i]."""
    def flat(outs):
        return [[np.asarray(o)] if states is None else [np.asarray(v) for v in
                                                        (o[0], o[1].m1, o[1].m2)] for o in outs]

    def sts(pick):
        if states is None:
            return None
        return [ej.CompensatorState(*(jnp.asarray(pick(m)) for m in st)) for st in states]

    if mesh_ndim == 1:
        return flat(reference_many(configs, [jnp.asarray(x) for x in xs], sts(lambda m: m)))
    assert mesh_ndim == 2, mesh_ndim
    other = 1 - axis_pos
    parts = [flat(reference_many(configs, [jnp.asarray(np.take(x, j, axis=other)) for x in xs],
                                 sts(lambda m, j=j: np.take(m, j, axis=other))))
             for j in range(xs[0].shape[other])]
    return [[np.stack([p[i][k] for p in parts], axis=other) for k in range(len(parts[0][i]))]
            for i in range(len(xs))]


def assert_same_in_every_group(y, axis_pos, what):
    """Every rank of a group (the ranks along mesh dimension `axis_pos`) returned the same bits."""
    yy = np.moveaxis(np.asarray(y), axis_pos, 0)
    for r in range(1, yy.shape[0]):
        same_bits(yy[r], yy[0], f"{what}: rank {r} vs rank 0 of its group")


def assert_custom_calls(text, compensated, count):
    """The compiled program runs the CUDA custom call `count` times and no collective: a silent
    fallback to the "xla" transport (all-to-all + all-gather) would show here."""
    target = RANK_TARGETS[compensated]
    found = text.count(f'custom_call_target="{target}"')
    assert found == count, (f"{found} custom calls to {target} in the compiled program, "
                            f"expected {count}")
    for op in ("all-to-all", "all-gather", "all-reduce"):
        assert op not in text, f"the compiled program has an {op}: a fallback to 'xla'?"


@pytest.mark.parametrize("comp", [False, True], ids=["plain", "compensated"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("num_ranks", range(2, 9))
def test_rank_allreduce_matches_reference(cuda, num_ranks, dtype, comp):
    """P ranks on P GPUs: echo_psum with transport "p2p" equals the "xla" transport (vmap on one
    GPU) bit for bit on every rank, the compensated state m1 / m2 too, and every rank returns the
    same sum. One program runs the six (bits, policy) pairs, each on its own odd shape (the
    shapes rotate with P, so every pair meets several shapes over P = 2 .. 8)."""
    mesh = gpu_mesh((num_ranks,), ("tp",))
    rng = np.random.default_rng(100 * num_ranks + 10 * comp + (dtype == "bf16"))
    configs, xs, states, whats = [], [], [], []
    for ci, (bits, policy) in enumerate(BITS_POLICIES):
        shape = RANK_SHAPES[(ci + num_ranks) % len(RANK_SHAPES)]
        configs.append(ej.EchoConfig(bits=bits, policy=policy, transport="p2p"))
        xs.append(rank_inputs(rng, (num_ranks,), shape, DTYPES[dtype]))
        states.append(tuple(rank_inputs(rng, (num_ranks,), shape, np.float32, 0.05)
                            for _ in range(2)))
        whats.append(f"P={num_ranks} bits={bits} {policy} {dtype} shape={shape}"
                     + (" compensated" if comp else ""))
    outs, text = run_on_mesh(mesh, "tp", configs, xs, states if comp else None)
    assert_custom_calls(text, comp, len(configs))
    wants = reference_on_mesh(1, 0, configs, xs, states if comp else None)
    for i, want in enumerate(wants):
        got = list(outs[i]) if comp else [outs[i]]
        assert got[0].shape == xs[i].shape and got[0].dtype == xs[i].dtype, whats[i]
        assert_same_in_every_group(got[0], 0, whats[i])
        for name, a, b in zip(("y", "m1", "m2"), got, want):
            same_bits(a, b, f"{whats[i]}: {name}")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_rank_applied_call_matches_reference(cuda, num_ranks, dtype):
    """EchoConfig.state_update="separate" on P GPUs: the applied call once a site (no fused
    one) and the update after it; y, m1, m2 bit for bit with the "xla" transport's."""
    mesh = gpu_mesh((num_ranks,), ("tp",))
    rng = np.random.default_rng(7 * num_ranks + (dtype == "bf16"))
    configs, xs, states = [], [], []
    for ci, (bits, policy) in enumerate(BITS_POLICIES):
        shape = RANK_SHAPES[(ci + num_ranks) % len(RANK_SHAPES)]
        configs.append(ej.EchoConfig(bits=bits, policy=policy, transport="p2p",
                                     state_update="separate"))
        xs.append(rank_inputs(rng, (num_ranks,), shape, DTYPES[dtype]))
        states.append(tuple(rank_inputs(rng, (num_ranks,), shape, np.float32, 0.05)
                            for _ in range(2)))
    outs, text = run_on_mesh(mesh, "tp", configs, xs, states)
    assert_custom_calls(text, "applied", len(configs))
    assert RANK_TARGETS[True] not in text
    wants = reference_on_mesh(1, 0, configs, xs, states)
    for i, want in enumerate(wants):
        what = f"P={num_ranks} {configs[i].bits} bits {configs[i].policy} {dtype}"
        assert_same_in_every_group(outs[i][0], 0, what)
        for name, a, b in zip(("y", "m1", "m2"), outs[i], want):
            same_bits(a, b, f"{what}: {name}")


@pytest.mark.parametrize("comp", [False, True], ids=["plain", "compensated"])
@pytest.mark.parametrize("axis", ["tp", "dp"])
@pytest.mark.parametrize("mesh_shape", [(2, 2), (4, 2), (2, 4)], ids=lambda s: f"dp{s[0]}xtp{s[1]}")
def test_rank_allreduce_on_two_axis_meshes(cuda, mesh_shape, axis, comp):
    """A ("dp", "tp") mesh: reducing over "tp" runs dp independent groups of adjacent GPUs,
    over "dp" groups of GPUs tp apart (the groups are read from the mesh, not assumed to be
    0..P-1). Each group equals the "xla" reference on its own inputs bit for bit, every rank of a
    group returns the same bits, and different groups differ."""
    mesh = gpu_mesh(mesh_shape, ("dp", "tp"))
    axis_pos = ("dp", "tp").index(axis)
    rng = np.random.default_rng(7 * sum(mesh_shape) + axis_pos + 2 * comp)
    cases = [(4, "asym", (3, 333), "f32"), (8, "sym", (4099,), "bf16")]
    configs, xs, states, whats = [], [], [], []
    for bits, policy, shape, dtype in cases:
        configs.append(ej.EchoConfig(bits=bits, policy=policy, transport="p2p"))
        xs.append(rank_inputs(rng, mesh_shape, shape, DTYPES[dtype]))
        states.append(tuple(rank_inputs(rng, mesh_shape, shape, np.float32, 0.05)
                            for _ in range(2)))
        whats.append(f"mesh dp={mesh_shape[0]} tp={mesh_shape[1]} over {axis}: bits={bits} "
                     f"{policy} {dtype} shape={shape}" + (" compensated" if comp else ""))
    outs, text = run_on_mesh(mesh, axis, configs, xs, states if comp else None)
    assert_custom_calls(text, comp, len(configs))
    wants = reference_on_mesh(2, axis_pos, configs, xs, states if comp else None)
    for i, want in enumerate(wants):
        got = list(outs[i]) if comp else [outs[i]]
        assert_same_in_every_group(got[0], axis_pos, whats[i])
        for name, a, b in zip(("y", "m1", "m2"), got, want):
            same_bits(a, b, f"{whats[i]}: {name}")
        first = np.moveaxis(got[0], axis_pos, 0)[0]   # rank 0 of every group, one per group
        assert not np.array_equal(first[0], first[1]), f"{whats[i]}: two groups gave one sum"


def test_auto_chooses_the_custom_call_on_local_gpus(cuda):
    """transport="auto" (the default) picks the CUDA custom call inside shard_map on local GPUs
    under jax.set_mesh, within the size limits, and says so through p2p.choose."""
    mesh = gpu_mesh((2,), ("tp",))
    cfg = ej.EchoConfig(bits=4)
    seen = {}

    def body(v):
        seen["choice"] = transports.resolve(cfg, "tp", v[0].size, honor_env=False)
        return ej.echo_psum(v[0], "tp", config=cfg)[None]

    x = jax.device_put(np.ones((2, 4096), np.float32), NamedSharding(mesh, PS("tp")))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=PS("tp"), out_specs=PS("tp")))
    with jax.set_mesh(mesh):
        text = f.lower(x).compile().as_text()
    assert seen["choice"] == "p2p", seen
    assert_custom_calls(text, False, 1)


@pytest.mark.parametrize("comp", [False, True], ids=["plain", "compensated"])
@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=["tp2", "dp2xtp2"])
def test_rank_results_are_typed_like_the_xla_transport(cuda, mesh_shape, comp):
    """Inside a type-checked shard_map (check_vma=True, the default) the "p2p" results carry the
    varying-axes types of the "xla" transport's: the sum invariant over the reduced axis and
    varying over the other axes, the new state varying over every axis, as x. (ffi_call results
    are typed invariant over every axis; the CPU path re-types them in echo_jax/p2p.py.) A
    mismatch breaks, e.g., a lax.scan that carries the state or a dp-varying sum. Trace only."""
    names = ("tp",) if len(mesh_shape) == 1 else ("dp", "tp")
    mesh = gpu_mesh(mesh_shape, names)
    lead = (0,) * len(names)
    spec = PS(*names)
    new = (None,) * len(names)
    seen = {}

    def body(x, m1, m2):
        results = []
        for transport in ("p2p", "xla"):
            cfg = ej.EchoConfig(bits=4, transport=transport)
            if comp:
                y, st = ej.echo_psum(x[lead], "tp", config=cfg,
                                     state=ej.CompensatorState(m1[lead], m2[lead]))
                outs = {"y": y, "m1": st.m1, "m2": st.m2}
            else:
                outs = {"y": ej.echo_psum(x[lead], "tp", config=cfg)}
            seen[transport] = {k: sorted(_compat.varying_axes(v)) for k, v in outs.items()}
            results += [v[new] for v in outs.values()]
        return tuple(results)

    args = [jax.device_put(np.ones((*mesh_shape, 1000), np.float32), NamedSharding(mesh, spec))
            for _ in range(3)]
    nout = 2 * (3 if comp else 1)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec,) * nout))
    with jax.set_mesh(mesh):
        text = f.lower(*args).as_text()
    assert RANK_TARGETS[comp] in text, "the p2p half did not take the custom call"
    assert seen["p2p"] == seen["xla"], f"varying axes, p2p: {seen['p2p']}, xla: {seen['xla']}"


# The child imports the reference from the tests' conftest (their directory comes in argv[1]).
_REPEAT_CHILD = """
import sys
sys.path.insert(0, sys.argv[1])
import jax, jax.numpy as jnp, numpy as np
import echo_jax as ej
from echo_jax.transports import cuda
from conftest import reference_allreduce
for dtype in (jnp.float32, jnp.bfloat16):
    x = jax.random.normal(jax.random.key(7), (4, 3 * 128 * 1024 + 640)).astype(dtype)
    cfg = ej.EchoConfig(bits=4)
    got = cuda.virtual_allreduce(x, cfg)
    want = reference_allreduce(x, cfg)
    assert np.array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8)), dtype
print("same bits")
"""

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_child(code, **env_vars):
    # A fresh process per setting (the variables are read once per process); this one holds
    # most of the GPU's memory (JAX preallocates), so the child allocates on use.
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", **env_vars)
    return subprocess.run([sys.executable, "-c", code, TESTS_DIR], env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("stage", ["push", "reduce", "tail"])
def test_repeat_stage_diagnostic_keeps_the_result(cuda, stage):
    # ECHO_JAX_P2P_REPEAT_STAGE runs one stage twice: the same bytes written again, so the
    # all-reduce's result must not change.
    r = run_child(_REPEAT_CHILD, ECHO_JAX_P2P_REPEAT_STAGE=stage)
    assert r.returncode == 0 and "same bits" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
