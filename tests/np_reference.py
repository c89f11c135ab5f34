"""Independent NumPy float64 references for the quantizer's claims (never the code under test).

The tests bound what `echo_jax.quant` and the transports return by quantities computed here from
the data alone: the largest scale the Echo paper's Eq. 8 / Eq. 9 allow once rounded up to fp16,
and the per-element error of one quantization under the zero-aware policy (Sec. 4.3).
"""

import numpy as np

#: Slack for the fp32 rounding of (hi - lo) * f32(1/M) before the fp16 round-up: it can push the
#: scale at most one fp16 step (relative 2^-10) above the float64 value rounded up.
FP16_STEP = 2.0 ** -10


def f16_round_up64(v):
    """float64 v >= 0 -> the smallest fp16 value >= v (as float64)."""
    v = np.asarray(v, np.float64)
    h = v.astype(np.float16).astype(np.float64)
    up = np.nextafter(h.astype(np.float16), np.float16(np.inf)).astype(np.float64)
    return np.where(h < v, up, h)


def max_scale(groups, bits, policy):
    """Upper bound on the fp16 scale of each group [..., g] -> [...] (float64).

    Eq. 9 (asym, asym_naive): s = (hi - lo) / (2^b - 1), floored at amax * 2^-10 (quant.py's
    docstring); Eq. 8 (sym): s = amax / (2^(b-1) - 1); both rounded up to fp16. A constant group
    uses s = |x| (its value). The slack of one fp16 step covers fp32 rounding before the round-up.
    """
    x = np.asarray(groups, np.float64)
    lo, hi = x.min(-1), x.max(-1)
    amax = np.maximum(np.abs(lo), np.abs(hi))
    if policy == "sym":
        s = amax / (2 ** (bits - 1) - 1)
    else:
        s = np.maximum((hi - lo) / (2 ** bits - 1), amax * 2.0 ** -10)
    s = np.where(lo == hi, amax, s)
    return f16_round_up64(s) * (1 + FP16_STEP)


def straddles(groups):
    """Groups [..., g] whose range contains zero strictly inside: lo < 0 < hi."""
    x = np.asarray(groups, np.float64)
    return (x.min(-1) < 0) & (x.max(-1) > 0)


def element_error_bound(groups, bits, policy, scale=None):
    """Bound on |x_hat - x| per element of one quantization of groups [..., g] (float64).

    Every policy: half a step, s / 2 (quant.py's docstring: rounding inside the grid; the grid
    misses the range by at most half a step at one end). The zero-aware policy in a straddling
    group: also |x|, because 0 is a grid point (the nearest code is at most as far as 0 is, and a
    clipped value lands on an end code between 0 and itself). fp32 arithmetic adds a few ulps.
    """
    x = np.asarray(groups, np.float64)
    s = max_scale(x, bits, policy) if scale is None else np.asarray(scale, np.float64)
    half = 0.5 * s[..., None] * np.ones_like(x)
    if policy == "asym":
        half = np.where(straddles(x)[..., None], np.minimum(half, np.abs(x)), half)
    return half + 2.0 ** -21 * np.abs(x).max(-1, keepdims=True) + 1e-30
