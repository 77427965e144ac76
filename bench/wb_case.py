"""A target for ncu / compute-sanitizer: one gemm_wb prototype variant (kernels_cu/gemm_wb.cu) on one layer, x as
zero images, no PDL. Usage:
    python3 bench/wb_case.py "S,D[,MODE[,CW]]" K N M SPLITS CALLS
e.g. compute-sanitizer --tool memcheck python3 bench/wb_case.py 4,4 4096 4096 64 4 2
"""
import dataclasses
import sys

import cupy as cp
import numpy as np

from awq_cupy import kernels
from awq_cupy.bench import rotated_weights
from wb_launch import launch, variant_of

variant, S, CW, _ = variant_of(tuple(int(v) for v in sys.argv[1].split(",")))
K, N, M, splits, calls = (int(v) for v in sys.argv[2:7])
kernels.FAMILIES["gemm_wb"] = dataclasses.replace(kernels.GEMM_WB, variants=lambda arch: (variant,))
k = kernels.kernel("gemm_wb", variant)
w = rotated_weights(np.random.default_rng(0), K, N, 128)[0]
xin = cp.zeros((w.KS, 64, 72), cp.float16)
y = cp.empty((M, N), cp.float16)
for _ in range(calls):
    launch(k, S, CW, xin, w, y, M, splits, pdl=False, reduce=False)
cp.cuda.Device().synchronize()
print(variant, k.resources)
