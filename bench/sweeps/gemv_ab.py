"""A/B of the GEMV kernel source in one process: kernels_cu/gemv_tc_ab.cu (a previous version with the current
argument list, launch.gemv_args) against the current gemv_tc.cu, planned launches, Mistral-7B layers, timed like
`python -m awq_cupy bench`, each side twice; outputs must match bit for bit. Usage:
    git show main:kernels_cu/gemv_tc.cu > kernels_cu/gemv_tc_ab.cu   (git-ignored: pass it in the device's carry)
    [AB_MS=1,16] [AB_MODEL=mistral-7b] [AB_LAYERS=qkv,gate_up] [AB_NEW=tiles:kdepth] python3 bench/sweeps/gemv_ab.py
AB_NEW runs the new side with that many blocks per unit and 64-k blocks per unit (e.g. 2:2) instead of its plan.
Where the two sides sum in a different order (another work split), the largest difference relative to the largest
output is printed instead of "bitwise equal". The new side runs what matmul runs: on compute capability 9.0 the
GEMV compiled for the layer's launch shape (plans.gemv_specializes); AWQ_CUPY_GEMV_SHAPES=0 makes it the generic
variant, like the old side.
(The fastdiv A/B of docs/history.md v25 ran a181c66's kernel with its own, shorter argument list.)
"""
import dataclasses
import os

import cupy as cp
import numpy as np

from awq_cupy import kernels, launch, plans
from awq_cupy.bench import MODELS, Timer, rotated_weights
from awq_cupy.jit import arch_of_device

arch = arch_of_device(0)
sms = launch.sm_count(0)
ms = [int(m) for m in os.environ.get("AB_MS", "1,16").split(",")]
model = os.environ.get("AB_MODEL", "mistral-7b")
only = os.environ.get("AB_LAYERS")
force = dict(zip(("tiles", "kdepth"), map(int, os.environ["AB_NEW"].split(":")))) if os.environ.get("AB_NEW") else {}
layers = [(n, K, N) for n, K, N in MODELS[model] if not only or n in only.split(",")]
# the old side runs this tree's plan (with its 64-k blocks per unit), so both sides split the work alike
plans = {(n, M): plans.plan_gemv(M, K, N, 128, arch=arch, sm_count=sms) for n, K, N in layers for M in ms}
needed = tuple(sorted({p.variant("float16").expr for p in plans.values()}))
OLD = dataclasses.replace(kernels.GEMV_TC, name="gemv_ab", source="gemv_tc_ab.cu", variants=lambda a: needed,
                         asserts=None)
timer = Timer()
rng = np.random.default_rng(0)
sums = {}
for name, K, N in layers:
    wq = rotated_weights(rng, K, N, 128)
    nq = len(wq)
    for M in ms:
        p = plans[(name, M)]
        x = cp.asarray(rng.standard_normal((M, K)).astype(np.float16))
        old = kernels.get_kernel(OLD, p.variant("float16"))
        outs, line = [], []
        for label in ("old", "new", "old", "new"):
            y = cp.full((M, N), np.nan, cp.float16)
            if label == "old":
                def call(i):
                    w = wq[i % nq]
                    old.launch((p.grid,), (32 * p.warps,), launch.gemv_args(x, w, launch.NULL, y, M, p),
                               smem=p.smem, pdl=plans.uses_pdl(arch))
            else:
                def call(i):
                    launch.run_gemv(x, wq[i % nq], launch.NULL, y, M, "float16", sms, **force)
            call(0)
            outs.append(y.copy())
            us = timer(call, max(20, nq), 3)
            sums[(label, M)] = sums.get((label, M), 0.0) + us / 2
            line.append(f"{label} {us:6.2f}")
        same = all(bool((o.view(cp.uint16) == outs[0].view(cp.uint16)).all()) for o in outs)
        ref = outs[0].astype(cp.float32)
        diff = max(float(cp.abs(o.astype(cp.float32) - ref).max()) for o in outs) / float(cp.abs(ref).max())
        print(f"{name:8s} M={M:2d} tiles={p.tiles} warps={p.warps} " + "  ".join(line)
              + ("  bitwise equal" if same else f"  max diff {diff:.1e} of max |y|"), flush=True)
    wq = None
    cp.get_default_memory_pool().free_all_blocks()
for M in ms:
    print(f"sum M={M:2d}  old {sums[('old', M)]:6.1f}  new {sums[('new', M)]:6.1f}")
