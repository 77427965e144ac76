"""Sweep the GEMV's launch parameters (blocks per unit, also pairs with two 64-k blocks per unit "2x2", warps per
CTA) on model layers, timed like
`python -m awq_cupy bench` (queue preloaded, weights rotated). Usage:
    python3 bench/sweeps/gemv_sweep.py [M,...] [model] [dtype]   (default 1,8, mistral-7b and float16)
For M > 8 the fused GEMM's planned launch is timed too (the dispatch crossover). Prints every plan per (layer, M),
fastest first, and the sums of the best GEMV plan and of the GEMM.
"""
import sys

import cupy as cp
import numpy as np

from awq_cupy import dtypes, launch, plans
from awq_cupy.bench import MODELS, Timer, rotated_weights
from awq_cupy.jit import arch_of_device
from awq_cupy.kernels import GEMV_KD2_SHAPES, GEMV_SHAPES

ms = [int(v) for v in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 8]
kind = sys.argv[3] if len(sys.argv) > 3 else "float16"
dt = dtypes.numpy_dtype(kind)
arch = arch_of_device(0)
sms = launch.sm_count(0)
timer = Timer()
rng = np.random.default_rng(0)
sums = {}
for name, K, N in MODELS[sys.argv[2] if len(sys.argv) > 2 else "mistral-7b"]:
    G = 128
    wq = rotated_weights(rng, K, N, G, dtype=kind)
    nq = len(wq)
    for M in ms:
        x = cp.asarray(rng.standard_normal((M, K)).astype(np.float16).astype(np.float32).astype(dt))
        y = cp.empty((M, N), dt)
        res = []
        for nb, tw, kd in [s + (1,) for s in GEMV_SHAPES] + [s + (2,) for s in GEMV_KD2_SHAPES]:
            if nb != -(-M // 8):
                continue
            for warps in (16, 12, 8):
                try:
                    plans.plan_gemv(M, K, N, G, arch=arch, sm_count=sms, tiles=tw, warps=warps, kdepth=kd)
                except ValueError:
                    continue
                us = timer(lambda i: launch.run_gemv(x, wq[i % nq], launch.NULL, y, M, kind, sms, tiles=tw,
                                                      warps=warps, kdepth=kd), max(20, nq), 3)
                res.append((us, f"{tw}x2" if kd == 2 else tw, warps))
                best = sums.setdefault((M, "gemv"), {})
                best[name] = min(best.get(name, us), us)
        if M > 8:
            us = timer(lambda i: launch.run_gemm(x, wq[i % nq], launch.NULL, y, M, kind, arch, sms, False),
                       max(20, nq), 3)
            sums.setdefault((M, "gemm"), {})[name] = us
            res.append((us, "gemm", 0))
        res.sort(key=lambda r: r[0])
        print(f"{name:8s} M={M:2d} " + "  ".join(f"tw{tw}/w{wp}:{us:.1f}" for us, tw, wp in res), flush=True)
    del wq
    cp.get_default_memory_pool().free_all_blocks()
for (M, path), per in sorted(sums.items(), key=lambda kv: (kv[0][0], kv[0][1])):
    print(f"sum M={M:2d} {path}: {sum(per.values()):.1f} us  " +
          " ".join(f"{k} {v:.1f}" for k, v in per.items()))
