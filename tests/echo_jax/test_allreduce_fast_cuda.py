"""The fast stages of the CUDA all-reduce (ffi/p2p_cuda.cu, FastStages) against the pure-JAX
reference, bit for bit, on adversarial contributions.

The fast stages run when every buffer is 16-byte aligned and g is in {32, 64, 128, 256}; the
other calls run the generic stages. The row length n of each case is chosen so that the rows of
the [P, n] virtual-rank array are 16-byte aligned (fast) or not (generic), and so that n is not a
multiple of g or of P * g (a partial last group and padded segments). Marked `gpu`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import echo_jax as ej
from echo_jax import policies
from conftest import cuda_handlers, reference_allreduce as reference

pytestmark = pytest.mark.gpu
POLICIES = policies.NAMES  # ("asym", "sym", "asym_naive")


@pytest.fixture(scope="module")
def cuda():
    # Skips without a GPU; fails (does not skip) on a GPU machine without the CUDA handlers.
    return cuda_handlers()


def same_bits(a, b, what):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, what
    ua, ub = a.view(f"u{a.dtype.itemsize}").ravel(), b.view(f"u{b.dtype.itemsize}").ravel()
    bad = np.flatnonzero(ua != ub)
    assert bad.size == 0, (f"{what}: {bad.size} of {a.size} differ, first at {bad[:5]}: "
                           f"{a.ravel()[bad[:3]]} vs {b.ravel()[bad[:3]]}")


def adversarial(num_ranks, n, g, dtype, seed):
    """[P, n] contributions: per-group magnitudes over 10 decades, and special groups."""
    rng = np.random.default_rng(seed)
    groups = -(-n // g)
    scale = np.repeat(10.0 ** rng.uniform(-6, 3, (num_ranks, groups)), g, axis=1)[:, :n]
    x = rng.standard_normal((num_ranks, n)) * scale
    x[:, :g] = 0.0                                     # an all-zero group
    x[:, g:2 * g] = 1.5                                # a constant group
    x[1, 2 * g + 3] = np.nan                           # a non-finite group on one rank
    x[0, 3 * g + 1] = np.inf
    x[:, 4 * g:6 * g] *= 1e-3                          # straddling outlier groups
    x[:, 4 * g + 1], x[:, 5 * g + 2] = 300.0, -300.0
    x[:, 6 * g:7 * g] = rng.uniform(0.5, 2.0, (num_ranks, g))  # one-sided groups
    x[:, 7 * g:8 * g] = -rng.uniform(0.5, 2.0, (num_ranks, g))
    x[:, 8 * g:9 * g] *= 1e-36                         # fp32 subnormal sums
    x[2 % num_ranks, 9 * g:10 * g] = 6e4               # 16-bit overflow on the way back
    return jnp.asarray(x.astype(np.float32)).astype(dtype)


CASES = [(dtype, g, bits) for dtype in (jnp.float32, jnp.bfloat16, jnp.float16)
         for g in (32, 64, 128, 256, 6) for bits in (4, 8) if not (g == 6 and bits == 4)]


@pytest.mark.parametrize("dtype,g,bits", CASES,
                         ids=[f"{jnp.dtype(d).name}-g{g}-b{b}" for d, g, b in CASES])
def test_fast_stages_match_reference(cuda, dtype, g, bits):
    num_ranks = {32: 4, 64: 3, 128: 4, 256: 2, 6: 3}[g]
    # 16-byte aligned rows (n * itemsize % 16 == 0) that end in a partial group.
    n = 23 * g + 8 if g % 8 == 0 else 23 * g + 5
    x = adversarial(num_ranks, n, max(g, 16), dtype, seed=g + bits)
    key = jax.random.key(g)
    state = ej.CompensatorState(0.01 * jax.random.normal(key, x.shape),
                                -0.02 * jax.random.normal(jax.random.key(1), x.shape))
    for policy in POLICIES:
        cfg = ej.EchoConfig(bits=bits, group_size=g, policy=policy)
        what = f"{jnp.dtype(dtype).name} g={g} bits={bits} {policy}"
        y = jax.jit(lambda v: cuda.virtual_allreduce(v, cfg))(x)
        same_bits(y, reference(x, cfg), what)
        y, new = jax.jit(lambda v, s: cuda.virtual_allreduce(v, cfg, s))(x, state)
        ry, rnew = reference(x, cfg, state)
        same_bits(y, ry, what + " compensated y")
        same_bits(new.m1, rnew.m1, what + " compensated m1")
        same_bits(new.m2, rnew.m2, what + " compensated m2")


@pytest.mark.parametrize("n", [1, 127, 129, 4099, 1 << 20, (1 << 20) + 4])
def test_aligned_and_unaligned_rows(cuda, n):
    # Row lengths that make the virtual rows unaligned (generic stages) or aligned (fast), one
    # group or a few, and a large message over several chunks of tiles.
    cfg = ej.EchoConfig(bits=4)
    x = jax.random.normal(jax.random.key(n), (4, n), jnp.float32) + 0.25
    same_bits(jax.jit(lambda v: cuda.virtual_allreduce(v, cfg))(x), reference(x, cfg), f"n={n}")
    xb = x.astype(jnp.bfloat16)
    same_bits(jax.jit(lambda v: cuda.virtual_allreduce(v, cfg))(xb), reference(xb, cfg),
              f"bf16 n={n}")


def numpy_factor(x):
    """The rescaling's power of two from the data (the Echo paper Sec. 5.4), in NumPy: 2^(9 - e)
    with max |x| = m * 2^e, m in [0.5, 1), so that the max lands in [256, 512)."""
    amax = float(np.max(np.abs(np.asarray(x, np.float64))))
    _, e = np.frexp(amax)
    return np.float32(2.0 ** int(np.clip(9 - e, -126, 120)))


@pytest.mark.parametrize("n", [4096 + 8, 4099])  # aligned rows (fast stages) and not (generic)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
def test_factor_operand_matches_rescaled_reference(cuda, n, dtype, bits):
    # The factor operand (the rescaling, Sec. 5.4) inside the kernels equals the xla transport's
    # x * f -> all-reduce -> * (1 / f) bit for bit, plain and compensated (apply before the
    # factor, update after it), at magnitudes from 2^-100 (where an unscaled call's groups meet
    # the wire format's 2^-100 scale floor) to 1e7.
    cfg = ej.EchoConfig(bits=bits)
    base = jax.random.normal(jax.random.key(n + bits), (4, n), jnp.float32)
    state = ej.CompensatorState(0.01 * jax.random.normal(jax.random.key(1), base.shape),
                                -0.02 * jax.random.normal(jax.random.key(2), base.shape))
    for magnitude in (2.0 ** -100, 1e-9, 1.0, 1e7):
        x = (base * magnitude).astype(dtype)
        f = numpy_factor(x)
        what = f"{jnp.dtype(dtype).name} n={n} bits={bits} |x|~{magnitude:g} factor={f}"
        y = jax.jit(lambda v: cuda.virtual_allreduce(v, cfg, factor=f))(x)
        same_bits(y, reference(x, cfg, rescale=True), what)
        st = ej.CompensatorState(state.m1 * magnitude, state.m2 * magnitude)
        y, new = jax.jit(lambda v, s: cuda.virtual_allreduce(v, cfg, s, factor=f))(x, st)
        ry, rnew = reference(x, cfg, st, rescale=True)
        same_bits(y, ry, what + " compensated y")
        same_bits(new.m1, rnew.m1, what + " compensated m1")
        same_bits(new.m2, rnew.m2, what + " compensated m2")
        exact = np.asarray(x, np.float64).sum(0)
        rel = np.linalg.norm(np.asarray(y, np.float64)[0] - exact) / np.linalg.norm(exact)
        assert rel < (0.2 if bits == 4 else 0.02), (what, rel)  # nothing lost to the floor
