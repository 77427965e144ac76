"""How many thread-block clusters of each size the GPU holds at once for the wgmma GEMM's default shapes
(cuOccupancyMaxActiveClusters), next to the CTAs it holds without clusters: what a split-K-in-a-cluster plan has
to count (docs/history.md v21). Usage: python3 bench/probes/cluster_occupancy.py
"""
import ctypes
import dataclasses

import cupy as cp

from awq_cupy import driver, jit, kernels, launch

shapes = [(s, None) for s in sorted(set(kernels.GEMM_WG_DEFAULT.values()))]
shapes += [(s, p) for s, p in kernels.GEMM_WG_PEND_TWO_PER_SM.items()]
names = {(s, p): kernels.WgmmaVariant("float16", *s, True, p) for s, p in shapes}
fam = dataclasses.replace(kernels.GEMM_WG, variants=lambda arch: tuple(names.values()), asserts=None)

lib = driver.cuda_driver()
lib.cuOccupancyMaxActiveClusters.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p,
                                             ctypes.POINTER(driver.LaunchConfig)]
lib.cuOccupancyMaxActiveClusters.restype = ctypes.c_int
sms = launch.sm_count(0)
print(f"{sms} SMs; per shape: CTAs resident without clusters, then for cluster sizes 1..8 the clusters resident "
      f"(and the CTAs they hold)")
for (shape, pend), name in names.items():
    k = jit.get_kernel(fam, name)
    smem = name.smem_bytes
    plain = k.resident_blocks(32 * kernels.GEMM_WARPS, smem) * sms   # also sets the dynamic shared-memory limit
    row = []
    for size in range(1, 9):
        attrs, n = driver.launch_attributes(False, (1, size, 1))
        cfg = driver.LaunchConfig(1, size, 1, 32 * kernels.GEMM_WARPS, 1, 1, smem, None,
                                ctypes.cast(attrs, ctypes.POINTER(driver.LaunchAttribute)), n)
        got = ctypes.c_int(-1)
        err = lib.cuOccupancyMaxActiveClusters(ctypes.byref(got), ctypes.c_void_p(k._func.ptr), ctypes.byref(cfg))
        row.append(f"{size}:{got.value}({got.value * size})" if err == 0 else f"{size}:err{err}")
    print(f"{str(shape):12s} PEND {pend or kernels.gemm_wg_pend(shape[0])}  plain {plain:4d}  " + "  ".join(row),
          flush=True)
cp.cuda.Device().synchronize()
