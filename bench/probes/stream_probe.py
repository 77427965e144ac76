"""What bandwidth the GEMV's memory pipeline reaches without its math (bench/probes/kernels/probes.cu
awq_stream_probe_kernel), over warps per CTA, ring depth and pieces per unit, timed like `python -m awq_cupy bench`
(queue preloaded, buffers rotated). Usage: python3 bench/probes/stream_probe.py [MB per call, default 61]
"""
import sys

import cupy as cp
import numpy as np

from awq_cupy.bench import Timer
from runtime import kernel   # bench/probes/runtime.py

mb = float(sys.argv[1]) if len(sys.argv) > 1 else 61.0
sms = cp.cuda.Device().attributes["MultiProcessorCount"]
k = kernel("probes", "awq_stream_probe_kernel")
sink = cp.zeros(1, cp.uint32)
timer = Timer()
print(f"{'warps':>5} {'depth':>5} {'tw':>3} {'stridd':>6} {'inflight/SM KB':>14} {'us':>7} {'TB/s':>6}")
configs = [(16, 2, 4), (16, 3, 4), (16, 4, 4), (16, 8, 1), (16, 2, 1), (16, 7, 2), (32, 4, 2), (8, 2, 8), (8, 6, 8)]
for warps, depth, tw in configs:
    smem = warps * depth * tw * 512
    if smem > 227 * 1024:
        continue
    units = max(1, int(mb * 2**20 / (sms * warps * tw * 512)))
    nbytes = sms * warps * units * tw * 512
    for strided in (0,):
        total16 = sms * warps * units * tw * 32
        nbuf = max(2, int(512 * 2**20 // (total16 * 16)))
        bufs = [cp.empty(total16 * 4, dtype=cp.uint32) for _ in range(nbuf)]

        def call(i):
            k.launch((sms,), (32 * warps,), (bufs[i % nbuf], np.int32(units), np.int32(tw), np.int32(strided),
                                             np.int32(depth), sink), smem=smem)
        us = timer(call, max(20, nbuf), 3)
        print(f"{warps:5d} {depth:5d} {tw:3d} {strided:6d} "
              f"{warps * (depth - 1) * tw * 512 / 1024:14.0f} {us:7.1f} {nbytes / us * 1e-6:6.2f}", flush=True)
        del bufs

print(f"{'warps':>5} {'loads in flight/warp':>20} {'inflight/SM KB':>14} {'us':>7} {'TB/s':>6}  (plain loads)")
for warps, U in [(16, 4), (16, 8), (16, 16), (32, 4), (32, 8), (8, 16)]:
    kl = kernel("probes", f"awq_ldg_probe_kernel<{U}>")
    units = max(U, int(mb * 2**20 / (sms * warps * 512)) // U * U)
    nbytes = sms * warps * units * 512
    nbuf = max(2, int(512 * 2**20 // nbytes))
    bufs = [cp.empty(nbytes // 4, dtype=cp.uint32) for _ in range(nbuf)]

    def call(i):
        kl.launch((sms,), (32 * warps,), (bufs[i % nbuf], np.int32(units), sink))
    us = timer(call, max(20, nbuf), 3)
    print(f"{warps:5d} {U:20d} {warps * U * 512 / 1024:14.0f} {us:7.1f} {nbytes / us * 1e-6:6.2f}", flush=True)
    del bufs
