"""The mma.sync ceiling of this GPU: fp16 mma.m16n8k16 with fp32 accumulation from registers only, by warps per SM
and independent accumulators per warp (kernels_cu/bench_util.cu awq_mma_probe_kernel). Usage:
    python3 bench/mma_probe.py
"""
import cupy as cp
import numpy as np

from awq_cupy import ops
from awq_cupy.kernels import kernel

sms = ops._sm_count(0)
iters = 4096
sink = cp.empty(sms * 4 * 1024, dtype=cp.float32)
for nacc in (4, 8, 16):
    k = kernel("bench_util", f"awq_mma_probe_kernel<{nacc}>")
    line = []
    for warps in (4, 8, 16, 32):
        args = (sink, np.int32(iters))
        k.launch((sms,), (32 * warps,), args)
        cp.cuda.Device().synchronize()
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        for _ in range(5):
            k.launch((sms,), (32 * warps,), args)
        e1.record()
        e1.synchronize()
        us = cp.cuda.get_elapsed_time(e0, e1) * 1e3 / 5
        flops = 2 * 16 * 8 * 16 * nacc * iters * warps * sms
        line.append(f"{warps:2d} warps/SM {flops / us * 1e-6:6.0f} TFLOP/s")
    print(f"acc/warp {nacc:2d}: " + "  ".join(line), flush=True)
