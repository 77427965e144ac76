"""First timings (µs) of awq_cupy.matmul vs cupy fp16 matmul (cuBLAS) on Mistral-7B layers.

Method: weights rotated over enough copies to exceed L2 (>= 512 MB per contender), N calls queued back to back
between CUDA events, median of 5 trials. The full benchmark is ``python -m awq_cupy bench``.
"""
import sys

import numpy as np
import cupy as cp

import awq_cupy
from awq_cupy import formats

SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)]
MS = [int(m) for m in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 16, 256, 1024]
rng = np.random.default_rng(0)


def timeit(fn, n_iter, trials=5):
    ts = []
    for _ in range(trials):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        for i in range(n_iter):
            fn(i)
        e1.record()
        e1.synchronize()
        ts.append(cp.cuda.get_elapsed_time(e0, e1) * 1000 / n_iter)
    return float(np.median(ts))


rows = []
for name, K, N in SHAPES:
    G = 128
    Q = rng.integers(0, 16, (K, N), dtype=np.uint8)
    Z = rng.integers(0, 16, (K // G, N), dtype=np.uint8)
    S = rng.uniform(0.001, 0.01, (K // G, N)).astype(np.float16)
    t = formats.pack(Q, Z, S, "gemm", G)
    w0 = awq_cupy.QuantizedWeight.from_gemm(t["qweight"], t["qzeros"], t["scales"], G)
    copies_q = max(2, int(np.ceil(512e6 / w0.nbytes)))
    ws = [w0] + [awq_cupy.QuantizedWeight(qtiles=w0.qtiles.copy(), scales=w0.scales.copy(), zeros=w0.zeros.copy(),
                                          K=K, N=N, group_size=G, dtype="float16") for _ in range(copies_q - 1)]
    dense = awq_cupy.dequantize(w0).view(cp.float16)
    copies_d = max(2, int(np.ceil(512e6 / dense.nbytes)))
    ds = [dense] + [dense.copy() for _ in range(copies_d - 1)]
    for M in MS:
        x = cp.asarray(rng.standard_normal((M, K)).astype(np.float16))
        y = cp.empty((M, N), cp.float16)
        ref = x @ ds[0]
        awq_cupy.matmul(x, ws[0], out=y)
        err = float(cp.abs(y.astype(cp.float32) - ref.astype(cp.float32)).max() / (cp.abs(ref).max() + 1e-6))
        n_iter = max(len(ws), 20)
        t_awq = timeit(lambda i: awq_cupy.matmul(x, ws[i % len(ws)], out=y), n_iter)
        t_fp16 = timeit(lambda i: cp.matmul(x, ds[i % len(ds)], out=y), max(len(ds), 20))
        rows.append((name, K, N, M, t_awq, t_fp16, err))
        print(f"{name:8s} {K:6d} {N:6d} M={M:5d}  awq {t_awq:9.1f} us  fp16 {t_fp16:9.1f} us  "
              f"ratio {t_fp16 / t_awq:5.2f}x  relerr {err:.1e}", flush=True)
print("\nsum over the four layers (us):")
for M in MS:
    a = sum(r[4] for r in rows if r[3] == M)
    f = sum(r[5] for r in rows if r[3] == M)
    print(f"M={M:5d}  awq {a:9.1f}  fp16 {f:9.1f}  ratio {f / a:5.2f}x")
