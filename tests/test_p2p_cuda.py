"""CUDA custom call (ffi/p2p_cuda.cu, ffi/quant_cuda.cu) against the pure-JAX reference, bit for
bit. Marked `gpu`: skipped without an NVIDIA GPU; run on the device machine."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import echo_jax as ej
from echo_jax import quant
from conftest import cuda_handlers

pytestmark = pytest.mark.gpu
POLICIES = ("asym", "sym", "asym_naive")


@pytest.fixture(scope="module")
def cuda():
    # Skips without a GPU; fails (does not skip) on a GPU machine without the CUDA handlers.
    return cuda_handlers()


def reference_allreduce(x, cfg, state=None):
    cfg = cfg.replace(transport="xla")
    if state is None:
        return jax.jit(jax.vmap(lambda v: ej.echo_psum(v, "tp", config=cfg), axis_name="tp"))(x)
    return jax.jit(jax.vmap(lambda v, s: ej.echo_psum(v, "tp", config=cfg, state=s),
                            axis_name="tp"))(x, state)


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype
    ua = a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(f"u{a.dtype.itemsize}")
    ub = b.view(np.uint8) if b.dtype.itemsize == 1 else b.view(f"u{b.dtype.itemsize}")
    bad = np.flatnonzero(ua.reshape(-1) != ub.reshape(-1))
    assert bad.size == 0, f"{bad.size} of {a.size} differ, first at {bad[:5]}: {a.reshape(-1)[bad[:3]]} vs {b.reshape(-1)[bad[:3]]}"


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


def test_p_equals_one_in_jax_on_the_gpu():
    mesh = jax.sharding.Mesh(np.array(jax.devices("gpu")[:1]), ("tp",))
    x = jax.random.normal(jax.random.key(1), (1, 1000))
    f = jax.jit(jax.shard_map(lambda v: ej.echo_psum(v, "tp"), mesh=mesh,
                              in_specs=jax.sharding.PartitionSpec("tp"),
                              out_specs=jax.sharding.PartitionSpec("tp")))
    same_bits(f(x), x)


def test_missing_peer_times_out_with_a_clear_error(cuda, monkeypatch):
    monkeypatch.setenv(cuda.TIMEOUT_ENV, "0.3")
    cfg = ej.EchoConfig(bits=4)
    x = jax.random.normal(jax.random.key(2), (3, 100000))  # P = 3: a group no other test uses
    f = jax.jit(lambda v: cuda.virtual_allreduce(v, cfg, absent_rank=2))
    import time
    t0 = time.time()
    y = np.asarray(f(x))     # returns: the waiting ranks give up after the timeout
    assert time.time() - t0 < 30
    assert np.isnan(y[0]).any()
    with pytest.raises(Exception, match="timed out"):
        np.asarray(jax.jit(lambda v: cuda.virtual_allreduce(v, cfg))(x))
