"""The fused GEMM under the two split-K policies of awq_cupy.ops.plan_splits ("waves": the cost model,
"target": about two CTAs per SM), on the Mistral-7B layers, timed like `python -m awq_cupy bench`.
Usage: python3 bench/splits_compare.py [M,...]   (default 16,32,64,128)
"""
import sys

import cupy as cp
import numpy as np

import awq_cupy
from awq_cupy import formats, ops
from awq_cupy.bench import MODELS, Timer
from awq_cupy.jit import arch_of_device

ms = [int(v) for v in sys.argv[1].split(",")] if len(sys.argv) > 1 else [16, 32, 64, 128]
arch = arch_of_device(0)
sms = ops._sm_count(0)
timer = Timer()
rng = np.random.default_rng(0)
sums = {}
for name, K, N in MODELS["mistral-7b"]:
    G = 128
    t = formats.pack(rng.integers(0, 16, (K, N), dtype=np.uint8), rng.integers(0, 16, (K // G, N), dtype=np.uint8),
                     rng.uniform(0.001, 0.01, (K // G, N)).astype(np.float16), "gemm", G)
    w0 = awq_cupy.QuantizedWeight.from_gemm(t["qweight"], t["qzeros"], t["scales"], G)
    nq = max(2, -(-512 * 2**20 // w0.nbytes))
    wq = [w0] + [awq_cupy.QuantizedWeight(qtiles=w0.qtiles.copy(), scales=w0.scales.copy(), zeros=w0.zeros.copy(),
                                          K=K, N=N, group_size=G, dtype="float16") for _ in range(nq - 1)]
    for M in ms:
        x = cp.asarray(rng.standard_normal((M, K)).astype(np.float16))
        y = cp.empty((M, N), cp.float16)
        line = []
        for policy in ("target", "waves"):
            ops._SPLIT_POLICY = policy
            us = timer(lambda i: ops._launch_gemm(x, wq[i % nq], ops._NULL, y, M, "float16", arch, sms, False),
                       max(20, nq), 3)
            sums[(M, policy)] = sums.get((M, policy), 0.0) + us
            line.append(f"{policy} {us:7.1f}us")
        ops._SPLIT_POLICY = "waves"
        print(f"{name:8s} M={M:4d}  " + "  ".join(line), flush=True)
    del wq
    cp.get_default_memory_pool().free_all_blocks()
for M in ms:
    print(f"sum M={M:4d}  target {sums[(M, 'target')]:7.1f}us  waves {sums[(M, 'waves')]:7.1f}us")
