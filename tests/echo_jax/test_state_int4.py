"""`EchoConfig.state_dtype="int4"`: the compensator state as 4-bit codes with a per-group scale.

The format (compensator module docstring): per group of 128 consecutive values of a rank's
flattened average, s the smallest power of two with 7 s >= max|v| (0 below 2^-100), q =
clip(rne(v / s), -7, 7), read back as q * s. Here: the codes as XLA stores a `jnp.int4` array
(two a byte, element 2i in the low nibble), the layout the custom calls read; Algorithm 1 with
the local residual on the values read back against the NumPy reference, the plan and the GSPMD
refusal. The format against the NumPy reference, a scan carry and a backward site's carrier
run in test_state_int8.py for both quantized states. The CPU call bit for bit
against the JAX path: tests/echo_jax/test_state_int4_cpu.py; the CUDA kernels:
tests/echo_jax/test_p2p_cuda.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import echo_jax as ej
from echo_jax import compensator as comp
from echo_jax import transports
from np_reference import coefficients, state_quantize, state_read

F32 = np.float32
INT4 = ej.EchoConfig(bits=4, transport="xla", state_dtype="int4", residual="local")


def ref_quantize(v):
    """The NumPy reference of the state (`np_reference.state_quantize`, levels 7)."""
    return state_quantize(v, 7)


ref_read = state_read


def codes_of(q):
    """The int4 codes as int8 values (NumPy widens ml_dtypes' int4 exactly)."""
    return np.asarray(q).astype(np.int8)


def test_xla_packs_the_codes_two_a_byte_low_nibble_first():
    """The layout the custom calls read: element 2i in the low nibble of byte i, two's
    complement (what `lax.bitcast_convert_type` of pairs shows of XLA's packed int4)."""
    q = jnp.asarray(np.array([1, -2, 7, -7, 0, 3], np.int8)).astype(jnp.int4)
    b = jax.jit(lambda a: lax.bitcast_convert_type(a.reshape(-1, 2), jnp.uint8))(q)
    assert [int(v) for v in b] == [0xE1, 0x97, 0x30]


def test_zero_and_non_finite_groups():
    v = np.zeros(384, F32)
    v[130] = np.nan
    v[300] = 2.0
    q, s = comp.quantize_state(jnp.asarray(v).reshape(3, 128), jnp.int4)
    back = np.asarray(comp.dequantize_state(q, s)).reshape(-1)
    assert q.shape == (3, 128)
    assert np.all(back[:128] == 0) and float(s[0]) == 0.0
    assert np.all(np.isnan(back[128:256]))
    assert back[300] == 2.0 and np.all(back[256:300] == 0)


def test_init_check_and_config():
    x = jnp.ones((3, 100), jnp.bfloat16)
    st = ej.init_state(x, INT4)
    assert st.quantized and st.m1.codes.dtype == jnp.int4 and st.m1.codes.shape == (3, 100)
    assert st.m1.scales.dtype == jnp.float32 and st.m1.scales.shape == (3,)
    comp.check_state(st, x, config=INT4)
    with pytest.raises(ValueError, match=r"state\.m1 must be int8 .*got int4"):
        comp.check_state(st, x, config=INT4.replace(state_dtype="int8"))
    assert ej.EchoConfig(state_dtype=jnp.int4).state_dtype == "int4"
    with pytest.raises(ValueError, match=r"state_dtype='int4'\) needs beta2 to be 0 or at least"):
        ej.EchoConfig(state_dtype="int4", beta2=2.0 ** -22)


def test_one_call_matches_algorithm_1_with_the_local_residual_and_the_int4_store():
    """The xla transport's call with residual="local": x' = x + c from the state read back
    (Eq. 10), each rank's residual as `xla_allreduce_local` defines it, then Eq. 11 stored in
    the int4 format; the NumPy side rebuilds the averages from the codes and the residual."""
    from echo_jax.transports.xla import xla_allreduce_local
    nranks, n = 4, 300
    x = jax.random.normal(jax.random.key(1), (nranks, n))
    m1 = 0.05 * jax.random.normal(jax.random.key(2), (nranks, n))
    m2 = 0.05 * jax.random.normal(jax.random.key(3), (nranks, n))
    st = jax.vmap(lambda a, b: comp.CompensatorState(
        comp.QuantizedMoment(*comp.quantize_state(a, jnp.int4)),
        comp.QuantizedMoment(*comp.quantize_state(b, jnp.int4))))(m1, m2)
    f = jax.jit(jax.vmap(lambda v, s: ej.echo_psum(v, "tp", config=INT4, state=s,
                                                   rescale=False), axis_name="tp"))
    y, new = f(x, st)
    ea, eb, b1, c1, b2, c2 = coefficients(INT4)
    xps = []
    for r in range(nranks):
        a1 = ref_read(codes_of(st.m1.codes[r]), np.asarray(st.m1.scales[r]))
        a2 = ref_read(codes_of(st.m2.codes[r]), np.asarray(st.m2.scales[r]))
        xps.append(np.asarray(x[r], F32) + ((ea * a1).astype(F32) + (eb * a2).astype(F32)))
    _, u = jax.jit(jax.vmap(lambda v: xla_allreduce_local(v, "tp", nranks, INT4),
                            axis_name="tp"))(jnp.asarray(np.stack(xps)))
    for r in range(nranks):
        a1 = ref_read(codes_of(st.m1.codes[r]), np.asarray(st.m1.scales[r]))
        a2 = ref_read(codes_of(st.m2.codes[r]), np.asarray(st.m2.scales[r]))
        ur = np.asarray(u[r], F32)
        for got, m, b, c in ((new.m1, a1, b1, c1), (new.m2, a2, b2, c2)):
            rq, rs = ref_quantize((b * m).astype(F32) + (c * ur).astype(F32))
            np.testing.assert_array_equal(codes_of(got.codes[r]), rq)
            np.testing.assert_array_equal(np.asarray(got.scales[r]).view(np.uint32),
                                          rs.view(np.uint32))
    # Every code range is used: the test would see a wrong clip or scale rule.
    assert np.abs(codes_of(new.m1.codes)).max() == 7


def test_the_plan_fuses_it_where_a_wire_group_is_a_state_group():
    t = transports.CPU
    rotation, compensation, reasons = transports.call_modes(t, INT4.replace(transport="p2p"),
                                                            "int4")
    if "int4" in transports.fused_state_dtypes(t):
        assert compensation == "fused", reasons
    rotation, compensation, reasons = transports.call_modes(
        t, INT4.replace(transport="p2p", group_size=64), "int4")
    why = ("int4 state needs group_size 128" if "int4" in transports.fused_state_dtypes(t)
           else "the call takes no int4 state")
    assert compensation == "jax" and any(why in r for r in reasons), reasons


def test_the_gspmd_helpers_refuse_it_with_the_fix():
    from echo_jax import gspmd
    with pytest.raises(ValueError, match=r"state_for: .*'int4'.*use state_dtype='float32'"):
        gspmd.state_for(jax.ShapeDtypeStruct((4, 8), jnp.float32), axis="tp",
                        mesh=jax.make_mesh((1,), ("tp",)), config=INT4)
