"""Independent NumPy float64 references for the quantizer's claims (never the code under test).

The tests bound what `echo_jax.quant` and the transports return by quantities computed here from
the data alone: the largest scale the Echo paper's Eq. 8 / Eq. 9 allow once rounded up to bf16,
and the per-element error of one quantization under the zero-aware policy (Sec. 4.3).
"""

import numpy as np

#: Slack for the fp32 rounding of (hi - lo) * f32(1/M) before the bf16 round-up: it can push the
#: scale at most one bf16 step (relative 2^-7) above the float64 value rounded up.
BF16_STEP = 2.0 ** -7

#: The smallest scale of a group that is not constant (the wire format's floor, quant.py).
SCALE_FLOOR = 2.0 ** -100


def bf16_round_up64(v):
    """float64 v >= 0 -> the smallest bf16 value >= v (as float64): 8 significant bits."""
    v = np.asarray(v, np.float64)
    m, e = np.frexp(v)                       # v = m * 2^e, m in [0.5, 1)
    return np.ldexp(np.ceil(m * 256.0) / 256.0, e)


def max_scale(groups, bits, policy):
    """Upper bound on the bf16 scale of each group [..., g] -> [...] (float64).

    Eq. 9 (asym, asym_naive): s = (hi - lo) / (2^b - 1), floored at amax * 2^-10 (quant.py's
    docstring); Eq. 8 (sym): s = amax / (2^(b-1) - 1); both floored at 2^-100 and rounded up to
    bf16. A constant group uses s = |x| (its value, rounded to the nearest bf16). The slack of one
    bf16 step covers fp32 rounding before the round-up.
    """
    x = np.asarray(groups, np.float64)
    lo, hi = x.min(-1), x.max(-1)
    amax = np.maximum(np.abs(lo), np.abs(hi))
    if policy == "sym":
        s = amax / (2 ** (bits - 1) - 1)
    else:
        s = np.maximum((hi - lo) / (2 ** bits - 1), amax * 2.0 ** -10)
    s = np.maximum(s, SCALE_FLOOR)
    s = np.where(lo == hi, amax, s)
    return bf16_round_up64(s) * (1 + BF16_STEP)


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


def coefficients(config):
    """The fp32 constants of Algorithm 1 from an EchoConfig's fields (float64, rounded once), as
    the Echo paper's Eqs. 10 / 11 name them: (eta a, eta (1 - a), beta1, 1 - beta1, beta2,
    1 - beta2). Written from the config, never from `echo_jax.compensator.Coefficients`."""
    e, a, b1, b2 = (float(v) for v in (config.eta, config.blend, config.beta1, config.beta2))
    f = np.float32
    return f(e * a), f(e * (1.0 - a)), f(b1), f(1.0 - b1), f(b2), f(1.0 - b2)


def allreduce_error_bound(x, bits, group_size, policy):
    """Per-element bound on |echo_psum(x) - sum_i x_i| (Eq. 1) from the data alone, float64.

    x: [P, ...] per-rank contributions. The wire layout (collective.py's docstring): flattened,
    padded with zeros to P segments of the same number of whole groups, segment j owned by rank
    j. The owner adds the P - 1 copies it received (each off by at most half a step of its
    group, `max_scale`) to its own full-precision segment, then the sum is quantized once more;
    that sum's range is at most the exact range widened by the push errors. Each step is at most
    what Eq. 8 / Eq. 9 allow for its group, never the code's own scales.
    """
    nr = x.shape[0]
    flat = np.asarray(x, np.float32).reshape(nr, -1)
    n = flat.shape[1]
    groups = -(-max(n, 1) // group_size)
    gs = -(-groups // nr)                                           # groups per segment
    padded = nr * gs * group_size
    segs = np.pad(flat, ((0, 0), (0, padded - n))).reshape(nr, nr, gs, group_size)
    s_in = max_scale(segs, bits, policy)                            # [rank, owner, group]
    exact = segs.astype(np.float64).sum(0)                          # [owner, group, g]
    # Push errors of the P - 1 copies that crossed a link (the owner's own copy is exact).
    own = np.arange(nr)[:, None, None] == np.arange(nr)[None, :, None]
    push = 0.5 * np.where(own, 0.0, s_in).sum(0)                    # [owner, group]
    amax = np.abs(exact).max(-1) + push
    rng = exact.max(-1) - exact.min(-1) + 2 * push
    s_sum = rng / (2 ** bits - 1) if policy != "sym" else amax / (2 ** (bits - 1) - 1)
    s_sum = np.maximum(np.maximum(s_sum, amax * 2.0 ** -10), SCALE_FLOOR) * (1 + 2 ** -6)
    bound = push + 0.5 * s_sum + 1e-6 * (1 + amax)
    return np.broadcast_to(bound[..., None], exact.shape).reshape(-1)[:n].reshape(x.shape[1:])


def state_quantize(v, levels=127):
    """NumPy float64 reference of the quantized compensator state (int8: levels 127, int4: 7):
    (codes int8 in [-levels, levels], scales fp32) of a flat fp32 array, per group of 128: s the
    smallest power of two with levels * s >= max|v| (0 below 2^-100; max|v| itself and codes 0
    when not finite), q = rne(v / s)."""
    F32 = np.float32
    v = np.asarray(v, F32).reshape(-1)
    n = v.size
    groups = -(-n // 128)
    g = np.zeros(groups * 128, F32)
    g[:n] = v
    g = g.reshape(groups, 128).astype(np.float64)
    scale = np.zeros(groups, F32)
    q = np.zeros((groups, 128), np.int8)
    k = int(np.floor(np.log2(levels)))
    for i, row in enumerate(g):
        amax = np.abs(row).max()
        if not np.isfinite(amax):
            scale[i] = amax           # a non-finite group: its scale is max|v|, its codes 0
            continue
        if amax < 2.0 ** -100:
            continue                  # stored as zeros
        e = int(np.floor(np.log2(amax))) - k
        while levels * 2.0 ** e < amax:   # the smallest power of two s with levels s >= max|v|
            e += 1
        while levels * 2.0 ** (e - 1) >= amax:
            e -= 1
        scale[i] = 2.0 ** e
        q[i] = np.clip(np.round(row / 2.0 ** e), -levels, levels)  # np.round: half to even
    return q.reshape(-1)[:n], scale


def state_read(q, scale):
    """The quantized state's values q * s (fp32; codes any shape, flat groups of 128)."""
    q = np.asarray(q).astype(np.int8).reshape(-1)
    groups = np.repeat(np.asarray(scale, np.float32), 128)[: q.size]
    with np.errstate(over="ignore"):
        return (q.astype(np.float64) * groups.astype(np.float64)).astype(np.float32)
