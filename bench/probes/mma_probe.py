"""The mma.sync ceiling of this GPU: fp16 mma.m16n8k16 with fp32 accumulation from registers only, by warps per SM
and independent accumulators per warp (bench/probes/kernels/probes.cu awq_mma_probe_kernel). Usage:
    python3 bench/probes/mma_probe.py
``rate`` and ``mma_sync_rates`` are shared with bench/probes/wgmma_probe.py.
"""
import cupy as cp
import numpy as np

from awq_cupy import launch
from runtime import kernel   # bench/probes/runtime.py


def rate(k, warps: int, iters: int, flops_per_cta: float) -> tuple[float, float]:
    """(TFLOP/s, us per launch) of a register-only probe kernel ``k(sink, iters)`` on one CTA of ``warps`` warps per
    SM: one warm-up launch, then the mean of 5."""
    sms = launch.sm_count(0)
    sink = cp.empty(sms * 32 * warps, dtype=cp.float32)
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


def mma_sync_rates(accs, warps_per_sm, iters: int) -> None:
    """Prints the mma.sync rate per independent accumulators per warp and warps per SM."""
    for nacc in accs:
        k = kernel("probes", f"awq_mma_probe_kernel<{nacc}>")
        line = [f"{warps:2d} warps/SM {rate(k, warps, iters, 2 * 16 * 8 * 16 * nacc * iters * warps)[0]:6.0f} TFLOP/s"
                for warps in warps_per_sm]
        print(f"mma.sync m16n8k16 acc/warp {nacc:2d}: " + "  ".join(line), flush=True)


if __name__ == "__main__":
    mma_sync_rates((4, 8, 16), (4, 8, 16, 32), 4096)
