"""Token-tile choice of the fused GEMM for M above the largest tile: every layer of both benchmark models at M values
that do not fill whole 256-row tiles, timed like `python -m awq_cupy bench` (queue-preloaded, rotated weights).
Usage:
    python3 bench/sweeps/token_tiles.py [M,M,...] [--dtype bfloat16] [--models mistral-7b,llama-2-70b]
Columns (us per call):
    plan        awq_cupy.matmul as planned
    tT          the fused GEMM with token tile T forced (launch.run_gemm(token_tile=T))
    rows        two matmul calls on row slices: the whole 256-row tiles, then the remaining rows (each as planned)
    cublas      cuBLAS on the dequantized weights (fp16 or bf16 as the activations)
Every output is checked against the fp32 product of the dequantized weights. The plan each forced tile gets is
printed below its row (grid = column tiles, splits, token tiles; tail; PEND).
"""
import argparse

import cupy as cp
import numpy as np

import awq_cupy
from awq_cupy import launch, plans
from awq_cupy.bench import MODELS, Timer, rotated_weights
from awq_cupy.dtypes import numpy_dtype
from awq_cupy.jit import arch_of_device

ap = argparse.ArgumentParser()
ap.add_argument("ms", nargs="?", default="257,300,320,384,448,640,768,1100,1280,1536")
ap.add_argument("--dtype", default="float16")
ap.add_argument("--models", default="mistral-7b,llama-2-70b")
ap.add_argument("--tiles", default="64,128,256")
ap.add_argument("--trials", type=int, default=3)
a = ap.parse_args()
ms = [int(m) for m in a.ms.split(",")]
tiles = [int(t) for t in a.tiles.split(",")]
arch = arch_of_device(0)
sms = launch.sm_count(0)
timer = Timer()
rng = np.random.default_rng(0)
kind = a.dtype
sums: dict = {}
print(f"# {kind}; columns: plan " + " ".join(f"t{t}" for t in tiles) + " rows cublas (us)", flush=True)
for model in a.models.split(","):
    for name, K, N in MODELS[model]:
        wq = rotated_weights(rng, K, N, 128, kind)
        nq = len(wq)
        dense = awq_cupy.dequantize(wq[0])
        wd = [dense] + [dense.copy() for _ in range(max(1, -(-512 * 2**20 // dense.nbytes)) - 1)]
        for M in ms:
            x = cp.asarray(rng.standard_normal((M, K)).astype(np.float32).astype(numpy_dtype(kind)))
            y = cp.empty((M, N), x.dtype)
            ref = x.astype(cp.float32) @ dense.astype(cp.float32)
            refmax = float(cp.abs(ref).max())
            m1 = 256 * (M // 256)
            runs = {"plan": lambda i: awq_cupy.matmul(x, wq[i % nq], out=y)}
            for t in tiles:
                runs[f"t{t}"] = (lambda t: lambda i: launch.run_gemm(x, wq[i % nq], launch.NULL, y, M, kind, arch,
                                                                      sms, False, wgmma=True, token_tile=t))(t)
            if 0 < m1 < M:
                def rows(i):
                    awq_cupy.matmul(x[:m1], wq[i % nq], out=y[:m1])
                    awq_cupy.matmul(x[m1:], wq[i % nq], out=y[m1:])
                runs["rows"] = rows
            runs["cublas"] = lambda i: cp.matmul(x, wd[i % len(wd)], out=y)
            line = []
            for r, fn in runs.items():
                y.fill(np.nan)
                fn(0)
                err = float(cp.abs(y.astype(cp.float32) - ref).max()) / refmax
                if not err < 2e-2:
                    raise SystemExit(f"{r}: wrong result on {model} {name} M={M} (max rel err {err:.3g})")
                us = timer(fn, max(nq if r != "cublas" else len(wd), 20), a.trials)
                sums.setdefault((model, M, r), 0.0)
                sums[(model, M, r)] += us
                line.append(f"{r} {us:7.1f}")
            print(f"{model:11s} {name:8s} M={M:5d}  " + "  ".join(line), flush=True)
            for t in tiles:
                p = plans.plan_gemm_launch(M, K, N, 128, kind, arch, sms, launch._resident(0), wgmma=True,
                                           token_tile=t)
                print(f"    t{t}: grid {p.grid} per {p.per} tail {p.tail} pend {p.pend} ksplit {p.ksplit}")
        wq = wd = dense = None   # release this layer's copies before the next
        cp.get_default_memory_pool().free_all_blocks()
print("\nsum over each model's layers (us), and cuBLAS / contender")
for model in a.models.split(","):
    for M in ms:
        cols = [(r, us) for (mo, m, r), us in sums.items() if mo == model and m == M]
        base = dict(cols)["cublas"]
        print(f"{model:11s} M={M:5d}  " + "  ".join(f"{r} {us:8.1f} ({base / us:.2f}x)" for r, us in cols),
              flush=True)
