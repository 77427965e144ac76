"""wgmma against mma.sync at the GEMV's token counts: fp16 -> fp32 rates from registers and a shared B tile
(kernels_cu/bench_wg.cu awq_wgmma_probe_kernel: m64nNk16, A from registers; bench_util.cu awq_mma_probe_kernel:
mma.m16n8k16), one CTA per SM, by warps per SM and independent accumulators. TFLOP/s count the N useful columns.
Usage: python3 bench/wgmma_probe.py
"""
import cupy as cp
import numpy as np

from awq_cupy import ops
from awq_cupy.kernels import kernel

sms = ops._sm_count(0)
iters = 2048
sink = cp.empty(sms * 1024, dtype=cp.float32)


def rate(k, warps, flops_per_cta):
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
    return flops_per_cta * sms / us * 1e-6, us


for n in (8, 16, 32, 64):
    for nacc in (1, 2, 4, 8):
        if n * nacc > 128:
            continue
        k = kernel("bench_wg", f"awq_wgmma_probe_kernel<{n}, {nacc}>")
        line = []
        for wg in (1, 2, 4):
            tf, us = rate(k, 4 * wg, 2 * 64 * n * 16 * nacc * iters * wg)
            cyc = us * 1980 / (iters * nacc * wg)   # SM cycles per wgmma at 1.98 GHz
            line.append(f"{wg} wg/SM {tf:6.0f} TFLOP/s {cyc:5.1f} cyc")
        print(f"wgmma m64n{n:<2d}k16 acc {nacc}: " + "  ".join(line), flush=True)
for nacc in (4, 8):
    k = kernel("bench_util", f"awq_mma_probe_kernel<{nacc}>")
    line = []
    for warps in (4, 8, 16):
        tf, us = rate(k, warps, 2 * 16 * 8 * 16 * nacc * iters * warps)
        line.append(f"{warps:2d} warps/SM {tf:6.0f} TFLOP/s")
    print(f"mma.sync m16n8k16 acc/warp {nacc}: " + "  ".join(line), flush=True)
