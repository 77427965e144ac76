"""A target for ncu / compute-sanitizer: one gemm_wb prototype variant (kernels_cu/gemm_wb.cu) on one layer, x as
zero images, no PDL. Usage:
    python3 bench/wb_case.py "S,D[,MODE[,CW]]" K N M SPLITS CALLS
e.g. compute-sanitizer --tool memcheck python3 bench/wb_case.py 4,4 4096 4096 64 4 2
"""
import dataclasses
import sys

import cupy as cp
import numpy as np

from awq_cupy import kernels, ops
from awq_cupy.bench import rotated_weights
from awq_cupy.jit import as_i32

spec = tuple(int(v) for v in sys.argv[1].split(","))
S, D, MODE, CW = (spec + (0, 8)[len(spec) - 2:])[:4]
K, N, M, splits, calls = (int(v) for v in sys.argv[2:7])
variant = f"awq_gemm_wb_kernel<__half, {S}, {D}, true, {MODE}, {CW}>"
kernels.FAMILIES["gemm_wb"] = dataclasses.replace(kernels.GEMM_WB, variants=lambda arch: (variant,))
k = kernels.kernel("gemm_wb", variant)
w = rotated_weights(np.random.default_rng(0), K, N, 128)[0]
KS = w.KS
xin = cp.zeros((KS, 64, 72), cp.float16)
Np = w.NT * 64
NT16 = Np // 16
per = -(-KS // splits)
splits = -(-KS // per)
ws = ops._workspace(splits * M * Np, w.device) if splits > 1 else ops._NULL
y = cp.empty((M, N), cp.float16)
for _ in range(calls):
    k.launch((-(-NT16 // 16), splits), (32 * (CW + 8),),
             (xin, w.qtiles, w.scales, w.zeros, ops._NULL, y, ws, as_i32(M), as_i32(w.N), as_i32(w.K), as_i32(NT16),
              as_i32(KS), as_i32(w.group_size), as_i32(w.NG), as_i32(Np), as_i32(per)),
             smem=S * (256 * 128 + 64 * 144) + 1024, pdl=False)
cp.cuda.Device().synchronize()
print(variant, k.resources)
