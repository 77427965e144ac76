"""The per-call floor of the benchmark's method and the pure-read time of each layer's int4 bytes, next to the
GEMV, all timed like `python -m awq_cupy bench` (queue preloaded, buffers rotated) in one process. Usage:
    python3 bench/probes/launch_floor.py [model] [M]   (default mistral-7b, 1)
- empty: awq_empty_kernel (pdl trigger + wait only), one CTA per SM of 384 threads, with and without the PDL
  attribute, with no shared memory or enough of it that two CTAs cannot share an SM.
- read: awq_read_pdl_kernel, one CTA per SM streaming the layer's int4 bytes (weights, scales, zeros), U loads
  per thread in flight; with PDL every load is issued before the wait on the previous grid.
- code: awq_code_probe_kernel, straight-line FMAs of growing length (how fast a first pass through code runs).
- gemv: awq_cupy.matmul (the planned GEMV) on the same layer.
"""
import sys

import cupy as cp
import numpy as np

import awq_cupy
from awq_cupy import launch
from awq_cupy.bench import MODELS, Timer, rotated_weights
from runtime import kernel   # bench/probes/runtime.py

model = sys.argv[1] if len(sys.argv) > 1 else "mistral-7b"
M = int(sys.argv[2]) if len(sys.argv) > 2 else 1
sms = launch.sm_count(0)
timer = Timer()
sink = cp.zeros(4 * sms, cp.uint32)
TRIALS = 5

empty = kernel("probes", "awq_empty_kernel")
print("# empty kernel, one CTA per SM (us per call)")
for threads in (384, 512):
    for smem in (0, 160 * 1024):
        for pdl in (False, True):
            us = timer(lambda i: empty.launch((sms,), (threads,), (sink, np.int32(i)), smem=smem, pdl=pdl), 200,
                       TRIALS)
            print(f"empty   threads={threads:4d} smem={smem // 1024:4d}KB pdl={int(pdl)}  {us:7.2f}", flush=True)

print("# straight-line code: 16 N fp32 FMAs per thread, one CTA per SM (us per call; issue-bound at one instruction "
      "per cycle a warp would take 16 N / clock)")
fsink = cp.zeros(1024, cp.float32)
for n in (16, 64, 256, 1024):
    code = kernel("probes", f"awq_code_probe_kernel<{n}>")
    for threads in (32, 128):
        us = timer(lambda i: code.launch((sms,), (threads,), (fsink, np.float32(i)), pdl=True), 200, TRIALS)
        print(f"code    N={n:5d} ({16 * n:6d} FMAs) threads={threads:4d} pdl=1  {us:7.2f}", flush=True)

rng = np.random.default_rng(0)
sums = {}
print("# per layer (us): pure read of the int4 bytes, then the planned GEMV")
for name, K, N in MODELS[model]:
    G = 128
    nbytes = K * N // 2 + 2 * (K // G) * N * 2           # int4 weights + fp16 scales + fp16 zeros (as stored)
    n16 = nbytes // 16
    nbuf = max(2, -(-512 * 2**20 // nbytes))
    bufs = [cp.empty(n16 * 4, cp.uint32) for _ in range(nbuf)]
    res = {}
    for U in (4, 8):
        k = kernel("probes", f"awq_read_pdl_kernel<{U}>")
        for threads in (256, 512):
            for pdl in (False, True):
                us = timer(lambda i: k.launch((sms,), (threads,), (bufs[i % nbuf], np.int64(n16), sink), pdl=pdl),
                           max(20, nbuf), TRIALS)
                res[f"read U{U} t{threads} pdl{int(pdl)}"] = us
    bufs = None
    cp.get_default_memory_pool().free_all_blocks()
    wq = rotated_weights(rng, K, N, G)
    nq = len(wq)
    x = cp.asarray(rng.standard_normal((M, K)).astype(np.float16))
    y = cp.empty((M, N), cp.float16)
    res["gemv"] = timer(lambda i: awq_cupy.matmul(x, wq[i % nq], out=y), max(20, nq), TRIALS)
    wq = None
    cp.get_default_memory_pool().free_all_blocks()
    best = min((v, c) for c, v in res.items() if c.startswith("read"))
    print(f"{name:8s} K={K:6d} N={N:6d} {nbytes / 2**20:7.1f} MiB  " + "  ".join(f"{c} {v:6.2f}" for c, v in
                                                                          res.items())
          + f"  | best read {best[0]:6.2f} ({best[1]}, {nbytes / best[0] * 1e-6:4.2f} TB/s)", flush=True)
    for c, v in res.items():
        sums[c] = sums.get(c, 0.0) + v
print("sum     " + "  ".join(f"{c} {v:6.2f}" for c, v in sums.items()))
