"""The wgmma GEMM's x tile pass alone: time and bandwidth (x read + tiles written) of awq_tile_x_kernel as the
planned call launches it, for a few Mistral-7B / Llama-2-70B shapes. Usage:
    python3 bench/probes/tile_x_pass_bw.py [PKG_DIR] [prepare_gemm keyword=value ...]
PKG_DIR (a path with a '/': a directory holding another awq_cupy/ with kernels_cu/ inside) is put first on
sys.path, to time another version of the pass; keywords go to launch.prepare_gemm (e.g. signal=0 for a tree whose
pass has that switch). Why: a rewrite of the pass (16-byte loads, 32-row items; bench/probes/tile_x_signal.patch)
made the planned GEMMs slower even when the GEMM waited for the whole pass, and timing the pass alone separates
the pass from its interplay with the GEMM (docs/history.md v52)."""
import sys

args = sys.argv[1:]
if args and "/" in args[0] and "=" not in args[0]:
    sys.path.insert(0, args.pop(0))
force = {k: int(v) for k, v in (a.split("=") for a in args)}

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

import awq_cupy  # noqa: E402
from awq_cupy import launch  # noqa: E402
from awq_cupy.bench import random_gemm_tensors  # noqa: E402
from awq_cupy.jit import arch_of_device  # noqa: E402

print(f"# {awq_cupy.__file__} {force}", flush=True)
arch, sms = arch_of_device(0), launch.sm_count(0)
rng = np.random.default_rng(0)
for K, N in ((4096, 4096), (14336, 4096), (28672, 8192)):
    t = random_gemm_tensors(rng, K, N, 128)
    w = awq_cupy.QuantizedWeight.from_gemm(t["qweight"], t["qzeros"], t["scales"], 128, dtype="float16")
    for M in (256, 1024, 4096):
        x = cp.asarray(rng.standard_normal((M, K)).astype(np.float16))
        y = cp.empty((M, N), cp.float16)
        pc = launch.prepare_gemm(w, M, "float16", arch, sms, cp.cuda.get_current_stream().ptr, wgmma=True, **force)
        if not pc.launches[0].kernel.name.startswith("awq_tile_x"):
            print(f"K={K} M={M}: no x tile pass planned ({pc.launches[0].kernel.name})")
            continue
        pc.run(x.data.ptr, y.data.ptr)   # patches x into the pass's slot (and runs the whole call once)
        cp.cuda.runtime.deviceSynchronize()
        a, b = cp.cuda.Event(), cp.cuda.Event()
        n = 50
        a.record()
        for _ in range(n):
            pc.launches[0].fire()
        b.record()
        b.synchronize()
        us = cp.cuda.get_elapsed_time(a, b) * 1e3 / n
        mb = 2 * M * K * 2 / 1e6
        print(f"K={K:6d} M={M:5d}  pass {us:8.1f} us  {mb / us:6.2f} TB/s  grid {pc.launches[0]._cfg.gridDimX}",
              flush=True)
    del w
    cp.get_default_memory_pool().free_all_blocks()
