"""Does a warpgroup's wgmma (A from registers, B from shared memory) keep its rate while other warps of the CTA
store into shared memory at full speed? The question behind a GEMM whose producer warps decode the weights into a
shared-memory wgmma operand (docs/history.md v33): at m64n256k16 the B reads alone are 8 KB per instruction, and
the decoded weights would add as many bytes of stores. bench/probes/kernels/wgmma_probes.cu awq_wgmma_sts_probe_kernel, one CTA
per SM. Prints SM cycles per wgmma and the producers' shared-memory store rate (bytes per SM cycle).
Usage: python3 bench/probes/wgmma_sts_probe.py [second]   (second: only the last table, what the decode competes with)
"""
import sys

import cupy as cp
import numpy as np

from awq_cupy import launch
from runtime import kernel   # bench/probes/runtime.py

sms = launch.sm_count(0)
iters = 4096


def probe(variant: str, n: int, pw: int) -> tuple[float, float]:
    """(consumer SM cycles per k16 step, producer stores in bytes per SM cycle), medians over the SMs, of the
    second of two launches."""
    k = kernel("wgmma_probes", variant)
    threads = 128 + 32 * pw
    sink = cp.zeros(sms * threads, dtype=cp.float32)
    counts = cp.zeros(3 * sms, dtype=cp.uint64)
    for _ in range(2):   # the first launch warms up
        k.launch((sms,), (threads,), (sink, counts, np.int32(iters)), smem=n * 128 + 32768 + 1024)
    cp.cuda.Device().synchronize()
    c = cp.asnumpy(counts).reshape(sms, 3).astype(np.float64)
    sts = float(np.median(c[:, 1] * 32 * 16 / np.maximum(c[:, 2], 1))) if pw else 0.0
    return float(np.median(c[:, 0])) / (4 * iters), sts


for n in (() if "second" in sys.argv else (64, 256)):
    for pw, dec in ((0, 0), (4, 0), (8, 0), (4, 1), (8, 1), (12, 1)):
        if n == 256 and pw > 8:   # 512 threads cap registers at 128, too few for m64n256's accumulators
            continue
        cyc, sts = probe(f"awq_wgmma_sts_probe_kernel<{n}, {pw}, {dec}>", n, pw)
        ideal = 64 * n * 16 / 2048   # cycles at 2048 fp16 FMA per SM cycle
        print(f"m64n{n}k16, {pw} producer warps, {'decode + store' if dec else 'store only'}: {cyc:6.1f} cycles "
              f"per wgmma (ideal {ideal:.0f}; B reads {n * 32 / cyc:5.1f} B/cycle), stores {sts:5.1f} B/cycle",
              flush=True)
# What the decode competes with: the producers' 13 operations per 16 bytes as the GEMM's decode (1), integer LOP3
# only (2), half2 multiplies only (3), with the consumers' m64n256k16 wgmmas running or only waiting as long.
for dec in (1, 2, 3):
    for mma in (True, False):
        name = f"awq_wgmma_sts_probe_kernel<256, 8, {dec}" + (", false>" if not mma else ">" if dec == 1 else ", true>")
        cyc, sts = probe(name, 256, 8)
        what = {1: "GEMM decode", 2: "13 LOP3", 3: "13 HMUL2"}[dec]
        print(f"8 producer warps, {what:11s} + store, wgmma m64n256k16 {'running' if mma else 'absent '}: "
              f"{cyc:6.1f} consumer cycles per step, stores {sts:5.1f} B/cycle", flush=True)
