"""The fused GEMM under the two split-K policies of awq_cupy.ops.plan_splits ("waves": the cost model,
"target": about two CTAs per SM), on the Mistral-7B layers, timed like `python -m awq_cupy bench`.
Usage: python3 bench/splits_compare.py [M,...]   (default 16,32,64,128)
"""
import sys

import cupy as cp
import numpy as np

from awq_cupy import ops
from awq_cupy.bench import MODELS, Timer, rotated_weights
from awq_cupy.jit import arch_of_device

ms = [int(v) for v in sys.argv[1].split(",")] if len(sys.argv) > 1 else [16, 32, 64, 128]
arch = arch_of_device(0)
sms = ops._sm_count(0)
timer = Timer()
rng = np.random.default_rng(0)
sums = {}
for name, K, N in MODELS["mistral-7b"]:
    G = 128
    wq = rotated_weights(rng, K, N, G)
    nq = len(wq)
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
