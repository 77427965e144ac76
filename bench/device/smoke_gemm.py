"""A hang guard before the GPU tests: a few forced wgmma GEMM launches (the x-producer variants first: 128- and
256-token tiles, one and two K streams, split K, a tail launch, K not a multiple of 64) against the dequantized
weight in fp32, each named before it runs, so that a deadlocked kernel shows which launch it was. Run it under
`timeout`: python3 bench/device/smoke_gemm.py
"""
import cupy as cp
import numpy as np

import awq_cupy
from awq_cupy import formats, launch
from awq_cupy.jit import arch_of_device

rng = np.random.default_rng(0)
CASES = [  # K, N, M, forced plan arguments
    (256, 128, 128, dict(token_tile=128, splits=1, ksplit=1, producers=True)),
    (1000, 520, 200, dict(token_tile=256, splits=1, ksplit=1, producers=True)),
    (4096, 1024, 256, dict(splits=1, ksplit=2, producers=True)),
    (4096, 1024, 300, dict(splits=3, ksplit=1, producers=True)),
    (4096, 1024, 130, dict(token_tile=128, splits=3, ksplit=2, producers=True)),
    (1032, 17416, 257, dict(tail=True, producers=True)),
    (4096, 1024, 256, dict(splits=1, ksplit=1)),
]
for K, N, M, force in CASES:
    G = 128 if K % 128 == 0 else K
    Q = rng.integers(0, 16, (K, N), dtype=np.uint8)
    Z = rng.integers(0, 16, (K // G, N), dtype=np.uint8)
    S = rng.uniform(0.01, 0.02, (K // G, N)).astype(np.float16)
    t = {k: cp.asarray(v) for k, v in formats.pack(Q, Z, S, "gemm", G).items()}
    w = awq_cupy.QuantizedWeight.from_gemm(t["qweight"], t["qzeros"], t["scales"], G, dtype="float16")
    x = cp.asarray(rng.standard_normal((M, K)).astype(np.float16))
    y = cp.full((M, N), np.nan, cp.float16)
    print(f"K={K} N={N} M={M} {force}", end=" ", flush=True)
    launch.run_gemm(x, w, launch.NULL, y, M, "float16", arch_of_device(0), launch.sm_count(0), False, wgmma=True,
                    **force)
    cp.cuda.runtime.deviceSynchronize()
    ref = x.astype(cp.float32) @ awq_cupy.dequantize(w).astype(cp.float32)
    err = float(cp.abs(y.astype(cp.float32) - ref).max() / cp.abs(ref).max())
    print(f"max error / max |ref| = {err:.2e}", "ok" if err < 1e-2 else "WRONG", flush=True)
