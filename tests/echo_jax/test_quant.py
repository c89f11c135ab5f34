"""Properties of the group quantizer (echo_jax/quant.py, the wire format's one definition)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from echo_jax import quant
from np_reference import element_error_bound, max_scale, straddles

POLICIES = ("asym", "sym", "asym_naive")


def roundtrip(x, bits, policy):
    packed, params = quant.quantize_groups(jnp.asarray(x), bits, policy)
    return np.asarray(quant.dequantize_groups(packed, params, bits, policy)), packed, params


def step_of(params):
    return np.abs(np.asarray(quant.group_scales(jnp.asarray(params)), np.float32))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("dist", ["normal", "shifted", "positive", "negative", "heavy"])
def test_roundtrip_error_within_step(bits, policy, dist):
    rng = np.random.default_rng(bits * 7 + len(policy) + len(dist))
    x = rng.standard_normal((257, 128)).astype(np.float32)
    if dist == "shifted":
        x += rng.uniform(-3, 3, (257, 1)).astype(np.float32)
    elif dist == "positive":
        x = np.abs(x) + 0.5
    elif dist == "negative":
        x = -np.abs(x) * 100 - 3
    elif dist == "heavy":
        x = (rng.standard_t(2, x.shape) * 10).astype(np.float32)
    xh, _, params = roundtrip(x, bits, policy)
    s = step_of(params)
    # The scale is no larger than Eq. 8 / Eq. 9 allow (float64, rounded up to bf16): a coarser
    # grid would pass a bound written in the code's own scale.
    assert np.all(s[..., 0] <= max_scale(x, bits, policy)), float(np.max(s[..., 0] / max_scale(x, bits, policy)))
    err = np.abs(xh - x)
    # Half a step for every policy (quant.py's error bound), from the independent scale bound;
    # the zero-aware map also keeps every value of a straddling group within |x| of itself.
    bound = element_error_bound(x, bits, policy)
    assert np.all(err <= bound), float(np.max(err / s))
    assert np.all(np.isfinite(xh))


@given(st.lists(st.floats(-1e4, 1e4, allow_nan=False, width=32), min_size=2, max_size=64)
       .filter(lambda v: len(v) % 2 == 0),
       st.sampled_from(POLICIES), st.sampled_from([4, 8]))
@settings(max_examples=150, deadline=None)
# A group that straddles zero only through an fp32 subnormal (found by this test in CI).
@example(values=[5.605193857299268e-45, -1.0], policy="asym", bits=4)
# A constant group of fp32 subnormals (found by this test in CI): 0 on CPU (below).
@example(values=[9.745344183131584e-40, 9.745344183131584e-40], policy="asym", bits=4)
def test_roundtrip_property(values, policy, bits):
    x = np.asarray(values, np.float32)[None]
    xh, packed, params = roundtrip(x, bits, policy)
    s = float(step_of(params)[0, 0])
    assert s <= float(max_scale(x, bits, policy)[0])
    tol = element_error_bound(x, bits, policy)
    seen = x  # the values as the quantizer sees them
    if jax.default_backend() == "cpu":
        # XLA's CPU runtime flushes fp32 subnormals to zero, inputs included: the quantizer
        # sees the group with its subnormals as 0 (a group that straddled zero only through a
        # subnormal is one-sided there), and a subnormal's error is its flush, |x|, on top.
        # The CUDA kernels do not flush; such groups are not yet quantized alike on both.
        sub = np.abs(x) < np.finfo(np.float32).tiny
        seen = np.where(sub, np.float32(0), x)
        tol = element_error_bound(seen, bits, policy) + np.where(sub, np.abs(x), 0.0)
    if seen.min() == seen.max():  # constant group: its value rounded to the nearest bf16
        assert np.all(xh == np.float32(jnp.bfloat16(seen[0, 0])))
    else:
        assert np.all(np.abs(xh - x) <= tol + 1e-30)
    assert packed.shape == (1, x.shape[1] * bits // 8)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("policy", POLICIES)
def test_zero_and_constant_groups_exact(bits, policy):
    x = np.zeros((5, 32), np.float32)
    x[1] = 1.5
    x[2] = -3.25
    x[3] = 2.0 ** -120         # below the scale floor: a constant group is its bf16 value
    x[4] = 61440.0 * 2.0 ** 90  # bf16 values (8 significant bits) of any magnitude
    xh, _, _ = roundtrip(x, bits, policy)
    np.testing.assert_array_equal(xh, x)


def test_zero_aware_asym_keeps_zero_exact():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((500, 128)).astype(np.float32) + 0.3
    x[:, ::3] = 0.0  # activations are peaked at zero
    xh, _, _ = roundtrip(x, 4, "asym")
    assert np.all(xh[:, ::3] == 0.0)
    xn, _, _ = roundtrip(x, 4, "asym_naive")
    assert np.any(xn[:, ::3] != 0.0)  # the naive map puts zero between two codes


def outlier_groups(bits, outlier, near_zero, count=64, g=128, seed=0):
    """Groups of one outlier and near-zero values, zero a fraction of a step inside the range."""
    rng = np.random.default_rng(seed)
    x = (rng.uniform(-1, 1, (count, g)) * near_zero).astype(np.float32)
    x[:, 0] = 0.0
    x[np.arange(count), 1 + np.arange(count) % (g - 1)] = outlier
    return x


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_zero_aware_outlier_group_keeps_zero_and_near_zero_values(bits, sign):
    # One value of 300 (or -300) and the rest within +-near_zero: the step is about 300 / M, so zero
    # lies less than half a step inside the range (the group the policy exists for, Sec. 4.3).
    levels = 2 ** bits - 1
    near_zero = 0.4 * (300.0 / levels) / 2  # 0.4 of half a step
    x = outlier_groups(bits, sign * 300.0, near_zero) * np.float32(1)
    assert np.all(straddles(x))
    s = max_scale(x, bits, "asym")
    assert np.all(near_zero < 0.5 * s)          # zero within half a step of an edge
    xh, _, params = roundtrip(x, bits, "asym")
    assert np.all(xh[:, 0] == 0.0)              # 0 dequantizes to exactly 0
    z = np.asarray(quant.group_zero_points(params)[..., 0])
    assert np.all(z == np.round(z))             # an integer zero-point
    small = np.abs(x) <= near_zero
    err = np.abs(xh - x)
    # Near-zero values go to 0: the error of each is |x| <= s/2, independent of the outlier.
    assert np.all(err[small] <= np.abs(x[small]) + 1e-6)
    assert np.all(err <= element_error_bound(x, bits, "asym"))
    # The naive map puts them near the group's minimum (maximum) instead: the policy matters.
    xn, _, _ = roundtrip(x, bits, "asym_naive")
    assert np.any(xn[:, 0] != 0.0)
    assert np.abs(xn - x)[small].mean() > 1.5 * err[small].mean()


@pytest.mark.parametrize("bits", [4, 8])
def test_zero_aware_zero_point_is_integer_exactly_when_straddling(bits):
    rng = np.random.default_rng(11)
    x = rng.standard_normal((400, 64)).astype(np.float32)
    x += rng.uniform(-4, 4, (400, 1)).astype(np.float32)  # some groups on one side of zero
    x[::7] = np.abs(x[::7])                                 # lo >= 0
    x[1::7, 3] = -1e-3                                      # zero just inside the lower edge
    x[2::7] = -np.abs(x[2::7])                              # hi <= 0
    x[3::7, 5] = 1e-3                                       # zero just inside the upper edge
    _, params = quant.quantize_groups(jnp.asarray(x), bits, "asym")
    z = np.asarray(quant.group_zero_points(params)[..., 0], np.float64)
    across = straddles(x)
    assert across.any() and (~across).any()
    assert np.all(z[across] == np.round(z[across]))
    # One-sided groups keep the naive map: the zero-point where the grid starts at the minimum.
    _, pn = quant.quantize_groups(jnp.asarray(x[~across]), bits, "asym_naive")
    np.testing.assert_array_equal(np.asarray(params)[~across], np.asarray(pn))


@pytest.mark.parametrize("edge", ["lo", "hi"])
def test_zero_aware_map_meets_the_naive_map_at_the_edges(edge):
    # Zero leaving the range through its lower edge (lo rises through 0) or its upper edge (hi
    # falls through 0): the integer zero-point of the straddling side and the naive one of the
    # one-sided side meet there (quant.py's docstring: no blend needed), so z moves by a small
    # fraction of a step per small move of the data, never by a jump: at most the bf16 rounding
    # of the scale, M * 2^-7 = 0.12 steps at 4 bits, where hi falls through 0.
    zs = []
    for t in np.linspace(-0.2, 0.2, 81, dtype=np.float32):
        x = np.linspace(t, 30.0, 128, dtype=np.float32) if edge == "lo" else \
            np.linspace(-30.0, -t, 128, dtype=np.float32)
        _, params = quant.quantize_groups(jnp.asarray(x[None]), 4, "asym")
        zs.append(float(quant.group_zero_points(params)[0, 0]))
    assert max(abs(a - b) for a, b in zip(zs, zs[1:])) <= 15 * 2.0 ** -7
    assert zs[0] == round(zs[0]) and zs[-1] != round(zs[-1])  # straddling, then one-sided


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_group_stays_non_finite(bits, policy, bad):
    x = np.ones((3, 16), np.float32)
    x[1, 5] = bad
    xh, _, params = roundtrip(x, bits, policy)
    assert np.all(np.isnan(xh[1]))           # the whole group, never finite garbage
    assert np.all(np.isfinite(xh[[0, 2]]))   # neighbours untouched
    assert int(params[1, 0]) == quant.NAN_SCALE_BITS
    assert np.isnan(float(quant.group_scales(params)[1, 0]))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("policy", POLICIES)
def test_any_finite_magnitude_below_the_range_limit_stays_finite(bits, policy):
    # The bf16 scale spans fp32's exponent range: groups from 1e-25 to just below 2^126 (and
    # their ranges up to 2^127) quantize to finite values within half a step, with no rescaling;
    # from 2^126 on a group is sent as NaN, never as finite garbage or inf.
    rng = np.random.default_rng(3)
    mags = np.float32([1e-25, 1e-12, 1e-6, 1.0, 6e4, 1e9, 1e20, 1e37])
    x = (rng.uniform(-1, 1, (len(mags), 128)) * mags[:, None]).astype(np.float32)
    x[-1, :2] = [np.nextafter(np.float32(2.0 ** 126), np.float32(0)),
                 -np.nextafter(np.float32(2.0 ** 126), np.float32(0))]
    xh, _, params = roundtrip(x, bits, policy)
    s = step_of(params)[..., 0]
    assert np.all(np.isfinite(xh)) and np.all(s > 0)
    assert np.all(s <= max_scale(x, bits, policy))
    assert np.all(np.abs(xh - x) <= element_error_bound(x, bits, policy))
    big = np.ones((2, 16), np.float32)
    big[1, 3] = np.float32(2.0 ** 126)
    xh, _, params = roundtrip(big, bits, policy)
    assert np.all(np.isnan(xh[1])) and np.all(xh[0] == 1)
    assert int(params[1, 0]) == quant.NAN_SCALE_BITS


@pytest.mark.parametrize("policy", POLICIES)
def test_tiny_magnitudes_use_the_scale_floor(policy):
    # Below about 2^-97 the step stops at 2^-100 (quant.SCALE_FLOOR): values come back within
    # half of it, never NaN; every scale stays a normal fp32 number.
    x = np.float32([[3e-30, -1e-30, 0.0, 2e-31], [1e-35, 2e-35, 3e-35, 4e-35]])
    xh, _, params = roundtrip(x, 4, policy)
    s = step_of(params)
    assert np.all(s == np.float32(quant.SCALE_FLOOR))
    assert np.all(np.abs(xh - x) <= 0.5 * s)


def test_sym_never_uses_most_negative_code():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((200, 64)).astype(np.float32)
    packed, _ = quant.quantize_groups(jnp.asarray(x), 4, "sym")
    codes = np.asarray(quant.unpack_codes(packed, 4))
    assert codes.min() >= 1 and codes.max() <= 15


def test_pack_layout_low_nibble_first():
    codes = jnp.asarray(np.array([[1, 2, 15, 0, 7, 9]], np.uint8))
    packed = np.asarray(quant.pack_codes(codes, 4))
    np.testing.assert_array_equal(packed, [[0x21, 0x0F, 0x97]])
    np.testing.assert_array_equal(np.asarray(quant.unpack_codes(jnp.asarray(packed), 4)), codes)
    np.testing.assert_array_equal(np.asarray(quant.pack_codes(codes, 8)), codes)


def test_wire_bytes():
    assert quant.wire_bytes_per_group(128, 4, "asym") == 68
    assert quant.wire_bytes_per_group(128, 4, "sym") == 66
    assert quant.wire_bytes_per_group(128, 8, "asym") == 132


def test_bf16_round_up_is_the_next_bf16_at_or_above():
    import ml_dtypes
    rng = np.random.default_rng(5)
    big = np.float32(np.finfo(ml_dtypes.bfloat16).max)
    v = np.concatenate([rng.uniform(0, 70000, 5000), 10.0 ** rng.uniform(-38, 38, 5000),
                        [0.0, 1.0, 1.00390625, 1.0039063, 1e-40, big, np.nextafter(big, 0)],
                        ]).astype(np.float32)
    up = np.asarray(quant.bf16_round_up(jnp.asarray(v))).astype(np.float32)
    assert np.all(up >= v)
    assert np.all(up.astype(ml_dtypes.bfloat16).astype(np.float32) == up)  # a bf16 value
    below = np.nextafter(up.astype(ml_dtypes.bfloat16),
                         ml_dtypes.bfloat16(-np.inf)).astype(np.float32)
    assert np.all((below < v) | (up == 0))
    over = np.asarray(quant.bf16_round_up(jnp.float32(np.nextafter(big, np.float32(np.inf)))))
    assert np.isinf(over)


def test_bf16_round_is_xla_convert():
    rng = np.random.default_rng(6)
    v = (rng.standard_normal(20000) * 10.0 ** rng.uniform(-30, 30, 20000)).astype(np.float32)
    v = np.concatenate([v, np.float32([1.00390625, 1.01171875, -1.00390625, 0.0, -0.0])])
    got = np.asarray(quant.bf16_round(jnp.asarray(v)))
    want = np.asarray(jnp.asarray(v).astype(jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("policy", POLICIES)
def test_input_dtypes(policy):
    x = jax.random.normal(jax.random.key(0), (10, 128))
    for dt in (jnp.float32, jnp.bfloat16, jnp.float16):
        xh = quant.quantize_dequantize(x.astype(dt), 4, 128, policy)
        assert xh.dtype == jnp.float32 and xh.shape == x.shape


def test_bad_arguments():
    with pytest.raises(ValueError, match="bits"):
        quant.quantize_groups(jnp.ones((1, 8)), 3, "sym")
    with pytest.raises(ValueError, match="policy"):
        quant.quantize_groups(jnp.ones((1, 8)), 4, "fp4")
