"""The Hadamard rotation inside the CUDA all-reduce (`EchoConfig.rotation="hadamard"`, ffi/p2p_cuda.cu:
FastStages<..., ROT> and RotatedGenericStages) against the pure-JAX reference (the "xla"
transport, which rotates with `echo_jax.rotation` around the unrotated protocol), bit for bit.

Fast stages: 16-byte aligned rows and g in {32, 64, 128, 256}, the butterflies in registers and
shuffles; generic stages: any other power-of-two g up to 1024 or unaligned rows, the butterflies in
shared memory. Rows end in a partial group, whose padding the rotation fills. Marked `gpu`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import echo_jax as ej
from echo_jax import policies
from conftest import cuda_handlers, reference_allreduce as reference
from test_allreduce_fast_cuda import adversarial, same_bits

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda():
    return cuda_handlers()


def check_case(cuda, x, cfg, what):
    y = jax.jit(lambda v: cuda.virtual_allreduce(v, cfg))(x)
    same_bits(y, reference(x, cfg), what)
    state = ej.CompensatorState(0.01 * jax.random.normal(jax.random.key(3), x.shape),
                                -0.02 * jax.random.normal(jax.random.key(4), x.shape))
    step = jax.jit(lambda v, s: cuda.virtual_allreduce(v, cfg, s))
    ref_step = jax.jit(lambda v, s: reference(v, cfg, s))
    rs = state
    for i in range(2):  # two steps: the second applies the state the first updated
        y, state = step(x, state)
        ry, rs = ref_step(x, rs)
        same_bits(y, ry, f"{what} compensated y (step {i})")
        same_bits(state.m1, rs.m1, f"{what} compensated m1 (step {i})")
        same_bits(state.m2, rs.m2, f"{what} compensated m2 (step {i})")


FAST = [(dtype, g, bits) for dtype in (jnp.float32, jnp.bfloat16, jnp.float16)
        for g in (32, 64, 128, 256) for bits in (4, 8)]


@pytest.mark.parametrize("dtype,g,bits", FAST,
                         ids=[f"{jnp.dtype(d).name}-g{g}-b{b}" for d, g, b in FAST])
def test_rotated_fast_stages_match_reference(cuda, dtype, g, bits):
    num_ranks = {32: 4, 64: 3, 128: 4, 256: 2}[g]
    n = 23 * g + 8  # aligned rows for every dtype, a partial last group
    x = adversarial(num_ranks, n, g, dtype, seed=g + bits)
    for policy in policies.NAMES:
        cfg = ej.EchoConfig(bits=bits, group_size=g, policy=policy, rotation="hadamard")
        check_case(cuda, x, cfg, f"{jnp.dtype(dtype).name} g={g} bits={bits} {policy}")


GENERIC = [(2, 8, 3, jnp.float32), (8, 4, 2, jnp.bfloat16), (512, 4, 4, jnp.float32),
           (1024, 8, 3, jnp.float16), (128, 4, 4, jnp.float32)]


@pytest.mark.parametrize("g,bits,num_ranks,dtype", GENERIC,
                         ids=[f"g{g}-b{b}-P{p}-{jnp.dtype(d).name}" for g, b, p, d in GENERIC])
def test_rotated_generic_stages_match_reference(cuda, g, bits, num_ranks, dtype):
    n = 11 * max(g, 16) + 3  # unaligned rows: the generic stages for every g
    x = adversarial(num_ranks, n, max(g, 16), dtype, seed=g)
    for policy in policies.NAMES:
        cfg = ej.EchoConfig(bits=bits, group_size=g, policy=policy, rotation="hadamard")
        check_case(cuda, x, cfg, f"generic g={g} bits={bits} {policy}")


def test_rotation_spreads_an_outlier_channel(cuda):
    # What the rotation is for: one outlier channel per group sets the unrotated group's scale;
    # rotated, the other values keep their resolution. Error against the float64 sum.
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 128 * 512)).astype(np.float32)
    x[:, ::128] *= 300.0
    exact = x.astype(np.float64).sum(0)
    errs = {}
    for rotation in ("none", "hadamard"):
        cfg = ej.EchoConfig(bits=4, rotation=rotation)
        y = np.asarray(jax.jit(lambda v: cuda.virtual_allreduce(v, cfg))(jnp.asarray(x)))[0]
        keep = np.ones(exact.size, bool)
        keep[::128] = False  # the ordinary channels
        errs[rotation] = np.linalg.norm((y - exact)[keep]) / np.linalg.norm(exact[keep])
    assert errs["hadamard"] < 0.5 * errs["none"], errs


@pytest.mark.parametrize("aligned", [True, False])
def test_rotation_with_a_factor_matches_rescaled_reference(cuda, aligned):
    # The factor multiplies x before the rotation and divides the sum after the inverse
    # rotation, as the xla transport's rescaled rotation does (the factor from x, sqrt(g) lower).
    n = 4096 + 8 if aligned else 4099
    base = jax.random.normal(jax.random.key(n), (4, n), jnp.float32)
    state = ej.CompensatorState(0.01 * jax.random.normal(jax.random.key(1), base.shape),
                                -0.02 * jax.random.normal(jax.random.key(2), base.shape))
    cfg = ej.EchoConfig(bits=4, rotation="hadamard")
    for magnitude in (2.0 ** -100, 1e-9, 1.0, 1e7):
        x = base * magnitude
        f = jax.vmap(lambda r: ej.collective.rescale_factor(
            r, "tp", True, ej.collective.rotation_headroom_log2(cfg)), axis_name="tp")(x)[0]
        what = f"n={n} |x|~{magnitude:g}"
        y = jax.jit(lambda v: cuda.virtual_allreduce(v, cfg, factor=f))(x)
        same_bits(y, reference(x, cfg, rescale=True), what)
        st = ej.CompensatorState(state.m1 * magnitude, state.m2 * magnitude)
        y, new = jax.jit(lambda v, s: cuda.virtual_allreduce(v, cfg, s, factor=f))(x, st)
        ry, rnew = reference(x, cfg, st, rescale=True)
        same_bits(y, ry, what + " compensated y")
        same_bits(new.m1, rnew.m1, what + " compensated m1")


def test_rotation_rejects_what_the_kernels_cannot_rotate(cuda):
    x = jnp.ones((2, 4096), jnp.float32)
    with pytest.raises(ValueError, match="at most 1024"):
        cuda.virtual_allreduce(x, ej.EchoConfig(group_size=2048, rotation="hadamard"))
