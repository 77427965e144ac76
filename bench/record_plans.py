"""Record what matmul launches, on the CPU, with the ops.py of 8c7ed94 (before the launch plans were cached):
for a sweep of layer shapes, M, dtypes, batch_invariant and archs, the path and every kernel launch (variant, grid,
block, dynamic shared memory, PDL, scalar arguments; pointers by name), with fake kernels whose occupancy is a
fixed function of the variant. tests/test_host_path.py replays the sweep through today's planners and launch layer
with the same fakes and compares. Run once, with that tree first on the path:

    git archive 8c7ed94 awq_cupy kernels_cu | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old python3 bench/record_plans.py tests/data/launch_plans_8c7ed94.json.gz
"""
import gzip
import json
import sys
import types

import numpy as np

import awq_cupy
from awq_cupy import jit, kernels, ops

# the sweep (tests/test_host_path.py imports these from here)
SHAPES = ((4096, 6144, 128), (4096, 4096, 128), (4096, 28672, 128), (14336, 4096, 128), (8192, 10240, 128),
          (8192, 57344, 128), (28672, 8192, 128), (1408, 64, 128), (4096, 4096, 32), (2048, 1104, -1),
          (512, 384, 64))
MS = (1, 2, 5, 8, 9, 12, 15, 16, 17, 20, 24, 25, 31, 32, 33, 48, 64, 100, 128, 200, 256, 512, 767, 768, 1024, 4096)
ARCHS = (("90", 132), ("80", 108))
DTYPES = ("float16", "bfloat16")


def fake_resident(variant: str, smem: int) -> int:
    """CTAs per SM the fakes report: a deterministic function of the variant and its shared memory."""
    return 1 if smem > 100 * 1024 or "16, 1, 4" in variant or "32, 1, 4" in variant else 2


def label(a, names):
    if isinstance(a, np.generic):
        return f"{type(a).__name__}:{int(a) if isinstance(a, np.integer) else float(a)}"
    return names.get(id(a), "ptr")


def fake_weight(K, N, G):
    from awq_cupy.formats import resolve_group_size
    from awq_cupy.layout import padded_sizes

    G = resolve_group_size(G, K)
    Kp, Np = padded_sizes(K, N)
    def arr(name):
        return types.SimpleNamespace(name=name, data=types.SimpleNamespace(ptr=0))

    return types.SimpleNamespace(K=K, N=N, group_size=G, NG=K // G, KS=Kp // 64, NT=Np // 64, device=0,
                                 qtiles=arr("qtiles"), scales=arr("scales"), zeros=arr("zeros"))


class FakeKernel:
    def __init__(self, family, variant, log):
        self.family, self.name, self.log = family, variant, log

    def resident_blocks(self, threads, smem):
        return fake_resident(self.name, smem)

    def launch(self, grid, block, args, smem=0, pdl=False):
        self.log.append(dict(family=self.family, variant=self.name, grid=list(grid), block=list(block), smem=int(smem), pdl=bool(pdl),
                             args=[label(a, self.log.names) for a in args]))


class Log(list):
    names: dict = {}


def main(path):
    log = Log()
    state = {"arch": None}
    kernels.kernel = lambda family, variant, device_id=None: FakeKernel(family, variant, log)
    kernels.get_kernel = lambda fam, variant, device_id=None: FakeKernel(fam.name, variant, log)
    jit.arch_of_device = lambda device_id=None, arch_specific=False: state["arch"]
    ops._is_capturing = lambda: False
    workspaces = {what: types.SimpleNamespace(data=types.SimpleNamespace(ptr=0)) for what in ("partials", "x_tiles")}
    ops._workspace = lambda n, dev, what="partials": workspaces[what]
    out = {}
    for arch_key, sms in ARCHS:
        arch = jit.ARCHS[arch_key]
        state["arch"] = arch
        for K, N, G in SHAPES:
            w = fake_weight(K, N, G)
            for dtype in DTYPES:
                if dtype == "bfloat16" and not arch.has_mma_k16:
                    continue
                for M in MS:
                    for bi in (False, True):
                        x2, y2, bias = object(), object(), ops._NULL
                        log.clear()
                        Log.names = {id(x2): "x", id(y2): "y", id(w.qtiles): "qtiles",
                                     id(w.scales): "scales", id(w.zeros): "zeros", id(ops._NULL): "null",
                                     **{id(v): f"ws:{k}" for k, v in workspaces.items()}}
                        row = ops.dispatch.for_arch(arch.key)
                        if not bi and (M <= row.gemv_max_m
                                       or ops.gemv_wide_takes(M, K, N, w.group_size, arch, sms, dtype)):
                            route = "gemv"
                            ops._launch_gemv(x2, w, bias, y2, M, dtype, sms)
                        elif dtype == "float16" and not bi and ops.cublas_beats_fused(M, K, N, arch, sms):
                            route = "cublas"
                        else:
                            route = "gemm"
                            ops._launch_gemm(x2, w, bias, y2, M, dtype, arch, sms, bi)
                        out[f"{arch_key}/{K}x{N}/g{G}/{dtype}/M={M}/bi={int(bi)}"] = dict(path=route,
                                                                                        launches=list(log))
    with gzip.open(path, "wt") as f:
        json.dump(dict(source=awq_cupy.__file__, cases=out), f, separators=(",", ":"))
    print(f"{len(out)} cases recorded to {path}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1])
