"""One layer, a few matmul calls: a target for ncu / compute-sanitizer.

    ncu --clock-control none --kernel-name regex:awq_gemv --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats python3 bench/profile_case.py 4096 28672 1
"""
import sys

import numpy as np
import cupy as cp

import awq_cupy
from awq_cupy import formats

K, N, M = (int(v) for v in sys.argv[1:4])
calls = int(sys.argv[4]) if len(sys.argv) > 4 else 4
rng = np.random.default_rng(0)
G = 128
t = formats.pack(rng.integers(0, 16, (K, N), dtype=np.uint8), rng.integers(0, 16, (K // G, N), dtype=np.uint8),
                 rng.uniform(0.001, 0.01, (K // G, N)).astype(np.float16), "gemm", G)
w = awq_cupy.QuantizedWeight.from_gemm(t["qweight"], t["qzeros"], t["scales"], G)
x = cp.asarray(rng.standard_normal((M, K)).astype(np.float16))
for _ in range(calls):
    y = awq_cupy.matmul(x, w)
cp.cuda.Device().synchronize()
print("done", y.shape)
