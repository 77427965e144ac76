"""Where a back-to-back GEMV call's time goes: the GEMV built with AWQ_GEMV_TRACE (kernels_cu/gemv_tc.cu), whose
CTAs write %globaltimer at ten points; calls queued behind a spin kernel as in `python -m awq_cupy bench`,
weights rotated. Usage:
    python3 bench/probes/gemv_trace.py [M] [model] [tiles/warps,...]   (default 1, mistral-7b, the planned launch only)
Per layer and plan, medians over the calls, in ns relative to the end of the previous call's last CTA: the first and
last CTA start, then the timeline of the CTA that ends last (the critical path): entry, index arithmetic done,
prologue loads issued, pdl_wait returned, first unit computed (warp 0), main loop done (all warps), end; and three
points inside the index arithmetic (CTA's blocks, warp's units, load cursor); then, for that CTA's warps, when
their loops end (earliest, latest, which warp; and each warp's, in warp order) and the longest epilogue after the
last loop (medians; which warp, the median of the call's warp indices), and where a warp sums a shared column
group by itself, when that sum starts and is done (before its stores), also after the last loop. Where matmul runs
a GEMV compiled for the layer's launch shape (planner.gemv_specializes), that is the kernel traced. TRACE_SOURCE=
gemv_tc_ab.cu traces that file's kernel instead (prepared as for bench/sweeps/gemv_ab.py), to compare two versions'
timelines.
"""
import dataclasses
import os
import sys

import cupy as cp
import numpy as np

from awq_cupy import kernels
from awq_cupy import launch as launches
from awq_cupy import plans as planner
from awq_cupy.bench import MODELS, rotated_weights
from awq_cupy.jit import arch_of_device, get_kernel

M = int(sys.argv[1]) if len(sys.argv) > 1 else 1
model = sys.argv[2] if len(sys.argv) > 2 else "mistral-7b"
variants = [None] + ([tuple(int(v) for v in p.split("/")) for p in sys.argv[3].split(",")] if len(sys.argv) > 3 else [])
FAM = dataclasses.replace(kernels.GEMV_TC, name="gemv_trace", defines=(("AWQ_GEMV_TRACE", "1"),),
                          source=os.environ.get("TRACE_SOURCE", kernels.GEMV_TC.source),
                          variants=lambda a: tuple(kernels.GemvVariant("float16", -(-M // 8), tw, True)
                                                   for tw in (1, 2, 3, 4))
                          + tuple(kernels.GemvVariant("float16", nb, tw, True, 2) for nb, tw in kernels.GEMV_KD2_SHAPES
                                  if nb == -(-M // 8)))
arch = arch_of_device(0)
sms = launches.sm_count(0)
spin = kernels.kernel(kernels.SPIN_KERNEL)
rng = np.random.default_rng(0)
CALLS = 48
POINTS = ("entry", "index", "issued", "waited", "unit0", "loop", "end", "b0", "u0", "cursor")
STRIDE = 44   # kernels_cu/gemv_tc.cu AWQ_TRACE_STRIDE: 12 CTA points, then (loop done, epilogue done) per warp
for name, K, N in MODELS[model]:
    G = 128
    wq = rotated_weights(rng, K, N, G)
    nq = len(wq)
    x = cp.asarray(rng.standard_normal((M, K)).astype(np.float16))
    y = cp.empty((M, N), cp.float16)
    for plan in variants:
        for pdl in (True, False):
            tw, wp = plan if plan else (None, None)
            p = planner.plan_gemv(M, K, N, G, arch=arch, sm_count=sms, tiles=tw, warps=wp)
            v = p.variant("float16")
            if planner.gemv_specializes(arch, K, N):   # the shape-compiled kernel that matmul runs
                fam = kernels.gemv_shape_family(v, planner.gemv_shape_args(wq[0], p), p.warps,
                                                (("AWQ_GEMV_TRACE", "1"),),
                                                tokens=planner.gemv_compiled_tokens(M, K, N))
                k = get_kernel(dataclasses.replace(fam, source=FAM.source, source_dir=FAM.source_dir), v)
            else:
                k = get_kernel(FAM, v)
            trace = cp.zeros((CALLS, p.grid, STRIDE), cp.uint64)

            def call(i):   # the trace buffer stands in for the bias (AWQ_GEMV_TRACE)
                k.launch((p.grid,), (32 * p.warps,), launches.gemv_args(x, wq[i % nq], trace[i], y, M, p),
                         smem=p.smem, pdl=pdl)
            call(0)
            cp.cuda.get_current_stream().synchronize()
            spin.launch((1,), (1,), (np.int64(20_000_000),))
            for i in range(CALLS):
                call(i)
            cp.cuda.get_current_stream().synchronize()
            t = trace.get().astype(np.int64)
            rows, warps, per_warp = [], [], []
            W = p.warps
            for c in range(8, CALLS):            # skip the first calls (the spin's end, the queue's start)
                ref = t[c - 1, :, 6].max()
                last = int(np.argmax(t[c, :, 6]))
                rows.append([t[c, :, 0].min() - ref, t[c, :, 0].max() - ref] + list(t[c, last, :10] - ref))
                loop_done = t[c, last, 12:12 + 2 * W:2] - ref     # per warp of the last CTA
                epi_done = t[c, last, 13:13 + 2 * W:2] - ref
                per_warp.append(loop_done)
                own = [t[c, last, j] - ref - loop_done.max() if t[c, last, j] else np.nan for j in (10, 11)]
                warps.append([loop_done.min(), loop_done.max(), int(np.argmax(loop_done)),
                              (epi_done - loop_done.max()).max(), int(np.argmax(epi_done))] + own)
            med = np.median(np.array(rows), axis=0)
            wmed = np.median(np.array(warps), axis=0)
            own = ("" if np.isnan(wmed[5]) else
                   f"; a warp's own sum of a shared group: starts {wmed[5]:5.0f}, done {wmed[6]:5.0f}")
            label = f"{p.tiles}{'x2' if p.kdepth == 2 else ''}/{p.warps}"
            print(f"{name:8s} M={M:3d} {label:5s} pdl={int(pdl)}  starts {med[0]:6.0f}..{med[1]:6.0f} | last CTA "
                  + " ".join(f"{n} {v:6.0f}" for n, v in zip(POINTS, med[2:])), flush=True)
            print(f"{'':8s}   its warps: loops done {wmed[0]:6.0f}..{wmed[1]:6.0f} (last: warp {wmed[2]:.0f}), "
                  f"longest epilogue after the last loop {wmed[3]:6.0f} (warp {wmed[4]:.0f}){own}", flush=True)
            by_warp = np.median(np.array(per_warp), axis=0)
            print(f"{'':8s}   loop done by warp: " + " ".join(f"{v:.0f}" for v in by_warp), flush=True)
    wq = None
    cp.get_default_memory_pool().free_all_blocks()
