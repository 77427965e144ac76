"""PROTOTYPE timing: bench/probes/kernels/gemm_wb.cu (weights as the wgmma B operand, decoded by producer warps; docs/history.md
v33 next step 0) against the fused GEMM that matmul runs, on the Mistral-7B layers at M <= 64, timed like
`python -m awq_cupy bench` (queue preloaded, weights rotated). Per (layer, M): the prototype at several split
counts, its output checked against matmul's first. Usage:
    python3 bench/probes/wb_probe.py [M,...] ["S,D[,MODE[,CW]];..."]   (default 32,64 and 4,4: template arguments of each
    kernel to time, see gemm_wb.cu; MODE 1 or 2: the producers' or the consumers' pace alone, values wrong; CW:
    consumer warps, 8 or 4).
    x always comes as per-unit images made before the timing, one bulk copy per unit (XT).
"""
import sys

import cupy as cp
import numpy as np

import awq_cupy
from awq_cupy.bench import MODELS, Timer, rotated_weights
from runtime import kernel, with_variants
from wb_launch import launch as launch_wb, variant_of, x_images

ms = [int(v) for v in sys.argv[1].split(",")] if len(sys.argv) > 1 else [32, 64]
# kernels: "S,D[,MODE[,CW]]" separated by ";" (template arguments of awq_gemm_wb_kernel; x always as images)
specs = [tuple(int(v) for v in spec.split(",")) for spec in
         (sys.argv[2] if len(sys.argv) > 2 else "4,4").split(";")]
variants = [variant_of(sp) for sp in specs]
fam = with_variants("gemm_wb", tuple(v[0] for v in variants))
timer = Timer()
rng = np.random.default_rng(0)


sums = {}
for name, K, N in MODELS["mistral-7b"]:
    wq = rotated_weights(rng, K, N, 128)
    nq = len(wq)
    for M in ms:
        x = cp.asarray(rng.standard_normal((M, K)).astype(np.float16))
        ref = awq_cupy.matmul(x, wq[0]).astype(cp.float32)
        xin = x_images(x, wq[0].KS)
        y = cp.empty((M, N), cp.float16)
        main = timer(lambda i: awq_cupy.matmul(x, wq[i % nq], out=y), max(20, nq), 3)
        print(f"{name:8s} M={M:3d}  matmul {main:6.1f}", flush=True)
        sums[(M, "matmul")] = sums.get((M, "matmul"), 0.0) + main
        for vi, (variant, S, CW, MODE) in enumerate(variants):
            k = kernel(fam, variant)
            line, best = [], None
            for splits in (1, 2, 3, 4, 6, 8):
                y.fill(np.nan)
                launch_wb(k, S, CW, xin, wq[0], y, M, splits)
                err = float(cp.max(cp.abs(y.astype(cp.float32) - ref)) / (cp.max(cp.abs(ref)) + 1e-6))
                if not err < 2e-3 and not MODE:
                    line.append(f"s{splits} WRONG (max rel err {err:.3g})")
                    continue
                us = timer(lambda i: launch_wb(k, S, CW, xin, wq[i % nq], y, M, splits), max(20, nq), 3)
                line.append(f"s{splits} {us:6.1f}")
                best = us if best is None else min(best, us)
            print(f"  v{vi} " + "  ".join(line), flush=True)
            sums[(M, vi)] = sums.get((M, vi), 0.0) + (best if best is not None else float("nan"))
    wq = None   # free the rotated copies before the next layer
    cp.get_default_memory_pool().free_all_blocks()
for vi, v in enumerate(variants):
    print(f"# v{vi} = {v[0]}: {kernel(fam, v[0]).resources}")
for M in ms:
    print(f"sum M={M}: matmul {sums[(M, 'matmul')]:6.1f} us; prototype, best split per layer: "
          + ", ".join(f"v{vi} {sums[(M, vi)]:6.1f}" for vi in range(len(variants))), flush=True)
