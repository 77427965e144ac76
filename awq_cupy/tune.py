"""``python -m awq_cupy tune``: measure which kernel is fastest at each M on this GPU and write the dispatch table.

For the chosen layers and M values it times, with the benchmark's method (awq_cupy/bench.py): the GEMV
(M <= 16), the fused tensor-core GEMM (on compute capability 9.0 both its kernels: mma.sync and wgmma) and
dequantize + cuBLAS (fp16), each summed over the layers. Then ``wgmma_min_m`` = the smallest measured M from
which the wgmma GEMM beats the mma.sync one at every larger measured M (None when it never does or the GPU has
no wgmma kernel), the GEMM's time at each M being that of the kernel this picks; ``gemv_max_m`` = the largest
measured M up to which the GEMV beats the GEMM at every measured M; ``cublas_min_m`` = the smallest measured M
from which dequantize + cuBLAS beats the GEMM at every larger measured M (one past the largest M when it never
does); where the built-in row has a cost model that picks the path per layer shape (sm_90), the smallest M from
256 on at which dequantize + cuBLAS wins on some measured layer, the model keeping its built-in constants. The
row goes to ``awq_cupy.dispatch.table_path()`` (or ``--out``) under this GPU's arch key and is used
by ``matmul`` from then on.
"""
from __future__ import annotations

import sys

# up to 2048: on the H200 the fused wgmma GEMM and dequantize + cuBLAS cross near M = 1024 (bench/NOTES.md v13)
DEFAULT_M = [1, 4, 8, 12, 16, 24, 32, 48, 64, 128, 256, 512, 768, 1024, 1536, 2048]


def choose(sums: dict[int, dict[str, float]], per_layer: dict | None = None) -> tuple[int, int, int | None]:
    """(gemv_max_m, cublas_min_m, wgmma_min_m) from {M: {path: summed us}}, paths 'gemv', 'dequant_cublas' and
    either 'gemm' or the two GEMM kernels 'gemm_sw' and 'gemm_wg'. With ``per_layer`` ({(layer, M): {path: us}},
    for a row whose cost model decides per layer from cublas_min_m on), cublas_min_m is instead the smallest M of
    at least 256 at which dequantize + cuBLAS beats the wgmma GEMM on some layer (one past the largest M when it
    never does)."""
    from .dispatch import GEMV_LIMIT

    ms = sorted(sums)
    wgmma_min = None
    if any("gemm_wg" in d for d in sums.values()):
        for M in reversed(ms):
            d = sums[M]
            if "gemm_wg" not in d or "gemm_sw" not in d or d["gemm_wg"] > d["gemm_sw"]:
                break
            wgmma_min = M
        sums = {M: dict(d, gemm=d["gemm_wg"] if wgmma_min is not None and M >= wgmma_min else d["gemm_sw"])
                for M, d in sums.items()}
    gemv_max = 0
    for M in ms:
        d = sums[M]
        if M > GEMV_LIMIT or "gemv" not in d or d["gemv"] > d["gemm"]:
            break
        gemv_max = M
    cublas_min = max(ms) + 1
    if per_layer is not None:
        wins = [M for (_, M), d in per_layer.items() if M >= 256 and M > gemv_max and "dequant_cublas" in d
                and d["dequant_cublas"] < d.get("gemm_wg", d.get("gemm", float("inf")))]
        return gemv_max, max(min(wins, default=cublas_min), gemv_max + 1), wgmma_min
    for M in reversed(ms):
        d = sums[M]
        if M <= gemv_max or "dequant_cublas" not in d or d["dequant_cublas"] >= d["gemm"]:
            break
        cublas_min = M
    return gemv_max, max(cublas_min, gemv_max + 1), wgmma_min


def main(args) -> int:
    from ._array import gpu_available

    if not gpu_available():
        print("python -m awq_cupy tune needs a CUDA GPU: none is available here "
              "(cupy.cuda.is_available() is False). Nothing was measured.", file=sys.stderr)
        return 2
    import cupy

    from . import dispatch
    from .bench import environment, run
    from .jit import arch_of_device
    from .ops import has_wgmma

    ms = args.m or DEFAULT_M
    models = [("custom", f"{K}x{N}", K, N) for K, N in args.shapes] if args.shapes else args.models
    arch = arch_of_device(cupy.cuda.runtime.getDevice())
    paths = ["gemv"] + (["gemm_sw", "gemm_wg"] if has_wgmma(arch) else ["gemm"])
    paths += ["dequant_cublas"] if args.dtype == "float16" else []
    rows = run(models, ms, dtype=args.dtype, group_size=args.group_size, trials=args.trials,
               rotate_mb=args.rotate_mb, contenders=tuple(paths))
    sums: dict[int, dict[str, float]] = {}
    per_layer: dict = {}
    for r in rows:
        sums.setdefault(r.M, {}).setdefault(r.contender, 0.0)
        sums[r.M][r.contender] += r.us
        per_layer.setdefault((f"{r.model}/{r.layer}", r.M), {})[r.contender] = r.us
    modelled = dispatch.TABLE.get(arch.key, dispatch.TABLE["default"]).has_cost_model and has_wgmma(arch)
    gemv_max, cublas_min, wgmma_min = choose(sums, per_layer if modelled else None)
    # the built-in cost model (per layer shape from cublas_min_m on) stays with the tuned thresholds
    row = dispatch.Dispatch(gemv_max_m=gemv_max, cublas_min_m=cublas_min, wgmma_min_m=wgmma_min,
                            **dispatch.builtin_model(arch.key, cublas_min, wgmma_min))
    env = environment()
    path = args.out or dispatch.table_path()
    if path is None:
        print("AWQ_CUPY_DISPATCH=builtin: pass --out to write the table somewhere", file=sys.stderr)
        return 2
    dispatch.write_table(path, {arch.key: row}, {arch.key: dict(gpu=env["gpu"], date=env["date"], dtype=args.dtype,
                                                               models=[str(m) for m in models],
                                                               sums_us={str(M): d for M, d in sums.items()})})
    print(f"{'M':>5} " + " ".join(f"{p:>15}" for p in paths))
    for M in sorted(sums):
        print(f"{M:5d} " + " ".join(f"{sums[M].get(p, float('nan')):15.1f}" for p in paths))
    print(f"sm_{arch.key}: gemv_max_m={gemv_max}, cublas_min_m={cublas_min}, wgmma_min_m={wgmma_min} "
          f"-> written to {path}")
    return 0
