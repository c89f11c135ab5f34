"""The two-timescale error-feedback compensator (Algorithm 1 of the Echo paper, Sec. 5.1).

Per rank and per pass direction the state is a pair of averages (m1, m2) of the residuals
u = x' - y_hat / P left by earlier sites, stored in `EchoConfig.state_dtype` (fp32 by default).
At site k:

    c  = eta * (a * m1 + (1 - a) * m2)          Eq. 10, correction
    x' = x + c                                  apply (fused into the collective's entry pass)
    y  = QAR(x')                                the quantized all-reduce
    u  = x' - y / P                             Eq. 4: the residuals of the group sum to -delta
    m1 = beta1 * m1 + (1 - beta1) * u           Eq. 11
    m2 = beta2 * m2 + (1 - beta2) * u

Bit-exact arithmetic (shared with the custom call): every coefficient is computed in float64 from
the config and rounded once to fp32 (`Coefficients`); c = (eta*a)*m1 + (eta*(1-a))*m2; y/P is
y * f32(1/P); each rounded product is materialised before it meets an addition (no fused
multiply-add), in the order written above.

State dtype (`EchoConfig.state_dtype`, "float32" or "bfloat16"): the apply step and the update
are computed in fp32 exactly as above whatever the storage dtype. A bfloat16 m1, m2 is widened to
fp32 (exactly) when read, and the new m1, m2, computed in fp32, are rounded to bfloat16 (round to
nearest even) when stored: x, y and u are never rounded, only the stored state. The rounding is
`lax.reduce_precision` to 8 exponent / 7 mantissa bits followed by the (then exact) conversion,
so XLA cannot drop it even where it allows excess precision (it may remove a convert pair
f32 -> bf16 -> f32). With "float32" nothing is rounded and every bit is as before. The fused
custom calls (CPU handler, CUDA kernels) take a bfloat16 state too and do the same in C++ (widen
on load, round to nearest even on store), so every transport gives the same bits.

The int8 state (`EchoConfig.state_dtype="int8"`): m1 and m2 are int8 codes in x's shape, and each
has one fp32 scale per group of STATE_GROUP = 128 consecutive values of the rank's flattened
array (`QuantizedMoment(codes, scales)`, scales [ceil(size / 128)]; the last group may be
short). A stored average v (fp32, one group) is

    s = the smallest power of two with 127 s >= max|v|   (0 when max|v| < 2^-100)
    q = rne(v / s)                                        (exact: s is a power of two)

and read back as q * s (exact). The scale is a power of two so that no implementation divides:
a quotient or reciprocal rounds differently on XLA's GPU backend than on a CPU, while s comes
from max|v|'s exponent and one comparison, and v / s, q * s are exact, so JAX, the CPU handler
and the CUDA kernels store the same bits. The step is s, between max|v| / 127 and twice that. A
non-finite value makes its group's scale non-finite (max|v| itself), so the whole group reads
back NaN (as a non-finite value poisons its wire group). The rounding enters the next
correction as a second-order term: each rank's residual u is data-scale, and 8 bits with a
per-group scale keep it to at most 1/127 of its group's largest value. Why a fixed group of
128 rather than the site's g: the state flows from site to site, and sites may use different
group sizes.

The int4 state (`EchoConfig.state_dtype="int4"`): the same with codes in [-7, 7] (`jnp.int4`,
which XLA packs two a byte, element 2i in the low nibble) and s the smallest power of two with
7 s >= max|v|: a step between max|v| / 7 and twice that. Near fp32's largest value a code
can read back as inf: for max|v| above 1.75 * 2^127 (about 2.98e38) s is 2^126 and a code of 4
or more is 2^128 or more (the same in every implementation: q * s overflows). Meant for the local residual
(`EchoConfig.residual="local"`), whose values are each rank's rounding errors: their 4-bit
rounding is a second-order term next to the wire's 4-bit error, and the state's bytes are most
of what the compensated call moves beyond the plain call.

Where the update runs (`EchoConfig.state_update`): "in_call" inside the all-reduce, where y is
produced; "separate" as its own op after the call (`update_beside`, the Echo paper Sec. 5.3 and
Appendix C): it recomputes x' from x, m1, m2 and takes y as the call returned it, and on GPUs it
is put on a second stream so that XLA can run it beside the next matrix multiplication.
"""

from __future__ import annotations

import dataclasses
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from echo_jax import _compat
from echo_jax.config import EchoConfig
from echo_jax.quant import _no_fma


#: Values per scale of the int8 and int4 states (`EchoConfig.state_dtype="int8"`, "int4").
STATE_GROUP = 128
#: The quantized states' code dtypes and their largest code.
STATE_LEVELS = {jnp.dtype(jnp.int8): 127, jnp.dtype(jnp.int4): 7}


class QuantizedMoment(NamedTuple):
    """One average of a quantized state (`EchoConfig.state_dtype="int8"` or "int4"): int8 or
    int4 codes in x's per-rank shape and their fp32 scales, one per STATE_GROUP values of the
    flattened array."""

    codes: jax.Array
    scales: jax.Array


class CompensatorState(NamedTuple):
    """State of one compensated site sequence, per rank: arrays of x's per-rank shape, in the
    state dtype (`EchoConfig.state_dtype`; fp32 by default); with the int8 state, each of m1,
    m2 is a `QuantizedMoment` (codes in x's shape, per-group scales)."""

    m1: jax.Array | QuantizedMoment
    m2: jax.Array | QuantizedMoment

    @property
    def quantized(self) -> bool:
        """Whether m1, m2 are int8 or int4 codes with per-group scales (`QuantizedMoment`)."""
        return isinstance(self.m1, QuantizedMoment)


def state_dtype(config: EchoConfig | None = None, dtype=None):
    """The storage dtype of a state: `dtype` if given, else config.state_dtype, else float32.

    Raises a ValueError if both are given and disagree, or `dtype` is not a state dtype.
    """
    if dtype is not None:
        name = EchoConfig(state_dtype=dtype).state_dtype  # validated, canonical name
        if config is not None and config.state_dtype != name:
            raise ValueError(f"init_state: dtype={name!r} disagrees with "
                             f"EchoConfig.state_dtype={config.state_dtype!r}")
        return jnp.dtype(name)
    if config is not None:
        if not isinstance(config, EchoConfig):
            raise ValueError(f"init_state: config must be an EchoConfig, got "
                             f"{type(config).__name__}")
        return jnp.dtype(config.state_dtype)
    return jnp.dtype(jnp.float32)


def leaf_kind(leaf, where: str = "echo_psum") -> str:
    """How `echo_psum` sums one leaf, and so whether `init_state` gives it a state: "exact"
    (bool, integer: `lax.psum`, no state) or "echo" (a float dtype); a ValueError that names the
    dtype and the fix for the others (complex).

    Args:
      leaf: an array, a ShapeDtypeStruct or a Python / NumPy scalar.
      where: the public function, for the message.
    """
    dtype = getattr(leaf, "dtype", None)
    dtype = jnp.dtype(jnp.result_type(leaf) if dtype is None else dtype)
    if dtype == jnp.bool_ or jnp.issubdtype(dtype, jnp.integer):
        return "exact"
    if jnp.issubdtype(dtype, jnp.floating):
        return "echo"
    if jnp.issubdtype(dtype, jnp.complexfloating):
        raise ValueError(
            f"{where}: dtype {dtype} is not supported: Echo quantizes each value to 4 or 8 bits "
            "against a real group scale, which has no meaning for complex values. Use "
            "lax.psum for them, or sum the real and imaginary parts as float arrays, "
            "e.g. re, im = echo_psum((x.real, x.imag), axis); x = lax.complex(re, im)")
    raise ValueError(f"{where}: dtype {dtype} is not supported; echo_psum sums floating-point "
                     "leaves with Echo and bool / integer leaves exactly (lax.psum)")


def init_state(x, config: EchoConfig | None = None, *, dtype=None, axis_name=None):
    """Zero state for contributions shaped like `x` (an array, a ShapeDtypeStruct, or a pytree).

    The state has the type `echo_psum` returns the new state in, so it can start a `lax.scan` /
    `lax.fori_loop` carry of compensated calls inside `jax.shard_map` (with the default
    `check_vma=True` as with False), under `jax.vmap` and outside both: inside a type-checked
    shard_map m1 and m2 are typed varying over the manual axes x varies over (as
    `jnp.zeros_like(x)` is) and those of `axis_name` (`lax.pcast(..., to="varying")`); elsewhere
    nothing is typed. Code that cast the state to varying itself drops that cast: JAX refuses
    `lax.pcast(..., to="varying")` of a value that varies over the axis already.

    Args:
      x: an array, a ShapeDtypeStruct, a Python scalar or a pytree of them (shapes, dtypes and
        varying axes are used, not values).
      config: the EchoConfig of the sites the state will go through: m1, m2 are made in its
        `state_dtype`. None: float32 (or `dtype`).
      dtype: the state dtype ("float32" or "bfloat16"), instead of or agreeing with config's.
      axis_name: the axis (or tuple of axes) the sites reduce over. Only needed inside a
        type-checked shard_map where x is not typed varying over it already (a replicated x,
        a ShapeDtypeStruct, a value made before the contribution): the new state
        `echo_psum` returns varies over the reduced axes, and a scan carry must keep its type.

    Returns:
      A `CompensatorState(m1, m2)` of zeros for an array of a float dtype, None for a bool or
      integer one (`echo_psum` sums those exactly, with no state); for a pytree, the same
      structure with one of those at each leaf: the form `echo_psum` takes for pytree inputs.

    Raises:
      ValueError: a complex leaf (echo_psum refuses it too), or a bad config / dtype.
    """
    dt = state_dtype(config, dtype)
    axes = () if axis_name is None else _compat.axis_names(axis_name)

    def one(leaf):
        if leaf_kind(leaf, "init_state") == "exact":
            return None
        try:
            varying = _compat.varying_axes(leaf)
        except TypeError:  # a ShapeDtypeStruct without a type JAX reads
            varying = frozenset()
        z = _compat.to_varying(jnp.zeros(jnp.shape(leaf), dt), tuple(varying) + axes)
        if dt not in STATE_LEVELS:
            return CompensatorState(z, z)
        s = _compat.to_varying(jnp.zeros((num_state_groups(z.size),), jnp.float32),
                               tuple(varying) + axes)
        return CompensatorState(QuantizedMoment(z, s), QuantizedMoment(z, s))

    return jax.tree.map(one, x)


@dataclasses.dataclass(frozen=True)
class Coefficients:
    """fp32 constants of Algorithm 1, each rounded once from float64."""

    ea: np.float32     # eta * a
    eb: np.float32     # eta * (1 - a)
    b1: np.float32     # beta1
    c1: np.float32     # 1 - beta1
    b2: np.float32     # beta2
    c2: np.float32     # 1 - beta2

    @classmethod
    def from_config(cls, config: EchoConfig) -> "Coefficients":
        e, a = float(config.eta), float(config.blend)
        f = np.float32
        return cls(f(e * a), f(e * (1.0 - a)), f(config.beta1), f(1.0 - config.beta1),
                   f(config.beta2), f(1.0 - config.beta2))


def num_state_groups(size: int) -> int:
    """Scales of a quantized state array of `size` values: ceil(size / STATE_GROUP)."""
    return -(-int(size) // STATE_GROUP)


def _grouped(v, size: int):
    """A flat array of `size` values as [groups, STATE_GROUP], zero-padded."""
    groups = num_state_groups(size)
    return jnp.pad(jnp.ravel(v), (0, groups * STATE_GROUP - size)).reshape(groups, STATE_GROUP)


#: Bits of fp32 2^-100: a group whose largest |v| is below it is stored as zeros (scale 0).
_STATE_TINY_BITS = np.uint32(27 << 23)
#: For each largest code L: (k, the mantissa bits of L / 2^k) with L * 2^(E-k) the largest value
#: of exponent E that the scale 2^(E-k) covers (127 / 64 = 1.984375, 7 / 4 = 1.75).
_STATE_FITS = {127: (6, np.uint32(0x007E0000)), 7: (2, np.uint32(0x00600000))}


def state_scale(amax, levels: int = 127):
    """A quantized state's scales and their inverses for groups whose largest |v| is amax
    (fp32): s = the smallest power of two with levels * s >= amax and 1 / s, both exact, from
    amax's bits (module docstring); s = 0, 1 / s = 0 below 2^-100; s = amax, 1 / s = 0 when not
    finite. levels: 127 (int8) or 7 (int4)."""
    k, mantissa = _STATE_FITS[levels]
    bits = lax.bitcast_convert_type(amax, jnp.uint32)
    finite = bits < np.uint32(0x7F800000)
    usable = finite & (bits >= _STATE_TINY_BITS)
    exponent = bits >> 23  # biased
    fits = bits <= ((bits & np.uint32(0x7F800000)) | mantissa)  # amax <= levels 2^(E-k)
    e = jnp.where(fits, exponent - k, exponent - (k - 1))  # s's biased exponent
    e = jnp.where(usable, e, np.uint32(127))  # (unused where not usable; keeps the shifts sane)
    s = lax.bitcast_convert_type(e << 23, jnp.float32)
    inv = lax.bitcast_convert_type((np.uint32(254) - e) << 23, jnp.float32)
    zero = np.float32(0)
    return (jnp.where(usable, s, jnp.where(finite, zero, amax)),
            jnp.where(usable, inv, zero))


def quantize_state(v32, dtype=jnp.int8):
    """An fp32 average (any shape) as a quantized state's (codes in v's shape, scales): per
    group of STATE_GROUP values of the flattened array, s the smallest power of two with L s >=
    max|v| and q = rne(v / s), L = 127 for int8 codes and 7 for int4 ones (`state_scale`, module
    docstring). A group with a non-finite value gets a non-finite scale and codes 0; one below
    2^-100 scale 0 and codes 0.

    Args:
      v32: the values, any shape (widened to fp32).
      dtype: the codes' dtype, jnp.int8 or jnp.int4.
    """
    dtype = jnp.dtype(dtype)
    levels = STATE_LEVELS[dtype]
    size = int(jnp.size(v32))
    g = _grouped(v32.astype(jnp.float32), size)
    scale, inv = state_scale(jnp.max(jnp.abs(g), axis=1), levels)
    # v * (1 / s) is exact; a NaN product (inf * 0 or a NaN) converts to 0, as XLA converts it.
    q = jnp.clip(jnp.round(g * inv[:, None]), -levels, levels).astype(jnp.int8)
    return q.reshape(-1)[:size].reshape(jnp.shape(v32)).astype(dtype), scale


def dequantize_state(q, scale):
    """A quantized state's codes (int8 or int4, any shape) and scales as fp32 values in q's
    shape: q * s."""
    size = int(jnp.size(q))
    g = _grouped(q.astype(jnp.float32), size)
    return (g * scale[:, None]).reshape(-1)[:size].reshape(jnp.shape(q))


def _widen(m):
    """A stored average as fp32 (exact for a bfloat16 state; no op for fp32; q * s for int8 and
    int4)."""
    if isinstance(m, QuantizedMoment):
        return dequantize_state(m.codes, m.scales)
    return m if jnp.result_type(m) == jnp.float32 else m.astype(jnp.float32)


def _store(v32, dtype):
    """An fp32 average rounded to the state dtype (to nearest even), as stored."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float32:
        return v32
    if dtype != jnp.bfloat16:
        raise ValueError(f"compensator state dtype must be float32 or bfloat16, got {dtype}")
    # reduce_precision rounds to nearest even like the convert, and XLA keeps it even where it
    # allows excess precision; the convert that follows is then exact.
    return lax.reduce_precision(v32, exponent_bits=8, mantissa_bits=7).astype(dtype)


def flat_state(state: CompensatorState) -> CompensatorState:
    """The state with its arrays (a quantized state's codes) flattened; scales stay as they
    are."""
    def flat(m):
        return QuantizedMoment(jnp.ravel(m.codes), m.scales) if isinstance(
            m, QuantizedMoment) else jnp.ravel(m)
    return CompensatorState(flat(state.m1), flat(state.m2))


def shaped_state(state: CompensatorState, shape) -> CompensatorState:
    """`flat_state` undone: the arrays (a quantized state's codes) reshaped to `shape`."""
    def shaped(m):
        return QuantizedMoment(m.codes.reshape(shape), m.scales) if isinstance(
            m, QuantizedMoment) else m.reshape(shape)
    return CompensatorState(shaped(state.m1), shaped(state.m2))


def moments(state: CompensatorState):
    """(m1, m2) of a state as fp32 values in their shape, whatever the state dtype."""
    return _widen(state.m1), _widen(state.m2)


def stored_like(n1, n2, state: CompensatorState) -> CompensatorState:
    """New fp32 averages n1, n2 stored in the format of `state` (its dtype; int8 codes and
    scales for an int8 or int4 state)."""
    if state.quantized:
        return CompensatorState(QuantizedMoment(*quantize_state(n1, state.m1.codes.dtype)),
                                QuantizedMoment(*quantize_state(n2, state.m2.codes.dtype)))
    return CompensatorState(_store(n1, jnp.result_type(state.m1)),
                            _store(n2, jnp.result_type(state.m2)))


def apply_correction(x32, state: CompensatorState, k: Coefficients):
    """x' = x + eta (a m1 + (1 - a) m2), in fp32 (Eq. 10); the state is widened to fp32."""
    m1, m2 = moments(state)
    p1, p2 = _no_fma(k.ea * m1, k.eb * m2)
    return x32 + (p1 + p2)


def update_state(x_prime, y32, num_ranks: int, state: CompensatorState,
                 k: Coefficients) -> CompensatorState:
    """Residual u = x' - y/P and the two moving averages (Eq. 4 and Eq. 11), in fp32.

    The new m1, m2 are returned in the format of `state`'s (rounded to nearest even if that is
    bfloat16; unchanged bits for fp32; codes and scales for int8 and int4, `stored_like`).
    """
    t = _no_fma(y32 * np.float32(1.0 / num_ranks))
    return update_with_residual(x_prime - t, state, k)


def update_with_residual(u, state: CompensatorState, k: Coefficients) -> CompensatorState:
    """The two moving averages (Eq. 11) from a residual u (fp32, the state's flat or full
    shape): m_j = beta_j m_j + (1 - beta_j) u, each product rounded before the sum. Used with
    u = x' - y/P (`update_state`) and with the local residual (`EchoConfig.residual="local"`,
    `echo_jax.transports.xla.xla_allreduce_local`). Returns the state's format."""
    m1, m2 = moments(state)
    q1, r1, q2, r2 = _no_fma(k.b1 * m1, k.c1 * u, k.b2 * m2, k.c2 * u)
    return stored_like(q1 + r1, q2 + r2, state)


#: Environment variable: the GPU stream (an int >= 1) the separate update runs on
#: (`EchoConfig.state_update="separate"`, `update_beside`); 0 leaves it on XLA's compute stream,
#: one op after the call like any other (to measure what the second stream buys). Default 1.
UPDATE_STREAM_ENV = "ECHO_JAX_UPDATE_STREAM"


def update_stream() -> int:
    """The stream of the separate update from ECHO_JAX_UPDATE_STREAM (default 1; 0: none)."""
    raw = os.environ.get(UPDATE_STREAM_ENV, "").strip()
    if raw == "":
        return 1
    try:
        stream = int(raw)
    except ValueError:
        stream = -1
    if not 0 <= stream <= 64:
        raise ValueError(f"{UPDATE_STREAM_ENV} must be an int in [0, 64] (0: the update stays on "
                         f"XLA's compute stream), got {raw!r}")
    return stream


def update_beside(x, y, num_ranks: int, state: CompensatorState, k: Coefficients,
                  stream: int = 0) -> CompensatorState:
    """The update step as its own op after the all-reduce (`EchoConfig.state_update="separate"`).

    The Echo paper Sec. 5.3: the update reads x, y, m1, m2 and writes m1, m2 (with the reads of
    m1, m2 at entry, its "about eight tensor-sized arrays"), recomputing x' = x + c (Eq. 10) from
    x, m1, m2, then u = x' - y / P (Eq. 4) and the averages (Eq. 11): `apply_correction` and
    `update_state`, the same arithmetic as the fused calls. y is the sum as the call returned it
    (widened exactly from x's dtype), so for float32 x every bit equals the in-call update; a
    16-bit y also feeds its own rounding back.

    Args:
      x: this rank's contribution before correction, any supported dtype, in m1's shape.
      y: the all-reduce's result for x' (x's shape and dtype).
      num_ranks: P.
      state: the state the call read (its m1, m2 are not changed by the call).
      k: the config's coefficients.
      stream: a GPU stream number >= 1: the update is one computation annotated for that stream
        (`jax.experimental.compute_on`), which XLA runs asynchronously beside the ops that do
        not need its result (the next matrix multiplication); 0: a plain op on the compute
        stream. Only meaningful on GPUs (other platforms run it inline either way).

    Returns:
      The new CompensatorState, in the state's dtype and shape.
    """

    def update(x, y, m):
        x_prime = apply_correction(x.astype(jnp.float32), m, k)
        return tuple(update_state(x_prime, y.astype(jnp.float32), num_ranks, m, k))

    if stream:
        from jax.experimental.compute_on import compute_on

        update = compute_on(compute_type=f"gpu_stream:{int(stream)}",
                            out_memory_spaces=jax.memory.Space.Device)(update)
    return CompensatorState(*update(x, y, state))


#: The dtype that carries an int8 state's codes where the state travels as a cotangent (the
#: backward sites of `echo_jax.tp`): JAX gives an int8 array a float0 cotangent, which holds no
#: values. float8_e4m3fnuz has the same 8 bits (`lax.bitcast_convert_type`, free in XLA), one
#: zero and one NaN (bits 0x80, the code -128, which the state never stores: codes are clipped
#: to +-127), so a code plus a zero cotangent keeps its bits.
CODES_CARRIER = jnp.dtype(jnp.float8_e4m3fnuz)
#: The same for the int4 state's codes: float4_e2m1fn has their 4 bits, no NaN and no inf, and
#: two zeros (bits 0x0 and 0x8: the code -8, which the state never stores: codes are clipped to
#: +-7), so a code plus a zero cotangent keeps its bits.
CODES_CARRIER_4 = jnp.dtype(jnp.float4_e2m1fn)
_CARRIERS = {jnp.dtype(jnp.int8): CODES_CARRIER, jnp.dtype(jnp.int4): CODES_CARRIER_4}


def as_carrier(state):
    """A state (or a pytree of them, None leaves kept) with a quantized state's codes bitcast
    to CODES_CARRIER (int8) or CODES_CARRIER_4 (int4), the form a backward site threads; other
    states are returned as they are.

    Args:
      state: a `CompensatorState`, a pytree of them, or None.

    Returns:
      The same structure; each `QuantizedMoment`'s codes in its carrier (bits unchanged).
    """
    return _map_codes(state, _CARRIERS)


def from_carrier(state):
    """`as_carrier` undone: a quantized state's codes back to int8 / int4 (bits unchanged)."""
    return _map_codes(state, {c: d for d, c in _CARRIERS.items()})


def _map_codes(state, dtypes):
    def one(m):
        dt = isinstance(m, QuantizedMoment) and dtypes.get(jnp.dtype(jnp.result_type(m.codes)))
        if dt:
            return QuantizedMoment(lax.bitcast_convert_type(m.codes, dt), m.scales)
        return m
    return jax.tree.map(one, state, is_leaf=lambda m: isinstance(m, QuantizedMoment))


def to_varying_state(state: CompensatorState | None, axis) -> CompensatorState | None:
    """The state typed as varying over `axis` (m1 and m2 each, `_compat.to_varying`), so that it
    can meet a varying contribution in a type-checked shard_map; None stays None.

    Args:
      state: a CompensatorState, or None.
      axis: the manual axis (no-op for a vmap axis or an unchecked shard_map).
    """
    if state is None:
        return None
    return jax.tree.map(lambda a: _compat.to_varying(a, axis), state)


def check_state(state, x, where: str = "echo_psum", config: EchoConfig | None = None) -> None:
    """Raise a ValueError that names the problem if `state` does not fit contribution `x`.

    The state's dtype must be config.state_dtype (float32 when config is None); an int8 or
    int4 state's m1, m2 are `QuantizedMoment`s with fp32 scales of ceil(size / STATE_GROUP)
    values.
    """
    if not isinstance(state, CompensatorState):
        raise ValueError(
            f"{where}: state must be a CompensatorState(m1, m2) (see echo_jax.init_state), "
            f"got {type(state).__name__}")
    want = jnp.dtype(config.state_dtype if config is not None else jnp.float32)
    groups = (num_state_groups(jnp.size(x)),)
    for name, m in (("m1", state.m1), ("m2", state.m2)):
        quantized = want in STATE_LEVELS
        if quantized != isinstance(m, QuantizedMoment):
            raise ValueError(
                f"{where}: state.{name} must be " + (
                    f"a QuantizedMoment(codes, scales) for EchoConfig.state_dtype={want.name!r}"
                    if quantized else f"a {want} array (EchoConfig.state_dtype="
                    f"{want.name!r}), got a QuantizedMoment") + "; use init_state(x, config)")
        arr = m.codes if isinstance(m, QuantizedMoment) else m
        if jnp.shape(arr) != jnp.shape(x):
            raise ValueError(f"{where}: state.{name} has shape {jnp.shape(arr)} but the "
                             f"contribution has shape {jnp.shape(x)}; use init_state(x)")
        if jnp.result_type(arr) != want:
            raise ValueError(
                f"{where}: state.{name} must be {want} (EchoConfig.state_dtype="
                f"{want.name!r}), got {jnp.result_type(arr)}; use init_state(x, config)")
        if isinstance(m, QuantizedMoment) and (
                jnp.shape(m.scales) != groups or jnp.result_type(m.scales) != jnp.float32):
            raise ValueError(
                f"{where}: state.{name}.scales must be float32 of shape {groups} (one per "
                f"{STATE_GROUP} values), got {jnp.shape(m.scales)} "
                f"{jnp.result_type(m.scales)}; use init_state(x, config)")


__all__ = ["CompensatorState", "QuantizedMoment", "CODES_CARRIER", "as_carrier", "from_carrier",
           "flat_state", "shaped_state", "STATE_GROUP", "num_state_groups", "quantize_state",
           "dequantize_state", "moments", "stored_like", "init_state", "leaf_kind", "state_dtype", "Coefficients",
           "apply_correction", "update_state", "update_beside", "update_stream",
           "UPDATE_STREAM_ENV", "to_varying_state"]
