"""Host time per prepared GEMM call (launch.PreparedCall.run, the GPU kept ahead) with x through a tensor map,
encoded for each new x address (``x alternating``) or kept (``x same``), against the same call with the x tile pass
(one launch more). Usage: python3 bench/probes/host_tma.py [K N M]"""
import sys
import time

import cupy as cp
import numpy as np

import awq_cupy
from awq_cupy import formats, launch
from awq_cupy.jit import arch_of_device

K, N, M = (int(a) for a in sys.argv[1:4]) if len(sys.argv) > 3 else (512, 512, 256)
rng = np.random.default_rng(0)
Q = rng.integers(0, 16, (K, N), dtype=np.uint8)
Z = rng.integers(0, 16, (K // 128, N), dtype=np.uint8)
S = rng.uniform(0.01, 0.02, (K // 128, N)).astype(np.float16)
t = {k: cp.asarray(v) for k, v in formats.pack(Q, Z, S, "gemm", 128).items()}
w = awq_cupy.QuantizedWeight.from_gemm(t["qweight"], t["qzeros"], t["scales"], 128, dtype="float16")
xs = [cp.asarray(rng.standard_normal((M, K)).astype(np.float16)) for _ in range(2)]
y = cp.empty((M, N), cp.float16)
arch, sms, stream = arch_of_device(0), launch.sm_count(0), cp.cuda.get_current_stream().ptr
for tma in (False, True):
    pc = launch.prepare_gemm(w, M, "float16", arch, sms, stream, wgmma=True, tma=tma)
    for same in (True, False):
        ptrs = [xs[0].data.ptr] * 2 if same else [x.data.ptr for x in xs]
        best = []
        for rep in range(5):
            cp.cuda.Device().synchronize()
            n = 200
            t0 = time.perf_counter()
            for i in range(n):
                pc.run(ptrs[i & 1], y.data.ptr)
            best.append((time.perf_counter() - t0) / n * 1e6)
        cp.cuda.Device().synchronize()
        print(f"tma={int(tma)} x {'same' if same else 'alternating':11s}: {min(best):6.2f} us host per call "
              f"(best of 5 x 200), {len(pc.launches)} launches", flush=True)
