"""Probe: the GEMV with two co-resident CTAs per SM, each with half the SM's warps, against matmul's plan (one CTA
per SM), Mistral-7B (or AB_MODEL) layers at M = 1 and 16 (AB_MS), timed like `python -m awq_cupy bench` (queue
preloaded, weights rotated, back-to-back calls with programmatic dependent launch).

Why (docs/history.md v34): at M = 1 about 15 of the sum's ~40 us are the calls' starts and tails, and the next call's
CTA can only start on an SM once this call's CTA there has left: it holds the whole register file. With two CTAs
per SM the next call's CTA starts when either leaves, and requests its first weights while the other finishes.
v33's probe of the idea kept the plan's blocks per unit for a grid of twice the CTAs (e.g. pairs for one block per
CTA: half of every unit padding), which this one does not: the blocks per unit (and 64-k blocks per unit) are
chosen by the planner's own rule for the doubled grid, or given as AB_X2=tiles:kdepth. The script prints each
variant's resident CTAs per SM (CUDA occupancy) and checks each output against the plan's (other summation order:
relative difference).
"""
import os

import cupy as cp
import numpy as np

from awq_cupy import launch, plans
from awq_cupy.bench import MODELS, Timer, rotated_weights
from awq_cupy.jit import arch_of_device

arch = arch_of_device(0)
sms = launch.sm_count(0)
ms = [int(m) for m in os.environ.get("AB_MS", "1,16").split(",")]
model = os.environ.get("AB_MODEL", "mistral-7b")
forced = [tuple(map(int, f.split(":"))) for f in os.environ.get("AB_X2", "").split(",") if f]
timer = Timer()
rng = np.random.default_rng(0)
sums: dict = {}
for name, K, N in MODELS[model]:
    wq = rotated_weights(rng, K, N, 128)
    nq = len(wq)
    for M in ms:
        x = cp.asarray(rng.standard_normal((M, K)).astype(np.float16))
        cands = [("plan", sms, None, None, None)]
        p2 = plans.plan_gemv(M, K, N, 128, arch=arch, sm_count=2 * sms)
        for tw, kd in [(None, None)] + forced:
            p = p2 if tw is None else plans.plan_gemv(M, K, N, 128, arch=arch, sm_count=2 * sms, tiles=tw, kdepth=kd)
            most = p.variant("float16").max_warps(arch)
            cands.append((f"x2 tw{p.tiles} kd{p.kdepth} w{most // 2}", 2 * sms, p.tiles, p.kdepth,
                          most // 2))
        ref = None
        line, times = [], []
        for label, sm_count, tw, kd, w in cands:
            y = cp.full((M, N), np.nan, cp.float16)

            def call(i, y=y, sm_count=sm_count, tw=tw, kd=kd, w=w):
                launch.run_gemv(x, wq[i % nq], launch.NULL, y, M, "float16", sm_count, tiles=tw, warps=w, kdepth=kd)
            call(0)
            out = y.astype(cp.float32)
            if ref is None:
                ref = out
                diff = "ref"
            else:
                diff = f"{float(cp.abs(out - ref).max()) / float(cp.abs(ref).max()):.0e}"
            p = plans.plan_gemv(M, K, N, 128, arch=arch, sm_count=sm_count, tiles=tw, warps=w, kdepth=kd)
            k = launch.gemv_kernel(wq[0], p, "float16", arch, M)
            res = k.resident_blocks(32 * p.warps, p.smem)
            us = min(timer(call, max(20, nq), 3) for _ in range(2))
            line.append(f"{label} grid {p.grid} res {res}: {us:6.2f} ({diff})")
            times.append(us)
        print(f"{name:8s} M={M:2d}  " + " | ".join(line), flush=True)
        for key, v in (("plan", times[0]), ("x2 planned", times[1]), ("x2 best", min(times[1:]))):
            sums[(M, key)] = sums.get((M, key), 0.0) + v
    wq = None
    cp.get_default_memory_pool().free_all_blocks()
for M in ms:
    print(f"sum M={M:2d}  " + ", ".join(f"{key} {sums[(M, key)]:6.1f}" for key in ("plan", "x2 planned", "x2 best")))
