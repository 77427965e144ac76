"""Sweep the GEMM's launch parameters on the Mistral-7B layers (GEMM_SWEEP_MODELS=llama-2-70b,...: those models'),
timed like `python -m awq_cupy bench` (queue preloaded, weights rotated). Usage:
    python3 bench/sweeps/gemm_sweep.py [M,...] [json path] [extra wgmma shapes]   (default 16,32,64,128,256)
Extra shapes, e.g. "2,2,8:8,1,8" (token blocks, column blocks per warp, depth), are instantiated for this run only.
Every measurement is also logged to stderr as it completes (with the time since start), so a stalled launch shows
which one it is.
Per (layer, M): the mma.sync kernel (gemm_tc.cu, M <= 32) and the wgmma kernel (gemm_wg.cu, sm_90 only) with
their planned launches, then every instantiated wgmma shape (token blocks, column blocks per warp, depth) of M's
token tile at split counts 1, 2, 4, 8 (16 up to M = 128) and the planned one, each with every PEND variant of the
shape, and two K streams (unsplit) where the shape has them. Prints the best five per (layer, M)
and the sums; the JSON holds every measurement with the plan's split count and CTAs per SM (for the cost model).
"""
import json
import os
import sys
import time

import cupy as cp
import numpy as np

from awq_cupy import kernels, launch, plans
from awq_cupy.bench import MODELS, Timer, rotated_weights
from awq_cupy.jit import arch_of_device
from awq_cupy.kernels import WgmmaVariant, kernel

ms = [int(v) for v in sys.argv[1].split(",")] if len(sys.argv) > 1 else [16, 32, 64, 128, 256]
out = sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] != "-" else None
if len(sys.argv) > 3:   # extra shapes: instantiated before anything compiles
    extra = tuple(tuple(int(v) for v in s.split(",")) for s in sys.argv[3].split(":"))
    kernels.GEMM_WG_SHAPES = kernels.GEMM_WG_SHAPES + tuple(e for e in extra if e not in kernels.GEMM_WG_SHAPES)
t_start = time.perf_counter()
arch = arch_of_device(0)
wg = plans.has_wgmma(arch)
sms = launch.sm_count(0)
timer = Timer()
rng = np.random.default_rng(0)
sums = {}
records = []
layers = [(f"{m[:7]}/{name}", K, N) for m in os.environ.get("GEMM_SWEEP_MODELS", "mistral-7b").split(",")
          for name, K, N in MODELS[m]]
for name, K, N in layers:
    G = 128
    wq = rotated_weights(rng, K, N, G)
    nq = len(wq)
    KS = wq[0].KS
    for M in ms:
        x = cp.asarray(rng.standard_normal((M, K)).astype(np.float16))
        y = cp.empty((M, N), cp.float16)

        def t(**kw):
            print(f"[{time.perf_counter() - t_start:7.1f}s] {name} M={M} {kw} ...", end="", file=sys.stderr, flush=True)
            us = timer(lambda i: launch.run_gemm(x, wq[i % nq], launch.NULL, y, M, "float16", arch, sms, False, **kw),
                       max(20, nq), 3)
            print(f" {us:.1f} us", file=sys.stderr, flush=True)
            return us

        row = {"sw": t(wgmma=False)} if M <= 32 else {}
        res = []
        if wg:
            row["wg"] = t(wgmma=True)
            for nb, tw, p in kernels.GEMM_WG_SHAPES:
                if plans.gemm_token_tile(M, True) != 8 * nb:
                    continue
                v = WgmmaVariant("float16", nb, tw, p, True)
                per_sm = kernel(v).resident_blocks(v.threads, v.smem_bytes)
                pp = plans.plan_gemm(M, K, N, G, wgmma=True, sm_count=sms, resident=per_sm * sms, tiles=tw, depth=p)
                for sp, pend in ((sp, pend) for sp in sorted({1, 2, 4, 8, pp.splits} | ({16} if M <= 128 else set()))
                                 for pend in kernels.gemm_wg_pends((nb, tw, p))):
                    if sp <= max(1, KS // 2):
                        us = t(wgmma=True, tiles=tw, depth=p, splits=sp, pend=pend)
                        res.append((us, f"{nb},{tw},{p}" + (f",pend{pend}" if pend else ""), sp))
                        records.append(dict(layer=name, K=K, N=N, M=M, shape=[nb, tw, p], splits=sp, us=us,
                                            pend=pend, planned=sp == pp.splits, per_sm=per_sm,
                                            grid=pp.grid[0] * pp.grid[2]))
                if (nb, tw, p) in kernels.GEMM_WG_KSPLIT_SHAPES:
                    us = t(wgmma=True, tiles=tw, depth=p, splits=1, ksplit=2)
                    res.append((us, f"{nb},{tw},{p},ksplit2", 1))
            res.sort()
            row["best"] = min(res[0][0], row["wg"])
        for k, v in row.items():
            sums[(M, k)] = sums.get((M, k), 0.0) + v
        print(f"{name:8s} M={M:4d} " + "  ".join(f"{k} {v:7.1f}" for k, v in row.items())
              + ("  " + "  ".join(f"({c})/s{sp}:{us:.1f}" for us, c, sp in res[:5]) if res else ""), flush=True)
    del wq
    cp.get_default_memory_pool().free_all_blocks()
for M in ms:
    print(f"sum M={M:4d}  " + "  ".join(f"{k} {sums[(M, k)]:7.1f}us" for k in ("sw", "wg", "best") if (M, k) in sums))
if out:
    with open(out, "w") as f:
        json.dump(records, f)
