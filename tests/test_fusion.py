"""fusion.py copies in stripes for speed; the result must be exactly what concatenating transposes gives."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from hpu_fp8_loader.numerics.fusion import fuse_columns, transposed

DTYPES = [np.uint8, ml_dtypes.float8_e4m3fn, ml_dtypes.bfloat16, np.float16, np.float32]


def _array(rng: np.random.Generator, shape: tuple[int, ...], dtype) -> np.ndarray:
    return rng.normal(size=shape).astype(np.float32).astype(dtype) if dtype != np.uint8 else rng.integers(0, 256, shape, np.uint8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (17, 5), (33, 64), (64, 33)])  # rows below, across and beyond one stripe
def test_transposed_is_a_contiguous_transpose(dtype, shape):
    array = _array(np.random.default_rng(0), shape, dtype)
    out = transposed(array)
    assert out.flags.c_contiguous and out.dtype == array.dtype
    np.testing.assert_array_equal(out.view(np.uint8), np.ascontiguousarray(array.T).view(np.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transpose", [[True], [False], [True, True, True], [False, False], [True, False]])
def test_fused_parts_equal_concatenated_transposes(dtype, transpose):
    rng = np.random.default_rng(1)
    arrays = [_array(rng, (12 + 7 * k, 40) if flip else (40, 12 + 7 * k), dtype) for k, flip in enumerate(transpose)]
    fused = fuse_columns(arrays, transpose)
    expected = np.concatenate([a.T if flip else a for a, flip in zip(arrays, transpose, strict=True)], axis=-1)
    assert fused.flags.c_contiguous and fused.dtype == expected.dtype
    np.testing.assert_array_equal(fused.view(np.uint8), np.ascontiguousarray(expected).view(np.uint8))


def test_mixed_dtypes_widen_by_value_and_biases_concatenate():
    rng = np.random.default_rng(2)
    wide, narrow = rng.normal(size=(20, 8)).astype(np.float32), rng.normal(size=(6, 8)).astype(ml_dtypes.bfloat16)
    fused = fuse_columns([wide, narrow], [True, True])
    assert fused.dtype == np.float32
    np.testing.assert_array_equal(fused, np.concatenate([wide.T, narrow.T.astype(np.float32)], axis=-1))
    biases = [np.arange(3, dtype=np.float32), np.arange(4, dtype=np.float32)]
    np.testing.assert_array_equal(fuse_columns(biases, [False, False]), np.concatenate(biases))
