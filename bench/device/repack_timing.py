"""Load-time cost: repack a whole Mistral-7B's linear layers (32 blocks x qkv, o, gate_up, down; gemm format,
group 128) into awq_cupy's layout on the GPU, and report the time and the memory the repacked weights hold against the packed size."""
import time

import cupy as cp
import numpy as np

import awq_cupy
from awq_cupy import formats

rng = np.random.default_rng(0)
layers = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]
src = []
for K, N in layers:   # one random layer per shape, uploaded once; the 32 blocks reuse it
    G = 128
    t = formats.pack(rng.integers(0, 16, (K, N), dtype=np.uint8), rng.integers(0, 16, (K // G, N), dtype=np.uint8),
                     rng.uniform(0.001, 0.01, (K // G, N)).astype(np.float16), "gemm", G)
    src.append({k: cp.asarray(v) for k, v in t.items()})
packed = sum(sum(a.nbytes for a in s.values()) for s in src) * 32
pool = cp.get_default_memory_pool()
awq_cupy.QuantizedWeight.from_gemm(src[0]["qweight"], src[0]["qzeros"], src[0]["scales"], 128)   # compile + warm
cp.cuda.Device().synchronize()
base = pool.used_bytes()
t0 = time.perf_counter()
weights = []
for _ in range(32):
    for s in src:
        weights.append(awq_cupy.QuantizedWeight.from_gemm(s["qweight"], s["qzeros"], s["scales"], 128))
cp.cuda.Device().synchronize()
dt = time.perf_counter() - t0
held = sum(w.nbytes for w in weights)
print(f"repacked 128 Mistral-7B layers ({packed / 1e9:.2f} GB packed gemm) in {dt:.2f} s; "
      f"QuantizedWeights hold {held / 1e9:.2f} GB; pool grew {(pool.used_bytes() - base) / 1e9:.2f} GB")
