"""The group scale's lower bound (echo_jax/quant.py): rounded up to bf16, never below the Echo
paper's Eq. 8 / Eq. 9 value, so that no value of a group lands outside its grid. Checked against
float64 from the data alone; the error-bound tests of test_quant.py bound the scale from above.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from echo_jax import quant


@pytest.mark.parametrize("policy", ["asym", "sym"])
def test_scale_is_never_below_the_equation(policy):
    """quant.py: s = bf16_up(max(amax / Q, 2^-100)) (sym, Eq. 8) or bf16_up(max((hi - lo) / M,
    amax * 2^-10, 2^-100)) (asym, Eq. 9): rounded up, so that every value lies within the grid
    (sym: |x| <= Q s). Checked against those maxima in float64, less the fp32 roundings of
    hi - lo, 1 / M and their product (2^-22 relative in all), over groups of magnitudes from
    2^-110 (scales at the floor) to 2^120."""
    rng = np.random.default_rng(23)
    mags = 2.0 ** rng.integers(-110, 121, (512, 1))
    x = (rng.standard_normal((512, 64)) * mags).astype(np.float32)
    for bits in (4, 8):
        _, params = quant.quantize_groups(jnp.asarray(x), bits, policy)
        s = np.asarray(quant.group_scales(params), np.float64)[:, 0]
        v = x.astype(np.float64)
        lo, hi = v.min(-1), v.max(-1)
        amax = np.maximum(-lo, hi)
        if policy == "sym":
            want = amax / (2 ** (bits - 1) - 1)
        else:
            want = np.maximum((hi - lo) / (2 ** bits - 1), amax * 2.0 ** -10)
        want = np.maximum(want, 2.0 ** -100)
        assert np.all(s >= want * (1 - 2.0 ** -22)), float(np.min(s / want))
        if policy == "sym":
            assert np.all(np.abs(v) <= (2 ** (bits - 1) - 1) * s[:, None] * (1 + 2.0 ** -22))
