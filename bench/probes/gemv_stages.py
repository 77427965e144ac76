"""A/B of GEMV variants with other launch bounds / register stages (the kernel's THR and STG template arguments)
on the Mistral-7B layers, timed like `python -m awq_cupy bench`. Usage:
    [GS_MS=1,8,16] python3 bench/probes/gemv_stages.py RUN...
RUN is "name:token_blocks,tiles[,threads,stages[,warps]]" (threads and stages both given, or both 0 / left out for
the variant's defaults; warps defaults to threads / 32, or to the plan's). Each (layer, M) line times the runs whose
token blocks fit M; outputs are checked against the first such run (close, not bitwise: the warps' work split may
differ). Last, the sum over the four layers per run and M.
"""
import dataclasses
import os
import sys

import cupy as cp
import numpy as np

from awq_cupy import kernels, launch, plans
from awq_cupy.bench import MODELS, Timer, rotated_weights
from awq_cupy.jit import arch_of_device, get_kernel

runs = []
for a in sys.argv[1:]:
    name, _, spec = a.partition(":")
    v = [int(t) for t in spec.split(",")]
    runs.append((name, v + [0] * (5 - len(v))))


def variant(nb, tw, thr, stg, aligned=True):
    base = kernels.GemvVariant("float16", nb, tw, aligned).expr
    if not thr and not stg:
        return base
    if not (thr and stg):
        raise SystemExit(f"threads={thr}, stages={stg}: give both, or neither for the variant's defaults")
    return base[:-1] + f", 1, {thr}, {stg}>"   # KD = 1 (one 64-k block per unit), then THR and STG


needed = tuple(sorted({variant(*v[:4]) for _, v in runs}))
# the GEMV family instantiating these names (THR and STG are template arguments the table never sets)
fam = dataclasses.replace(kernels.GEMV_TC, name="gemv_stages", variants=lambda arch: needed, asserts=None)
arch = arch_of_device(0)
sms = launch.sm_count(0)
timer = Timer()
rng = np.random.default_rng(0)
ms = [int(m) for m in os.environ.get("GS_MS", "1,8,16").split(",")]
sums = {}
for lname, K, N in MODELS["mistral-7b"]:
    wq = rotated_weights(rng, K, N, 128)
    nq = len(wq)
    for M in ms:
        x = cp.asarray(rng.standard_normal((M, K)).astype(np.float16))
        ref = None
        line = []
        for name, (nb, tw, thr, stg, warps) in runs:
            if nb != -(-M // 8):
                continue
            p = plans.plan_gemv(M, K, N, 128, arch=arch, sm_count=sms, tiles=tw)
            W = warps or (thr // 32 if thr else p.warps)
            k = get_kernel(fam, variant(nb, tw, thr, stg), 0)
            y = cp.empty((M, N), cp.float16)

            pw = dataclasses.replace(p, warps=W, smem=p.variant("float16").smem_bytes(W))   # fastdiv by W matches

            def call(i):
                k.launch((p.grid,), (32 * W,), launch.gemv_args(x, wq[i % nq], launch.NULL, y, M, pw),
                         smem=pw.smem, pdl=plans.uses_pdl(arch))

            call(0)
            if ref is None:
                ref = y.astype(cp.float32)
            elif not bool(cp.allclose(y.astype(cp.float32), ref, rtol=1e-2, atol=1e-2)):
                raise SystemExit(f"{name}: output differs on {lname} M={M}")
            us = timer(call, max(20, nq), 3)
            sums.setdefault((name, M), 0.0)
            sums[(name, M)] += us
            line.append(f"{name} {us:6.1f}")
        print(f"{lname:8s} M={M:3d}  " + "  ".join(line), flush=True)
    del wq
    cp.get_default_memory_pool().free_all_blocks()
for M in ms:
    print(f"sum M={M:3d}  " + "  ".join(f"{n} {v:6.1f}" for (n, m), v in sums.items() if m == M))
