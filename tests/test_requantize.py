"""FP8 -> FP8 requantization by code tables (requantize.py) against the element-wise route it replaces:
dequantize to float32 (e4m3.fp8_to_float32 x scale), then e4m3.quantize. Codes must be
bit-identical; amax exact; the error sums equal to float64 sums over every element."""

from __future__ import annotations

import numpy as np
import pytest

from hpu_fp8_loader.errors import NonFiniteError
from hpu_fp8_loader.numerics import e4m3
from hpu_fp8_loader.numerics.requantize import requantize_rows, row_amax


def _codes(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    codes = rng.integers(0, 256, shape, dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] ^= 1  # no NaN codes: the caller's row_amax pass refuses them
    return codes


def _scales(rng: np.random.Generator, rows: int, per_row: bool) -> np.ndarray:
    return rng.uniform(1e-4, 2e-2, rows if per_row else 1).astype(np.float32)


@pytest.mark.parametrize("fp8_max", [240.0, 448.0])
@pytest.mark.parametrize("source_per_row", [False, True])
@pytest.mark.parametrize("target", ["tensor", "row", "saturating", "subnormal"])
def test_codes_are_those_of_dequantize_then_quantize(fp8_max, source_per_row, target):
    rng = np.random.default_rng(7)
    codes = _codes(rng, (600, 300))  # more rows than one 256-row table group
    source = _scales(rng, 600, source_per_row)
    values = e4m3.fp8_to_float32(codes) * source.reshape(-1, 1)
    amax = row_amax(codes, source, "w", 0, codes.shape)
    np.testing.assert_array_equal(amax, np.abs(values).max(axis=1))
    new_scale = {
        "tensor": np.float32(amax.max() / fp8_max),
        "row": (amax / fp8_max).astype(np.float32),
        "saturating": np.float32(amax.max() / fp8_max / 8),  # most values clamp to ±fp8_max
        "subnormal": np.float32(amax.max() / fp8_max * 2**10),  # most values land in e4m3's subnormals or 0
    }[target]
    new = requantize_rows(codes, source, new_scale, fp8_max)
    # quantize divides along the last axis: a per-row scale is a per-column one of the transpose
    expected = e4m3.quantize(values.T, new_scale, fp8_max).T if new_scale.ndim else e4m3.quantize(values, new_scale, fp8_max)
    np.testing.assert_array_equal(new.codes.view(np.uint8), expected.view(np.uint8))
    difference = (e4m3.fp8_to_float32(expected) * np.reshape(new_scale, (-1, 1)) - values).astype(np.float64)
    assert new.squared_error == pytest.approx(float(np.sum(difference**2)), rel=1e-9)
    assert new.squared_source == pytest.approx(float(np.sum(values.astype(np.float64) ** 2)), rel=1e-9)


@pytest.mark.parametrize("nan_code", [0x7F, 0xFF])
def test_a_nan_code_is_refused_naming_its_index(nan_code):
    codes = _codes(np.random.default_rng(1), (8, 16))
    codes[5, 9] = nan_code
    with pytest.raises(
        NonFiniteError, match=r"tensor 'model.layers.0.mlp.up_proj.weight' \[108, 16\] holds nan at index \[105, 9\]"
    ):
        row_amax(codes, np.float32([0.01]), "model.layers.0.mlp.up_proj.weight", 100, (108, 16))
