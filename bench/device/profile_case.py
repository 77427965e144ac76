"""One layer, a few matmul calls: a target for ncu / compute-sanitizer.

    ncu --clock-control none --kernel-name regex:awq_gemv --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats python3 bench/device/profile_case.py 4096 28672 1 [calls] [tiles]

With ``tiles`` (1, 2 or 4) the GEMV variant with that many 16-column blocks per warp unit runs directly; with
``g1``/``g2``/``g4`` the wgmma GEMM with that many blocks per warp, with ``s2`` the mma.sync GEMM. Stall reasons of
the wgmma GEMM per source line (the next step of docs/history.md):

    ncu --clock-control none --kernel-name regex:awq_gemm_wg --launch-skip 1 --launch-count 1 --section \
        WarpStateStats --section SourceCounters --import-source yes python3 bench/device/profile_case.py 4096 28672 256 3 g1
"""
import sys

import numpy as np
import cupy as cp

import awq_cupy
from awq_cupy import formats
from awq_cupy.jit import arch_of_device

K, N, M = (int(v) for v in sys.argv[1:4])
calls = int(sys.argv[4]) if len(sys.argv) > 4 else 4
path = sys.argv[5] if len(sys.argv) > 5 else None   # "2": GEMV, 2 blocks per unit; "g2" / "s2": GEMM (wgmma / mma.sync)
tiles = int(path.lstrip("gs")) if path else None
rng = np.random.default_rng(0)
G = 128
t = formats.pack(rng.integers(0, 16, (K, N), dtype=np.uint8), rng.integers(0, 16, (K // G, N), dtype=np.uint8),
                 rng.uniform(0.001, 0.01, (K // G, N)).astype(np.float16), "gemm", G)
w = awq_cupy.QuantizedWeight.from_gemm(t["qweight"], t["qzeros"], t["scales"], G)
x = cp.asarray(rng.standard_normal((M, K)).astype(np.float16))
for _ in range(calls):
    if tiles is None:
        y = awq_cupy.matmul(x, w)
    elif path[0] in "gs":
        y = cp.empty((M, N), dtype=x.dtype)
        awq_cupy.launch.run_gemm(x, w, awq_cupy.launch.NULL, y, M, "float16", arch_of_device(0),
                                  awq_cupy.launch.sm_count(0), False, tiles=tiles, wgmma=path[0] == "g")
    else:
        y = cp.empty((M, N), dtype=x.dtype)
        awq_cupy.launch.run_gemv(x, w, awq_cupy.launch.NULL, y, M, "float16", awq_cupy.launch.sm_count(0), tiles=tiles)
cp.cuda.Device().synchronize()
print("done", y.shape)
