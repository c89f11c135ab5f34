r"""The Echo group quantizer: the one definition of the wire format (pure JAX reference).

Every implementation (this file, the CPU handler and the CUDA kernels of the custom call) follows
the formulas below bit for bit. All arithmetic is IEEE fp32 with round-to-nearest-even; ``f16(v)``
is the fp32 -> fp16 conversion with round-to-nearest-even, ``bf16(v)`` the fp32 -> bf16 one,
``bf16_up(v)`` (for v >= 0) the smallest bf16 >= v, ``rne`` rounds to the nearest integer with ties
to even, ``1/s`` is the correctly rounded fp32 reciprocal, taken as 0 when |s| is below fp32's
normal range (a 65536-entry table over the bf16 patterns of s here).

Layout
------
A group is g consecutive values x_0 .. x_{g-1}. Its codes are unsigned b-bit integers; at 4 bits two
codes share a byte, code 2k in the low nibble and code 2k+1 in the high nibble; at 8 bits one code is
one byte. Its parameters are two 16-bit words: a scale s in bf16 (all policies) and a zero-point z
in fp16 (asymmetric policies only). Wire bytes per group: g*b/8 + 2 (sym) or g*b/8 + 4 (asym): 68
bytes per 128 values at 4 bits.

Why these two formats: the scale carries the group's magnitude, so it takes bf16's 8-bit exponent
(fp32's range: no input needs rescaling to fit it); the zero-point counts steps (|z| <= 1024, see
below), so it takes fp16's 11-bit significand, which holds it to a quarter step. The scale is
rounded up, so bf16's shorter significand only makes the step up to 2^-7 coarser, never clips.

Dequantization (all policies)
-----------------------------
    m = -(z * s)                  (exact in fp32: z has 11 significant bits, s 8, and |z * s| is
                                   0 or at least 2^-124, a normal number)
    x_hat = code * s + m          (code * s is exact, so a fused multiply-add gives the same bits)

For sym, z is not sent: it is the constant 2^(b-1).

Quantization, sym (Eq. 8 of the Echo paper)
-------------------------------------------
    Q = 2^(b-1) - 1,  amax = max_k |x_k|
    s = bf16(amax)                           if every x_k is equal (exact when x_0 is a bf16 value)
    s = bf16_up(max(amax * f32(1/Q), 2^-100)) otherwise   (rounded up: no value lands outside +-Q)
    r = 1/s
    code_k = clip(rne(x_k * r), -Q, Q) + 2^(b-1)          (code 0, i.e. -2^(b-1), is never used)

Quantization, asym and asym_naive (Eq. 9 and the zero-aware policy of Sec. 4.3)
-------------------------------------------------------------------------------
    lo = min_k x_k, hi = max_k x_k, amax = max(|lo|, |hi|), M = 2^b - 1
    constant group (lo == hi):  s = bf16(lo) (signed), z = -1, every code 0   -> x_hat = s exactly
    otherwise:
      s  = bf16_up(max((hi - lo) * f32(1/M), amax * 2^-10, 2^-100))
      r  = 1/s
      zn = -lo * r                             naive zero-point: the grid starts at the minimum
      z  = f16(rne(zn))   for "asym" when lo < 0 < hi (the group straddles zero)
      z  = f16(zn)        otherwise, and always for "asym_naive"
      m  = -(z * s)
      code_k = clip(rne((x_k - m) * r), 0, M)

The zero-aware policy (the Echo paper Sec. 4.3: "when a group straddles zero we round its
zero-point to the nearest integer"). Every group with lo < 0 < hi gets an integer zero-point, so
code z dequantizes to z * s - z * s = 0 exactly, however close zero is to an edge of the range.
That is the group the policy exists for: one large value sets the step, every other value is near
zero, and under the naive map those values would dequantize to about the group minimum instead of
to 0. There 0 <= zn <= M (as -lo <= hi - lo <= M * s), so z is an integer in [0, M], exact in fp16,
and encoding x = 0 gives rne(z * s * r) = z. A group on one side of zero (lo >= 0 or hi <= 0,
signed zeros compare equal to 0) keeps the naive map and spends the whole grid on its values.
No blend is needed for continuity: as lo rises to 0 the naive zn falls to 0 = rne(zn), so the two
maps meet at lo = 0; as hi falls to 0, zn = -lo * r is within the bf16 rounding of s below M
(zn >= M / (1 + 2^-7) for a scale set by the range), so the integer zero-point moves the grid by
at most M * 2^-7 steps (0.12 at 4 bits, 2 at 8). Inside the straddle, rne(zn) steps by whole
codes, as any map with an exact zero must.
The floor ``amax * 2^-10`` on the scale keeps |z| <= 1024, where fp16 holds the naive zero-point to
a quarter step; it is only active for groups whose range is tiny next to their magnitude (never in
a straddling group, whose range is at least amax). The floor 2^-100 keeps every scale and every
m = -(z * s) a normal fp32 number, so no step depends on how a backend treats subnormals.

Non-finite data and range
-------------------------
A group with any NaN or +-inf, or with max |x| >= 2^126 (about 8.5e37), is sent as s = NaN (bf16
0x7FC0), z = 0, codes 0 and dequantizes to NaN in every position: never silent finite garbage.
Below that bound every scale, zero-point and decoded value is finite, for any finite group: no
input needs rescaling to fit the format (`echo_psum`'s ``rescale`` is off by default for that
reason). A sum over the ranks that reaches 2^126 comes back NaN in its group, where fp32 psum
would be near its own overflow. Tiny magnitudes: the step is never below 2^-100, so a group with
max |x| below about 2^-97 comes back within 2^-101 of itself; a constant group comes back as its
value rounded to the nearest bf16 at any magnitude (its reciprocal is 0 below 2^-126, where
1 / s would overflow, and every code is 0 either way).

Error bounds (finite groups): |x_hat - x| <= s/2 for every policy, plus the fp32 rounding of
(x - m) * r. Inside the grid this is rounding to the nearest code. At the ends, the grid
[-z * s, (M - z) * s] misses [lo, hi] by at most |z - zn| * s <= s/2 at one end (rne for the
zero-aware map; the fp16 rounding of zn, at most a quarter step, for the naive one), and a
clipped value lands on the end code, within that distance. Under the zero-aware policy the values
of a straddling group with |x| <= s/2 dequantize to within s/2 of themselves, and 0 to exactly 0.

Why products, never divisions or unfused mul-adds: XLA rewrites ``x / s`` into ``x * (1/s)`` and
fuses ``a * b + c`` into one fused multiply-add on some backends. The formulas only use ``1/s``
computed once per group, exact products inside sums, and `_no_fma` where a rounded product meets
an addition, so every backend and every kernel produces the same bits.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from jax import lax

from echo_jax import policies as _policies
from echo_jax.policies import num_params  # noqa: F401  (re-export: the table is its home)

#: The policy names, in the order of their custom-call codes (`echo_jax.policies.NAMES`).
POLICIES = _policies.NAMES


def code_bytes(group_size: int, bits: int) -> int:
    """Bytes of codes per group."""
    return group_size * bits // 8


def wire_bytes_per_group(group_size: int, bits: int, policy: str) -> int:
    """Bytes on the wire per group: codes plus 16-bit parameters (68 for g=128, 4-bit asym)."""
    return _policies.wire_bytes_per_group(group_size, bits, policy)


def _check_policy(policy):
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")


def _check_bits(bits):
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")


def _no_fma(*products):
    """Materialise rounded products so XLA cannot fuse them into a following addition."""
    out = lax.optimization_barrier(products)
    return out if len(products) > 1 else out[0]


# fp16 rounding on integer bit patterns. XLA may drop an f32 -> f16 -> f32 round trip as "excess
# precision" (it does on GPU), so the reference never relies on float conversions to round: these
# helpers do it on the bits, and the float conversions that remain are exact.

def f16_round(v):
    """fp32 -> the fp32 value of the nearest fp16 (ties to even; inf on overflow, NaN kept)."""
    v = jnp.asarray(v, jnp.float32)
    bits = lax.bitcast_convert_type(v, jnp.uint32)
    sign = bits & np.uint32(0x80000000)
    a = bits & np.uint32(0x7FFFFFFF)
    # Normal fp16 range: keep 10 mantissa bits, round the 13 dropped ones to nearest even (a
    # carry correctly bumps the exponent).
    odd = (a >> 13) & np.uint32(1)
    normal = (a + np.uint32(0xFFF) + odd) & np.uint32(0xFFFFE000)
    normal = jnp.where(a >= np.uint32(0x477FF000), np.uint32(0x7F800000), normal)  # >= 65520
    # Subnormal fp16 range: multiples of 2^-24 (both scalings are exact powers of two).
    sub = jnp.round(jnp.abs(v) * np.float32(2.0 ** 24)) * np.float32(2.0 ** -24)
    sub_bits = lax.bitcast_convert_type(sub, jnp.uint32)
    out = jnp.where(a >= np.uint32(0x38800000), normal, sub_bits)
    out = jnp.where(a > np.uint32(0x7F800000), a, out)  # NaN
    return lax.bitcast_convert_type(out | sign, jnp.float32)


def f16_bits(h):
    """fp32 values that are fp16 numbers (from `f16_round`) -> their uint16 bit patterns."""
    bits = lax.bitcast_convert_type(jnp.asarray(h, jnp.float32), jnp.uint32)
    sign = (bits >> 16) & np.uint32(0x8000)
    a = bits & np.uint32(0x7FFFFFFF)
    normal = ((a - np.uint32(112 << 23)) >> 13) & np.uint32(0x7FFF)
    sub = (jnp.abs(h) * np.float32(2.0 ** 24)).astype(jnp.uint32)
    out = jnp.where(a >= np.uint32(0x38800000), normal, sub)
    out = jnp.where(a >= np.uint32(0x7F800000),
                    np.uint32(0x7C00) | jnp.where(a > np.uint32(0x7F800000), np.uint32(0x200),
                                                  np.uint32(0)), out)
    return (out | sign).astype(jnp.uint16)


def f16_from_bits(b):
    """uint16 fp16 bit patterns -> fp32 values (exact)."""
    return lax.bitcast_convert_type(b.astype(jnp.uint16), jnp.float16).astype(jnp.float32)


def bf16_round(v):
    """fp32 -> the fp32 value of the nearest bf16 (ties to even; overflow gives inf).

    On the bits, like `f16_round` (for finite and infinite v; a NaN may come out as a different
    NaN, and the quantizer never keeps one).
    """
    bits = lax.bitcast_convert_type(jnp.asarray(v, jnp.float32), jnp.uint32)
    odd = (bits >> 16) & np.uint32(1)
    out = (bits + np.uint32(0x7FFF) + odd) & np.uint32(0xFFFF0000)
    return lax.bitcast_convert_type(out, jnp.float32)


def bf16_round_up(v):
    """fp32 v >= 0 -> the fp32 value of the smallest bf16 >= v (overflow gives inf).

    On the bits: a positive fp32 pattern with any of its 16 low bits set moves up to the next
    multiple of 2^16 (a carry into the exponent is the next binade, or inf past the largest bf16).
    """
    bits = lax.bitcast_convert_type(jnp.asarray(v, jnp.float32), jnp.uint32)
    out = (bits + np.uint32(0xFFFF)) & np.uint32(0xFFFF0000)
    return lax.bitcast_convert_type(out, jnp.float32)


def bf16_bits(h):
    """fp32 values that are bf16 numbers -> their uint16 bit patterns (the top half)."""
    bits = lax.bitcast_convert_type(jnp.asarray(h, jnp.float32), jnp.uint32)
    return (bits >> 16).astype(jnp.uint16)


def bf16_from_bits(b):
    """uint16 bf16 bit patterns -> fp32 values (exact)."""
    return lax.bitcast_convert_type(b.astype(jnp.uint32) << 16, jnp.float32)


#: The smallest normal fp32 number: a scale below it has no finite reciprocal in general, and
#: `_reciprocal` takes 0 there.
NORMAL_MIN = float(np.finfo(np.float32).tiny)  # 2^-126
#: The smallest scale of a group that is not constant (quant.py's docstring: every scale and
#: every m = -(z * s) stays a normal fp32 number).
SCALE_FLOOR = 2.0 ** -100
#: Groups with max |x| at or above this are sent as NaN (every scale, zero-point and decoded
#: value of a group below it is finite).
RANGE_LIMIT = 2.0 ** 126


@functools.lru_cache(maxsize=None)
def _reciprocal_table() -> np.ndarray:
    """Correctly rounded fp32 1/s for every bf16 bit pattern s (0 where |s| < 2^-126)."""
    h = (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        r = np.float32(1) / h  # IEEE division on the host: correctly rounded
    r[np.abs(h) < np.float32(NORMAL_MIN)] = 0
    return r


def _reciprocal(s32):
    # A table lookup rather than `1 / s`: XLA's GPU division is not always correctly rounded,
    # and s is always a bf16 value, so 65536 entries cover every case exactly.
    return jnp.asarray(_reciprocal_table())[bf16_bits(s32).astype(jnp.int32)]


#: The wire parameters of a non-finite group: scale bf16 NaN, zero-point 0.
NAN_SCALE_BITS = 0x7FC0


def group_scales(params):
    """The fp32 scale of each group from `quantize_groups`' params [..., G, 1|2] -> [..., G, 1]."""
    return bf16_from_bits(params[..., 0:1])


def group_zero_points(params):
    """The fp32 zero-point of each asym group from params [..., G, 2] -> [..., G, 1]."""
    return f16_from_bits(params[..., 1:2])


def pack_codes(codes, bits: int):
    """uint8 codes [..., g] -> wire bytes [..., g*bits/8] (4-bit: low nibble first)."""
    _check_bits(bits)
    codes = codes.astype(jnp.uint8)
    if bits == 8:
        return codes
    lo = codes[..., 0::2]
    hi = codes[..., 1::2]
    return lo | (hi << 4)


def unpack_codes(packed, bits: int):
    """Wire bytes [..., g*bits/8] -> uint8 codes [..., g]."""
    _check_bits(bits)
    if bits == 8:
        return packed
    lo = packed & 0xF
    hi = packed >> 4
    return jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def quantize_groups(x, bits: int, policy: str):
    """Quantize groups of values.

    Args:
      x: float array [..., G, g] (any float dtype; computed in fp32).
      bits: 4 or 8.
      policy: "asym", "sym" or "asym_naive".

    Returns:
      (packed, params): packed uint8 [..., G, g*bits/8]; params uint16 [..., G, 1] for sym (the
      bf16 bits of the scale) or [..., G, 2] for asym (the scale's bf16 bits, the zero-point's
      fp16 bits): the wire's words. `group_scales` / `group_zero_points` read them as fp32.
    """
    _check_bits(bits)
    _check_policy(policy)
    x = x.astype(jnp.float32)
    finite = jnp.all(jnp.isfinite(x), axis=-1, keepdims=True)
    xs = jnp.where(finite, x, jnp.float32(0))
    lo = jnp.min(xs, axis=-1, keepdims=True)
    hi = jnp.max(xs, axis=-1, keepdims=True)
    amax = jnp.maximum(jnp.abs(lo), jnp.abs(hi))
    constant = lo == hi
    ok = finite & (amax < np.float32(RANGE_LIMIT))
    floor = np.float32(SCALE_FLOOR)
    if policy == "sym":
        qmax = 2 ** (bits - 1) - 1
        s = jnp.where(constant, bf16_round(amax),
                      bf16_round_up(jnp.maximum(amax * np.float32(1.0 / qmax), floor)))
        r = _reciprocal(s)
        q = jnp.clip(jnp.round(xs * r), -qmax, qmax) + (qmax + 1)
        params = jnp.where(ok, bf16_bits(s), np.uint16(NAN_SCALE_BITS))
    else:
        levels = 2 ** bits - 1
        s_raw = jnp.maximum(jnp.maximum((hi - lo) * np.float32(1.0 / levels),
                                        amax * np.float32(2.0 ** -10)), floor)
        s = jnp.where(constant, bf16_round(lo), bf16_round_up(s_raw))
        r = _reciprocal(s)
        zn = -lo * r
        if policy == "asym":  # zero-aware: an integer zero-point whenever lo < 0 < hi
            z = jnp.where((lo < 0) & (hi > 0), jnp.round(zn), zn)
        else:
            z = zn
        zf = jnp.where(constant, np.float32(-1), f16_round(z))
        m = -(zf * s)
        q = jnp.clip(jnp.round((xs - m) * r), 0, levels)
        params = jnp.concatenate([jnp.where(ok, bf16_bits(s), np.uint16(NAN_SCALE_BITS)),
                                  jnp.where(ok, f16_bits(zf), np.uint16(0))], axis=-1)
    codes = jnp.where(ok, q, 0).astype(jnp.uint8)
    return pack_codes(codes, bits), params


def dequantize_groups(packed, params, bits: int, policy: str):
    """Inverse of `quantize_groups`: fp32 [..., G, g] with x_hat = code * s - z * s."""
    _check_bits(bits)
    _check_policy(policy)
    codes = unpack_codes(packed, bits).astype(jnp.float32)
    s = group_scales(params)  # widening: exact
    if policy == "sym":
        z = jnp.float32(2 ** (bits - 1))
    else:
        z = group_zero_points(params)
    m = -(z * s)
    return codes * s + m


def quantize_dequantize(x, bits: int, group_size: int, policy: str):
    """Round trip of a flat or shaped array through the wire format (padding internal).

    Returns fp32 of x's shape.
    """
    flat = jnp.ravel(x).astype(jnp.float32)
    n = flat.shape[0]
    pad = (-n) % group_size
    groups = jnp.pad(flat, (0, pad)).reshape(-1, group_size)
    packed, params = quantize_groups(groups, bits, policy)
    return dequantize_groups(packed, params, bits, policy).reshape(-1)[:n].reshape(jnp.shape(x))


__all__ = [
    "POLICIES", "num_params", "code_bytes", "wire_bytes_per_group", "f16_round", "bf16_round",
    "bf16_round_up", "group_scales", "group_zero_points", "NAN_SCALE_BITS", "SCALE_FLOOR",
    "RANGE_LIMIT", "pack_codes", "unpack_codes", "quantize_groups", "dequantize_groups",
    "quantize_dequantize",
]
