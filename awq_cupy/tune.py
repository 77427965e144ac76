"""``python -m awq_cupy tune``: measure which kernel is fastest at each M on this GPU and write the dispatch table.

For the chosen layers and M values it times, with the benchmark's method (awq_cupy/bench.py): the GEMV
(M <= 16), the fused tensor-core GEMM and dequantize + cuBLAS (fp16), each summed over the layers. Then
``gemv_max_m`` = the largest measured M up to which the GEMV beats the GEMM at every measured M, and
``cublas_min_m`` = the smallest measured M from which dequantize + cuBLAS beats the GEMM at every larger
measured M (one past the largest M when it never does). The row goes to ``awq_cupy.dispatch.table_path()``
(or ``--out``) under this GPU's arch key and is used by ``matmul`` from then on.
"""
from __future__ import annotations

import sys

DEFAULT_M = [1, 4, 8, 12, 16, 32, 64, 128, 192, 256, 384, 512]


def choose(sums: dict[int, dict[str, float]]) -> tuple[int, int]:
    """(gemv_max_m, cublas_min_m) from {M: {path: summed us}} (paths 'gemv', 'gemm', 'dequant_cublas')."""
    from .dispatch import GEMV_LIMIT

    ms = sorted(sums)
    gemv_max = 0
    for M in ms:
        d = sums[M]
        if M > GEMV_LIMIT or "gemv" not in d or d["gemv"] > d["gemm"]:
            break
        gemv_max = M
    cublas_min = max(ms) + 1
    for M in reversed(ms):
        d = sums[M]
        if M <= gemv_max or "dequant_cublas" not in d or d["dequant_cublas"] >= d["gemm"]:
            break
        cublas_min = M
    return gemv_max, max(cublas_min, gemv_max + 1)


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

    ms = args.m or DEFAULT_M
    models = [("custom", f"{K}x{N}", K, N) for K, N in args.shapes] if args.shapes else args.models
    paths = ["gemv", "gemm"] + (["dequant_cublas"] if args.dtype == "float16" else [])
    rows = run(models, ms, dtype=args.dtype, group_size=args.group_size, trials=args.trials,
               rotate_mb=args.rotate_mb, contenders=tuple(paths))
    sums: dict[int, dict[str, float]] = {}
    for r in rows:
        sums.setdefault(r.M, {}).setdefault(r.contender, 0.0)
        sums[r.M][r.contender] += r.us
    gemv_max, cublas_min = choose(sums)
    arch = arch_of_device(cupy.cuda.runtime.getDevice())
    row = dispatch.Dispatch(gemv_max_m=gemv_max, cublas_min_m=cublas_min)
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
    print(f"sm_{arch.key}: gemv_max_m={gemv_max}, cublas_min_m={cublas_min} -> written to {path}")
    return 0
