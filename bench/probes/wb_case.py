"""A target for ncu / compute-sanitizer: one gemm_wb prototype variant (bench/probes/kernels/gemm_wb.cu) on one layer, x as
zero images, no PDL. Usage:
    python3 bench/probes/wb_case.py "S,D[,MODE[,CW]]" K N M SPLITS CALLS
e.g. compute-sanitizer --tool memcheck python3 bench/probes/wb_case.py 4,4 4096 4096 64 4 2
"""
import sys

import cupy as cp
import numpy as np

from awq_cupy.bench import rotated_weights
from runtime import kernel, with_variants
from wb_launch import launch, variant_of

variant, S, CW, _ = variant_of(tuple(int(v) for v in sys.argv[1].split(",")))
K, N, M, splits, calls = (int(v) for v in sys.argv[2:7])
k = kernel(with_variants("gemm_wb", (variant,)), variant)
w = rotated_weights(np.random.default_rng(0), K, N, 128)[0]
xin = cp.zeros((w.KS, 64, 72), cp.float16)
y = cp.empty((M, N), cp.float16)
for _ in range(calls):
    launch(k, S, CW, xin, w, y, M, splits, pdl=False, reduce=False)
cp.cuda.Device().synchronize()
print(variant, k.resources)
