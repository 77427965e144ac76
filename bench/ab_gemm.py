"""A/B timing of the GEMM on a few Mistral-7B cases, timed like `python -m awq_cupy bench`. Usage:
    python3 bench/ab_gemm.py LABEL [PKG_DIR] RUN...
RUN is "name" or "name:key=value,..." with keyword arguments for ops._launch_gemm (splits, ctas, tiles, depth).
PKG_DIR (a directory holding another awq_cupy/ and kernels_cu/) is put first on sys.path when given.
"""
import sys

args = sys.argv[1:]
label = args.pop(0)
if args and not ":" in args[0] and "/" in args[0]:
    sys.path.insert(0, args.pop(0))

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

import awq_cupy  # noqa: E402
from awq_cupy import ops  # noqa: E402
from awq_cupy.bench import MODELS, Timer, rotated_weights  # noqa: E402
from awq_cupy.jit import arch_of_device  # noqa: E402

print(f"# {label}: {awq_cupy.__file__}", flush=True)
runs = []
for a in args:
    name, _, kv = a.partition(":")
    runs.append((name, {k: int(v) for k, v in (p.split("=") for p in kv.split(",") if p)}))
CASES = {"qkv": (256,), "o": (128,), "gate_up": (64, 256), "down": (128,)}
arch = arch_of_device(0)
sms = ops._sm_count(0)
timer = Timer()
rng = np.random.default_rng(0)
for name, K, N in MODELS["mistral-7b"]:
    wq = rotated_weights(rng, K, N, 128)
    nq = len(wq)
    for M in CASES[name]:
        x = cp.asarray(rng.standard_normal((M, K)).astype(np.float16))
        y = cp.empty((M, N), cp.float16)
        line = []
        for run, kw in runs:
            us = timer(lambda i: ops._launch_gemm(x, wq[i % nq], ops._NULL, y, M, "float16", arch, sms, False,
                                                  wgmma=True, **kw), max(20, nq), 3)
            line.append(f"{run} {us:7.1f}")
        print(f"{label:8s} {name:8s} M={M:5d}  " + "  ".join(line), flush=True)
    del wq
    cp.get_default_memory_pool().free_all_blocks()
