"""Probe (docs/history.md v40): the GEMV with 3 and 4 token blocks (M = 17..32), which matmul does not run, against
matmul's planned GEMM on the Mistral-7B layers, timed like `python -m awq_cupy bench` (queue preloaded, weights
rotated). Each (token blocks, blocks per unit, warps) is compiled for its launch shape as matmul's GEMV is
(kernels.gemv_shape_family, straight from the template: these variants are not in the GEMV family's table), its
output checked against matmul's first. Usage: python3 bench/probes/gemv_wide_probe.py [M,...] [dtype] [model] [all]
(default 24,32 float16 mistral-7b; without "all" each variant runs only its largest warp count and (3, 1), (4, 4)
are left out). Besides the table, one "ROW model dtype layer K N M path us" line per measurement."""
import sys

import cupy as cp
import numpy as np

import awq_cupy
from awq_cupy import dtypes, launch, plans
from awq_cupy.bench import MODELS, Timer, rotated_weights
from awq_cupy.jit import arch_of_device, get_kernel
from awq_cupy.kernels import GemvVariant, gemv_shape_family

ms = [int(v) for v in sys.argv[1].split(",")] if len(sys.argv) > 1 else [24, 32]
kind = sys.argv[2] if len(sys.argv) > 2 else "float16"
model = sys.argv[3] if len(sys.argv) > 3 else "mistral-7b"
every = len(sys.argv) > 4 and sys.argv[4] == "all"
dt = dtypes.numpy_dtype(kind)
arch = arch_of_device(0)
sms = launch.sm_count(0)
timer = Timer()
rng = np.random.default_rng(0)
sums = {}


for name, K, N in MODELS[model]:
    G = 128
    wq = rotated_weights(rng, K, N, G, dtype=kind)
    nq = len(wq)
    for M in ms:
        nb = -(-M // 8)
        x = cp.asarray(rng.standard_normal((M, K)).astype(np.float16).astype(np.float32).astype(dt))
        y = cp.empty((M, N), dt)
        awq_cupy.matmul(x, wq[0], out=y)
        ref = y.astype(cp.float32)
        refmax = float(cp.abs(ref).max())
        res = []
        us = timer(lambda i: awq_cupy.matmul(x, wq[i % nq], out=y), max(20, nq), 3)
        res.append((us, "gemm", 0))
        sums.setdefault((M, "gemm"), {})[name] = us
        print(f"ROW {model} {kind} {name} {K} {N} {M} gemm {us:.3f}", flush=True)
        for tw in (1, 2, 3, 4):
            if not every and (nb, tw) in ((3, 1), (4, 4)):
                continue
            mw = GemvVariant(kind, nb, tw, True).max_warps(arch)
            for warps in sorted({mw, 12, 8} - {w for w in (16, 12) if w > mw}, reverse=True):
                if not every and warps != mw:
                    continue
                NT16, grid = plans.gemv_grid(N, sms)
                v = GemvVariant(kind, nb, tw, True)
                plan = plans.GemvPlan(token_blocks=nb, tiles=tw, aligned=True, grid=grid, NT16=NT16, warps=warps,
                                      smem=v.smem_bytes(warps), kdepth=1)
                shape = plans.gemv_shape_args(wq[0], plan)
                fam = gemv_shape_family(v, shape, warps, tokens=M)
                try:
                    k = get_kernel(fam, v)
                except Exception as e:   # noqa: BLE001
                    print(f"  compile failed {v} w{warps}: {e}", flush=True)
                    continue

                def call(i, k=k, plan=plan, shape=shape, warps=warps):
                    w = wq[i % nq]
                    k.launch((plan.grid,), (32 * warps,), launch.gemv_args(x, w, launch.NULL, y, M, plan, shape),
                             smem=plan.smem, pdl=plans.uses_pdl(arch))

                y.fill(np.nan)
                call(0)
                err = float(cp.abs(y.astype(cp.float32) - ref).max()) / refmax
                if not err < 1e-2:
                    print(f"  WRONG {v} w{warps}: rel err {err}", flush=True)
                    continue
                us = timer(call, max(20, nq), 3)
                res.append((us, f"nb{nb}tw{tw}", warps))
                print(f"ROW {model} {kind} {name} {K} {N} {M} gemv:{nb}:{tw}:{warps} {us:.3f}", flush=True)
                best = sums.setdefault((M, "gemv"), {})
                best[name] = min(best.get(name, us), us)
        res.sort(key=lambda r: r[0])
        print(f"{name:8s} M={M:2d} " + "  ".join(f"{t}/w{wp}:{us:.1f}" for us, t, wp in res), flush=True)
    del wq
    cp.get_default_memory_pool().free_all_blocks()
for (M, path), per in sorted(sums.items()):
    print(f"sum M={M:2d} {path}: {sum(per.values()):.1f} us  " + " ".join(f"{k} {v:.1f}" for k, v in per.items()))
