"""`EchoConfig.state_dtype="int4"` in the fused CPU custom call (`echo_allreduce_comp_q8_cpu`).

The int4 state (compensator module docstring: codes in [-7, 7] as `jnp.int4`, one power-of-two
scale per 128 values) enters the call as XLA's packed int4 array, two codes a byte, element 2i in
the low nibble of byte i; the call picks the int4 format from the codes' element type (S4). So
these tests check the call against the xla transport (the JAX reference, Algorithm 1 in JAX) bit
for bit, in y and in every code and scale of both averages, after several sites (a nonzero
state, read back through the packed codes), with both residuals ("output": u = x' - y / P;
"local": each rank's own rounding errors), fp32 and bf16 x, and odd layouts (n below a group,
not a multiple of 128, odd: a last byte with one code); and that a call given int8 and int4
averages together says which operand is wrong.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import echo_jax as ej
from echo_jax import transports
from conftest import quantized_state_sites

F32 = np.float32
INT4 = ej.EchoConfig(bits=4, transport="xla", state_dtype="int4")

pytestmark = pytest.mark.skipif(transports.cpu.module_reason() is not None,
                                reason="the CPU custom call is not built")


def _assert_same_bits(got_y, want_y, got_state, want_state):
    """y and every leaf of the state (int4 codes, fp32 scales) equal bit for bit; NaN where
    both are NaN (a poisoned group's sums and scale)."""
    gy, wy = np.asarray(got_y, F32), np.asarray(want_y, F32)
    both_nan = np.isnan(gy) & np.isnan(wy)
    np.testing.assert_array_equal(np.where(both_nan, 0, gy).view(np.uint32),
                                  np.where(both_nan, 0, wy).view(np.uint32))
    for got, want in zip(jax.tree.leaves(got_state), jax.tree.leaves(want_state), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        if got.dtype == jnp.int4:
            # Compare the codes as int8 values (NumPy's view of int4 is one code a byte).
            np.testing.assert_array_equal(np.asarray(got.astype(jnp.int8)),
                                          np.asarray(want.astype(jnp.int8)))
        else:
            got, want = np.asarray(got), np.asarray(want)
            assert got.dtype == np.float32
            assert np.array_equal(np.isnan(got), np.isnan(want))
            np.testing.assert_array_equal(np.where(np.isnan(got), 0, got).view(np.uint32),
                                          np.where(np.isnan(want), 0, want).view(np.uint32))


def _check_against_reference(cfg, xs, steps, rescale, init=None):
    (y_call, s_call), f = quantized_state_sites(cfg, xs, steps, rescale, init)
    # The fused call ran (not the plan's JAX fallback), with int4 codes as its operands.
    text = f.lower(xs).as_text()
    assert "echo_allreduce_comp_q8_cpu" in text and "xi4>" in text
    (y_ref, s_ref), _ = quantized_state_sites(cfg.replace(transport="xla"), xs, steps, rescale,
                                               init)
    assert s_call.m1.codes.dtype == jnp.int4
    _assert_same_bits(y_call, y_ref, s_call, s_ref)
    return s_call


@pytest.mark.parametrize("dtype, residual", [(jnp.float32, "output"), (jnp.bfloat16, "local")],
                         ids=["f32-output", "bf16-local"])
def test_the_cpu_call_matches_the_jax_path_bit_for_bit(dtype, residual):
    """Three sites on 4 ranks, n = 301 (a short last group of 45 values, an odd count: the
    last byte holds one code), rescaled; a NaN in rank 1's second group poisons that group's
    sums and, with the output residual, every rank's state group there."""
    n = 301
    xs = np.asarray(jax.random.normal(jax.random.key(5), (4, n)), F32) * 3
    if residual == "output":
        xs[1, 140] = np.nan
    xs = jnp.asarray(xs).astype(dtype)
    cfg = INT4.replace(transport="p2p", residual=residual)
    s = _check_against_reference(cfg, xs, 3, True)
    # The state the sites carried is not the zero it started from: the codes read back matter.
    codes = np.asarray(s.m1.codes.astype(jnp.int8))
    assert (codes != 0).mean() > 0.3 and np.abs(codes).max() == 7
    if residual == "output":
        assert np.isnan(np.asarray(s.m1.scales)).any()


@pytest.mark.slow
@pytest.mark.parametrize("nranks, n", [(3, 5), (8, 300), (8, 1025), (2, 127), (4, 1024)])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("residual", ["output", "local"])
def test_the_cpu_call_matches_the_jax_path_on_odd_layouts(nranks, n, dtype, residual):
    """The grid behind the case above: P up to 8 (segments of padding alone), n below one group,
    not a multiple of 128 and odd, both bit widths (odd n: 8 bits), large values (x 50,
    rescaled), three sites."""
    xs = np.asarray(jax.random.normal(jax.random.key(nranks * 1000 + n), (nranks, n)), F32)
    xs = jnp.asarray(xs * 50).astype(dtype)
    cfg = INT4.replace(transport="p2p", residual=residual, bits=8 if n % 2 else 4)
    _check_against_reference(cfg, xs, 3, True)


@pytest.mark.slow
def test_the_rotated_call_matches_the_jax_path():
    """The output residual with the Hadamard rotation (the state stays unrotated)."""
    xs = jnp.asarray(np.asarray(jax.random.normal(jax.random.key(9), (4, 300)), F32) * 3)
    _check_against_reference(INT4.replace(transport="p2p", rotation="hadamard"), xs, 3, "auto")


def test_the_packed_codes_are_xla_s_int4_layout():
    """One site on two ranks from a state the test writes (random codes over [-7, 7], so both
    nibbles of a byte and both signs occur): the call reads the packed codes as JAX wrote them
    (element 2i in the low nibble of byte i, two's complement) and the codes it stores read back
    in JAX as the reference's, code for code; odd n = 131 puts one code in the last byte, and
    m2's second group has scale 0."""
    from echo_jax import compensator as comp
    n = 131
    rng = np.random.default_rng(3)
    m1 = comp.QuantizedMoment(jnp.asarray(rng.integers(-7, 8, n), jnp.int4),
                              jnp.asarray([2.0 ** -3, 2.0 ** -5], jnp.float32))
    m2 = comp.QuantizedMoment(jnp.asarray(rng.integers(-7, 8, n), jnp.int4),
                              jnp.asarray([2.0 ** -4, 0.0], jnp.float32))
    xs = jnp.asarray(rng.normal(size=(2, n)).astype(F32))  # 2 ranks: one runs no call
    for residual in ("output", "local"):
        _check_against_reference(INT4.replace(transport="p2p", residual=residual), xs, 1, "auto",
                                 init=lambda x: comp.CompensatorState(m1, m2))


def test_mixed_int8_and_int4_codes_name_the_operand():
    """m1 int8 and m2 int4: refused in Python, naming m2_flat, its dtype and the fix; and by the
    call itself (the custom call reached directly), naming the operand."""
    from echo_jax.transports import cpu
    x = jnp.zeros((256,), jnp.float32)
    s4 = ej.init_state(x, INT4)
    s8 = ej.init_state(x, INT4.replace(state_dtype="int8"))
    cfg = INT4.replace(transport="p2p")
    with pytest.raises(ValueError, match=r"m2_flat must be a QuantizedMoment of int4 codes.*"
                                         r"got codes int8"):
        jax.vmap(lambda v: cpu.allreduce_compensated(v, s4.m1, s8.m2, "tp", 1, cfg),
                 axis_name="tp")(x[None])
    with pytest.raises(ValueError, match=r"m1_flat must be a QuantizedMoment of int4 codes.*"
                                         r"got codes int8"):
        jax.vmap(lambda v: cpu.allreduce_compensated(v, s8.m1, s4.m2, "tp", 1, cfg),
                 axis_name="tp")(x[None])

    # The call's own check, past the Python one: int8 m1, int4 m2.
    cpu._register("cpu")
    state = [s8.m1.codes, s8.m1.scales, s4.m2.codes, s4.m2.scales]
    types = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in state)
    call = jax.ffi.ffi_call(cpu.TARGET_COMPENSATED_Q8,
                            (jax.ShapeDtypeStruct((256,), jnp.float32),) + types,
                            vmap_method="sequential",
                            input_output_aliases={i + 1: i + 1 for i in range(4)})
    f32 = np.float32
    attrs = dict(num_ranks=1, bits=4, group_size=128, policy=0, segment_groups=2, site=10**6,
                 timeout_ms=10_000, debug_absent_rank=-1, debug_failing_rank=-1,
                 debug_failing_stage=0, debug_failure="", rotate=0, ea=f32(0), eb=f32(0),
                 b1=f32(0), c1=f32(0), b2=f32(0), c2=f32(0), inv_p=f32(1), residual_local=0)
    coords = jnp.zeros((2,), jnp.int32)
    with pytest.raises(Exception, match=r"int8 state's m2 must be int8 codes.*got int4 codes"):
        jax.block_until_ready(
            jax.jit(lambda v: call(v, *state, coords, jnp.ones((1,), jnp.float32), **attrs))(x))
