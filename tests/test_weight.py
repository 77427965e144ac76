"""QuantizedWeight's input checks that need no GPU."""
import numpy as np
import pytest

import awq_cupy


@pytest.mark.parametrize("K", [12, 100, 1001])
def test_in_features_not_a_multiple_of_8_is_refused_before_any_device_work(K):
    """The kernels read activation rows 16 bytes at a time; K % 8 != 0 would misalign every row after the first.
    The check runs on the host shapes, so the error is the same with or without a GPU."""
    qweight = np.zeros((K, 2), np.int32)
    qzeros = np.zeros((1, 2), np.int32)
    scales = np.ones((1, 16), np.float16)
    with pytest.raises(ValueError, match=f"K={K} .* not a multiple of 8"):
        awq_cupy.QuantizedWeight.from_gemm(qweight, qzeros, scales, -1)
