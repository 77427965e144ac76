"""Sweep the GEMV's launch parameters (blocks per unit, warps per CTA) on model layers, timed like
`python -m awq_cupy bench` (queue preloaded, weights rotated). Usage:
    python3 bench/gemv_sweep.py [M,...]   (default 1,8)
"""
import sys

import cupy as cp
import numpy as np

import awq_cupy
from awq_cupy import formats, ops
from awq_cupy.bench import MODELS, Timer
from awq_cupy.jit import arch_of_device
from awq_cupy.kernels import GEMV_SHAPES

ms = [int(v) for v in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 8]
arch = arch_of_device(0)
sms = ops._sm_count(0)
timer = Timer()
rng = np.random.default_rng(0)
for name, K, N in MODELS["mistral-7b"]:
    G = 128
    t = formats.pack(rng.integers(0, 16, (K, N), dtype=np.uint8), rng.integers(0, 16, (K // G, N), dtype=np.uint8),
                     rng.uniform(0.001, 0.01, (K // G, N)).astype(np.float16), "gemm", G)
    w0 = awq_cupy.QuantizedWeight.from_gemm(t["qweight"], t["qzeros"], t["scales"], G)
    nq = max(2, -(-512 * 2**20 // w0.nbytes))
    wq = [w0] + [awq_cupy.QuantizedWeight(qtiles=w0.qtiles.copy(), scales=w0.scales.copy(), zeros=w0.zeros.copy(),
                                          K=K, N=N, group_size=G, dtype="float16") for _ in range(nq - 1)]
    for M in ms:
        x = cp.asarray(rng.standard_normal((M, K)).astype(np.float16))
        y = cp.empty((M, N), cp.float16)
        res = []
        for nb, tw in GEMV_SHAPES:
            if nb != -(-M // 8):
                continue
            for warps in (16, 12, 8, 4):
                try:
                    ops.plan_gemv(M, K, N, G, arch=arch, sm_count=sms, tiles=tw, warps=warps)
                except ValueError:
                    continue
                us = timer(lambda i: ops._launch_gemv(x, wq[i % nq], ops._NULL, y, M, "float16", sms, tiles=tw,
                                                      warps=warps), max(20, nq), 3)
                res.append((us, tw, warps))
        res.sort()
        print(f"{name:8s} M={M:2d} " + "  ".join(f"tw{tw}/w{wp}:{us:.1f}" for us, tw, wp in res[:8]),
              flush=True)
    del wq
    cp.get_default_memory_pool().free_all_blocks()
