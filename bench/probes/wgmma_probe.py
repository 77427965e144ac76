"""wgmma against mma.sync at the GEMV's token counts: fp16 -> fp32 rates from registers and a shared B tile
(bench/probes/kernels/wgmma_probes.cu awq_wgmma_probe_kernel: m64nNk16, A from registers; probes.cu awq_mma_probe_kernel:
mma.m16n8k16), one CTA per SM, by warps per SM and independent accumulators. TFLOP/s count the N useful columns.
Usage: python3 bench/probes/wgmma_probe.py
"""
from runtime import kernel   # bench/probes/runtime.py
from mma_probe import mma_sync_rates, rate   # bench/probes is the script's directory

iters = 2048
for n in (8, 16, 32, 64):
    for nacc in (1, 2, 4, 8):
        if n * nacc > 128:
            continue
        k = kernel("wgmma_probes", f"awq_wgmma_probe_kernel<{n}, {nacc}>")
        line = []
        for wg in (1, 2, 4):
            tf, us = rate(k, 4 * wg, iters, 2 * 64 * n * 16 * nacc * iters * wg)
            cyc = us * 1980 / (iters * nacc * wg)   # SM cycles per wgmma at 1.98 GHz
            line.append(f"{wg} wg/SM {tf:6.0f} TFLOP/s {cyc:5.1f} cyc")
        print(f"wgmma m64n{n:<2d}k16 acc {nacc}: " + "  ".join(line), flush=True)
mma_sync_rates((4, 8), (4, 8, 16), iters)
