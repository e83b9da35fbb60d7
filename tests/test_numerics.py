"""FP8 numerics against ml_dtypes, bit for bit (spec section "Numerics")."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from hpu_fp8_loader.errors import NonFiniteError
from hpu_fp8_loader.numerics import e4m3, scales

F8 = ml_dtypes.float8_e4m3fn
RANGES = (240.0, 448.0)


def oracle(values: np.ndarray, fp8_max: float) -> np.ndarray:
    """ml_dtypes' cast of the clamped float32 value: the reference the spec names."""
    return np.clip(values.astype(np.float32), -fp8_max, fp8_max).astype(F8).view(np.uint8)


def all_bf16() -> np.ndarray:
    """All 65,536 bf16 bit patterns."""
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(ml_dtypes.bfloat16)


@pytest.mark.parametrize("fp8_max", RANGES)
def test_every_finite_bf16_pattern_matches_ml_dtypes(fp8_max):
    values = all_bf16()
    finite = values[np.isfinite(values.astype(np.float32))]
    got = e4m3.cast_to_fp8(finite, fp8_max).view(np.uint8)
    np.testing.assert_array_equal(got, oracle(finite, fp8_max))
    assert finite.size == 65536 - 256  # the 254 NaN and 2 inf patterns are tested below


@pytest.mark.parametrize("fp8_max", RANGES)
def test_every_non_finite_bf16_pattern_raises(fp8_max):
    values = all_bf16()
    bad = values[~np.isfinite(values.astype(np.float32))]
    assert bad.size == 256
    for i in range(bad.size):
        with pytest.raises(NonFiniteError, match=r"'w' holds (nan|inf|-inf) at index \[1\]"):
            e4m3.cast_to_fp8(np.concatenate([np.zeros(1, ml_dtypes.bfloat16), bad[i : i + 1]]), fp8_max, "w")


@pytest.mark.parametrize("fp8_max", RANGES)
def test_a_million_random_float32_values_with_scale_match_ml_dtypes(fp8_max):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(1_000_000) * np.exp(rng.uniform(-12, 8, 1_000_000))).astype(np.float32)
    scale = np.float32(0.0173)
    got = e4m3.quantize(x, scale, fp8_max).view(np.uint8)
    np.testing.assert_array_equal(got, oracle(x / scale, fp8_max))


def test_clamp_happens_before_rounding():
    # 248 lies exactly between 240 and 256: rounding first would give 256, Gaudi2 saturates to 240.
    got = e4m3.cast_to_fp8(np.array([248.0, 250.0, -1e9, 1e9], np.float32), 240.0).astype(np.float32)
    np.testing.assert_array_equal(got, [240.0, 240.0, -240.0, 240.0])


def test_no_code_above_range_is_ever_produced():
    values = all_bf16()
    codes = e4m3.cast_to_fp8(values[np.isfinite(values.astype(np.float32))], 240.0).view(np.uint8)
    assert (codes & 0x7F).max() == scales.max_code(240.0) == 0x77


def test_finite_value_that_overflows_when_scaled_saturates():
    got = e4m3.quantize(np.array([3e38, -3e38, 1.0], np.float32), np.float32(1e-3), 240.0)
    np.testing.assert_array_equal(got.astype(np.float32), [240.0, -240.0, 240.0])


def test_nan_is_refused_with_name_and_first_index():
    x = np.zeros((3, 5), np.float32)
    x[1, 2] = np.nan
    x[2, 0] = np.inf
    with pytest.raises(NonFiniteError, match=r"'layer.w' holds nan at index \[1, 2\]"):
        e4m3.quantize(x, 1.0, 240.0, "layer.w")
    with pytest.raises(NonFiniteError, match=r"index \[1, 2\]"):
        e4m3.abs_max(x, "layer.w")
    with pytest.raises(NonFiniteError, match=r"index \[1, 2\]"):
        e4m3.channel_abs_max(x, "layer.w")


def test_channel_wise_quantize_uses_one_scale_per_output_column():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((70, 33)).astype(np.float32) * np.linspace(0.1, 10, 33, dtype=np.float32)
    scale = scales.weight_scale_from_amax(e4m3.channel_abs_max(w), 240.0)
    got = e4m3.quantize(w, scale, 240.0).view(np.uint8)
    np.testing.assert_array_equal(got, oracle(w / scale[None, :], 240.0))
    np.testing.assert_array_equal(e4m3.channel_abs_max(w), np.abs(w).max(axis=0))


def test_threads_give_identical_bits():
    x = np.random.default_rng(3).standard_normal((1000, 300)).astype(ml_dtypes.bfloat16)
    one = e4m3.quantize(x, 0.01, 240.0).view(np.uint8)
    two = e4m3.quantize(x, 0.01, 240.0, threads=2).view(np.uint8)
    np.testing.assert_array_equal(one, two)


def test_abs_max_over_chunks_matches_numpy():
    x = np.random.default_rng(4).standard_normal(300_001).astype(ml_dtypes.bfloat16)
    assert e4m3.abs_max(x) == float(np.abs(x.astype(np.float32)).max())


def test_zero_amax_weight_gets_scale_one():
    np.testing.assert_array_equal(scales.weight_scale_from_amax(np.array([0.0, 2.4], np.float32), 240.0)[0], 1.0)


positive_floats = st.floats(min_value=2.0**-100, max_value=2.0**100, width=32)


@given(positive_floats)
def test_bf16_round_up_is_the_smallest_bf16_not_below(scale):
    s = np.float32(scale)
    up = scales.round_up_to_bf16(np.array([s]))[0]
    assert up >= s
    assert scales.is_bf16_exact(np.array([up]))[0]
    below = (np.array([up]).view(np.uint32) - 0x10000).view(np.float32)[0]
    assert below < s or up == s


@given(positive_floats)
def test_pow2_round_up_is_the_smallest_power_of_two_not_below(scale):
    s = np.float32(scale)
    up = float(scales.round_up_to_pow2(np.array([s]))[0])
    mantissa, _ = np.frexp(up)
    assert mantissa == 0.5 and up >= s and up / 2 < s


@settings(max_examples=200)
@given(hnp.arrays(np.float32, st.integers(1, 300), elements=st.floats(-1e4, 1e4, width=32)), st.sampled_from(RANGES))
def test_quantize_then_dequantize_is_within_half_an_fp8_step(x, fp8_max):
    amax = e4m3.abs_max(x)
    scale = scales.weight_scale_from_amax(amax, fp8_max).reshape(())
    back = e4m3.dequantize(e4m3.quantize(x, scale, fp8_max), scale)
    # e4m3 has 3 mantissa bits: relative step 2^-3 for normals, absolute 2^-9 * scale for subnormals.
    tolerance = np.maximum(np.abs(x) * 2.0**-4, 2.0**-10 * scale) * 1.0001
    assert np.all(np.abs(back - x) <= tolerance)
    assert np.abs(x).max(initial=0) <= scale * fp8_max * (1 + 1e-6)


@given(hnp.arrays(np.float32, st.integers(1, 100), elements=st.floats(-1e6, 1e6, width=32)))
def test_cast_is_odd_and_monotonic(x):
    codes = e4m3.cast_to_fp8(x, 240.0)
    np.testing.assert_array_equal(e4m3.cast_to_fp8(-x, 240.0).astype(np.float32), -codes.astype(np.float32))
    order = np.argsort(x, kind="stable")
    assert np.all(np.diff(codes.astype(np.float32)[order]) >= 0)


def test_max_code_agrees_with_ml_dtypes_for_every_normal_value():
    codes = np.arange(0x08, 0x7F, dtype=np.uint8)  # every positive normal e4m3fn code
    for code, value in zip(codes, codes.view(F8).astype(np.float32), strict=True):
        assert scales.max_code(float(value)) == code
    with pytest.raises(ValueError, match="not an e4m3fn value"):
        scales.max_code(241.0)


def test_a_denormal_amax_never_gives_a_zero_scale():
    for amax in (1e-45, 1e-40, 0.0):
        weight_scale = scales.weight_scale_from_amax(np.float32(amax), 240.0)
        act_scale = scales.act_scale_from_amax(np.float32(amax), 240.0)
        assert weight_scale > 0 and act_scale >= np.finfo(np.float32).tiny
    x = np.array([1e-45, -1e-45], np.float32)
    scale = scales.weight_scale_from_amax(e4m3.abs_max(x), 240.0)
    assert np.all(np.abs(e4m3.dequantize(e4m3.quantize(x, scale, 240.0), scale) - x) <= 1e-45)
