"""Sweep the GEMV's variants (blocks per unit, units per register batch, warps per CTA) on model layers, timed like
`python -m awq_cupy bench` (queue preloaded, weights rotated). Usage:
    python3 bench/gemv_sweep.py [M=1,8,...] [nb,tiles,batch,warps ...]
(default M 1,8; default plans: every instantiated (token blocks, tiles) at its table batch and 16 / 12 / 8 warps).
Plans (and shapes) outside the kernel table are compiled for this run (fp16, groups of whole 64-k units). Every plan's output is
checked against the default plan's before it is timed. For M > 8 the fused GEMM's planned launch is timed too
(the dispatch crossover). Prints the plans per (layer, M), best first, and the sums of the best GEMV plan and of
the GEMM. GEMV_SWEEP_NOCHECK=1 skips the output check (timing probes of deliberately wrong kernels).
"""
import dataclasses
import os
import sys

import cupy as cp
import numpy as np

from awq_cupy import kernels, ops
from awq_cupy.bench import MODELS, Timer, rotated_weights
from awq_cupy.jit import arch_of_device

args = sys.argv[1:]
ms = [1, 8]
if args and args[0].startswith("M="):
    ms = [int(v) for v in args.pop(0)[2:].split(",")]
arch = arch_of_device(0)
plans = [tuple(int(v) for v in a.split(",")) for a in args]
if not plans:
    plans = [(nb, tw, kernels.gemv_batch_warps(nb, tw, arch)[0], w) for nb, tw in kernels.GEMV_SHAPES
             for w in (16, 12, 8) if w <= kernels.gemv_max_warps(nb, tw, arch)]
for nb, tw, b, w in plans:   # a (token blocks, tiles) shape outside the table: added for this run
    if (nb, tw) not in kernels.GEMV_SHAPES:
        kernels.GEMV_SHAPES += ((nb, tw),)
        kernels.GEMV_PLANS[(nb, tw)] = (b, w)
extra = tuple(kernels.gemv_variant("float16", nb, tw, True, b, w) for nb, tw, b, w in plans
              if (b, w) != kernels.gemv_batch_warps(nb, tw, arch))
if extra:
    base = kernels.GEMV_TC.variants
    fam = dataclasses.replace(kernels.GEMV_TC, variants=lambda a: tuple(dict.fromkeys(base(a) + extra)))
    kernels.GEMV_TC = kernels.FAMILIES["gemv_tc"] = fam
sms = ops._sm_count(0)
timer = Timer()
rng = np.random.default_rng(0)
sums = {}
print("plans (token blocks, tiles, batch, warps):", plans, flush=True)
for name, K, N in MODELS["mistral-7b"]:
    G = 128
    wq = rotated_weights(rng, K, N, G)
    nq = len(wq)
    for M in ms:
        x = cp.asarray(rng.standard_normal((M, K)).astype(np.float16))
        y = cp.empty((M, N), cp.float16)
        ops._launch_gemv(x, wq[0], ops._NULL, y, M, "float16", sms)
        ref = y.astype(cp.float32)
        res = []
        for nb, tw, b, warps in plans:
            if nb != -(-M // 8):
                continue
            kw = dict(tiles=tw, warps=warps)
            if (b, warps) != kernels.gemv_batch_warps(nb, tw, arch):
                kw["batch"] = b
            try:
                ops.plan_gemv(M, K, N, G, arch=arch, sm_count=sms, **kw)
            except ValueError:
                continue
            y.fill(0)
            ops._launch_gemv(x, wq[0], ops._NULL, y, M, "float16", sms, **kw)
            err = float(cp.abs(y.astype(cp.float32) - ref).max() / (cp.abs(ref).max() + 1e-6))
            if err > 1e-2 and not os.environ.get("GEMV_SWEEP_NOCHECK"):
                print(f"  WRONG {name} M={M} plan {(nb, tw, b, warps)}: max rel err {err:.3g}", flush=True)
                continue
            us = timer(lambda i: ops._launch_gemv(x, wq[i % nq], ops._NULL, y, M, "float16", sms, **kw),
                       max(20, nq), 3)
            res.append((us, f"t{tw}b{b}w{warps}"))
            best = sums.setdefault((M, "gemv"), {})
            best[name] = min(best.get(name, us), us)
        if M > 8:
            us = timer(lambda i: ops._launch_gemm(x, wq[i % nq], ops._NULL, y, M, "float16", arch, sms, False),
                       max(20, nq), 3)
            sums.setdefault((M, "gemm"), {})[name] = us
            res.append((us, "gemm"))
        res.sort(key=lambda r: r[0])
        print(f"{name:8s} M={M:2d} " + "  ".join(f"{p}:{us:.1f}" for us, p in res), flush=True)
    del wq
    cp.get_default_memory_pool().free_all_blocks()
for (M, path), per in sorted(sums.items(), key=lambda kv: (kv[0][0], kv[0][1])):
    print(f"sum M={M:2d} {path}: {sum(per.values()):.1f} us  " +
          " ".join(f"{k} {v:.1f}" for k, v in per.items()))
