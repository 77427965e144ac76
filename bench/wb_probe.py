"""PROTOTYPE timing: kernels_cu/gemm_wb.cu (weights as the wgmma B operand, decoded by producer warps; bench/NOTES.md
v33 next step 0) against the fused GEMM that matmul runs, on the Mistral-7B layers at M <= 64, timed like
`python -m awq_cupy bench` (queue preloaded, weights rotated). Per (layer, M): the prototype at several split
counts, its output checked against matmul's first. Usage:
    python3 bench/wb_probe.py [M,...] ["S,D[,MODE[,CW]];..."]   (default 32,64 and 4,4: template arguments of each
    kernel to time, see gemm_wb.cu; MODE 1 or 2: the producers' or the consumers' pace alone, values wrong; CW:
    consumer warps, 8 or 4).
    x always comes as per-unit images made before the timing, one bulk copy per unit (XT).
"""
import dataclasses
import sys

import cupy as cp
import numpy as np

import awq_cupy
from awq_cupy import kernels, ops
from awq_cupy.bench import MODELS, Timer, rotated_weights
from awq_cupy.jit import arch_of_device, as_i32

ms = [int(v) for v in sys.argv[1].split(",")] if len(sys.argv) > 1 else [32, 64]
# kernels: "S,D[,MODE[,CW]]" separated by ";" (template arguments of awq_gemm_wb_kernel; x always as images)
specs = [tuple(int(v) for v in spec.split(",")) for spec in
         (sys.argv[2] if len(sys.argv) > 2 else "4,4").split(";")]
STAGE = 256 * 128 + 64 * 144


def variant_of(spec):
    S, D, MODE, CW = (tuple(spec) + (0, 8)[len(spec) - 2:])[:4]
    return f"awq_gemm_wb_kernel<__half, {S}, {D}, true, {MODE}, {CW}>", S, CW, MODE


variants = [variant_of(sp) for sp in specs]
kernels.FAMILIES["gemm_wb"] = dataclasses.replace(kernels.GEMM_WB, variants=lambda arch: tuple(v[0] for v in variants))
arch = arch_of_device(0)
sms = ops._sm_count(0)
timer = Timer()
rng = np.random.default_rng(0)


def launch_wb(k, S, CW, x, w, y, M, splits):
    Np = w.NT * 64
    NT16, KS = Np // 16, w.KS
    per = -(-KS // splits)
    splits = -(-KS // per)
    ws = ops._workspace(splits * M * Np, w.device) if splits > 1 else ops._NULL
    k.launch((-(-NT16 // 16), splits), (32 * (CW + 8),),
             (x, w.qtiles, w.scales, w.zeros, ops._NULL, y, ws, as_i32(M), as_i32(w.N), as_i32(w.K), as_i32(NT16),
              as_i32(KS), as_i32(w.group_size), as_i32(w.NG), as_i32(Np), as_i32(per)),
             smem=S * STAGE + 1024, pdl=True)
    if splits > 1:
        cols = ops.reduce_columns(M, w.N, sms)
        rk = kernels.kernel("gemm_tc", kernels.reduce_variant("float16", cols))
        rk.launch((min(-(-(M * w.N // cols) // 256), 4096),), (256,),
                  (ws, ops._NULL, y, as_i32(M), as_i32(w.N), as_i32(Np), as_i32(splits)), pdl=True)


sums = {}
for name, K, N in MODELS["mistral-7b"]:
    wq = rotated_weights(rng, K, N, 128)
    nq = len(wq)
    for M in ms:
        x = cp.asarray(rng.standard_normal((M, K)).astype(np.float16))
        ref = awq_cupy.matmul(x, wq[0]).astype(cp.float32)
        # x as per-unit images [KS][64][72]: unit ks's 64 rows of 64 k, 8 halves of padding, zeros past M and K
        KS = wq[0].KS
        xin = cp.zeros((KS, 64, 72), cp.float16)
        xp = cp.zeros((M, KS * 64), cp.float16)
        xp[:, :K] = x
        xin[:, :M, :64] = xp.reshape(M, KS, 64).transpose(1, 0, 2)
        y = cp.empty((M, N), cp.float16)
        main = timer(lambda i: awq_cupy.matmul(x, wq[i % nq], out=y), max(20, nq), 3)
        print(f"{name:8s} M={M:3d}  matmul {main:6.1f}", flush=True)
        sums[(M, "matmul")] = sums.get((M, "matmul"), 0.0) + main
        for vi, (variant, S, CW, MODE) in enumerate(variants):
            k = kernels.kernel("gemm_wb", variant)
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
    print(f"# v{vi} = {v[0]}: {kernels.kernel('gemm_wb', v[0]).resources}")
for M in ms:
    print(f"sum M={M}: matmul {sums[(M, 'matmul')]:6.1f} us; prototype, best split per layer: "
          + ", ".join(f"v{vi} {sums[(M, vi)]:6.1f}" for vi in range(len(variants))), flush=True)
